"""Speculative decoding's pieces in isolation: config parsing, n-gram lookup, the exact
rejection sampler (χ² against the target distribution) and the sampler's target distributions."""
import json

import pytest
import torch
from scipy.stats import chisquare

from tokenmill.engine.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.costs import linear_costs
from tokenmill.spec.ngram import propose_ngram
from tokenmill.spec.rejection import sample_from, verify_drafts


# ---- config ------------------------------------------------------------------------------
def test_config_parses_json_and_dicts():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                  '"prompt_lookup_max": 4}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 4)
    cfg = SpeculativeConfig.parse({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
                                   "disable_by_batch_size": 8})
    assert cfg.model == "m" and cfg.disable_by_batch_size == 8
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only for method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo_key": 1}, "typo_key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "only for method draft_model"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "quantize_lm_head": True}, "needs 'quantization'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_k": "yes"}, "adaptive_k"),
])
def test_config_refuses_bad_values_by_name(value, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.parse(value)


# ---- n-gram lookup -----------------------------------------------------------------------
def test_ngram_continues_the_latest_earlier_occurrence():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 5 (followed by 7 8 5) and at 0; the latest wins
    assert propose_ngram(toks, 3, 1, 3) == [7, 8, 5]
    assert propose_ngram(toks, 5, 1, 3) == [7, 8, 5, 1, 2]
    assert propose_ngram([4, 5, 6], 3, 1, 3) == []                 # nothing recurs
    assert propose_ngram([4, 5, 6, 5], 2, 1, 3) == [6, 5]          # falls back to n = 1
    assert propose_ngram([4, 5, 6, 5], 2, 2, 3) == []              # min 2: no 2-gram recurs
    assert propose_ngram(toks, 0, 1, 3) == []


def test_ngram_prefers_longer_matches():
    toks = [3, 1, 2, 4, 0, 2, 5, 3, 1, 2]
    assert propose_ngram(toks, 1, 1, 3) == [4]     # [3, 1, 2] at 0 beats the later [2] at 5
    assert propose_ngram(toks, 1, 1, 1) == [5]


# ---- rejection sampler -------------------------------------------------------------------
def test_greedy_target_accepts_exactly_the_argmax_prefix():
    V = 10
    argmax = [3, 5, 7, 1]
    target = torch.zeros(4, V)
    target[torch.arange(4), torch.tensor(argmax)] = 1.0
    assert verify_drafts(target, [3, 5, 7], None, [0.999999] * 4) == ([3, 5, 7, 1], 3)
    assert verify_drafts(target, [3, 4, 7], None, [0.0] * 4) == ([3, 5], 1)
    assert verify_drafts(target, [9, 5, 7], None, [0.5] * 4) == ([3], 0)
    # a draft distribution does not change a greedy verdict
    q = torch.full((3, V), 1.0 / V)
    assert verify_drafts(target, [3, 4, 7], q, [0.3] * 4) == ([3, 5], 1)


def test_sample_from_never_picks_zero_weight_tokens():
    w = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    assert {sample_from(w, u) for u in (0.0, 0.1, 0.2499, 0.25, 0.9, 0.99999999999)} == {1, 3}


def _wrong_residual(target, drafts, draft_probs, uniforms):
    """A classic bug: after a rejection, resample from p_j instead of max(0, p_j - q_j)."""
    k = len(drafts)
    for j in range(k):
        q = 1.0 if draft_probs is None else float(draft_probs[j, drafts[j]])
        if uniforms[j] * q >= float(target[j, drafts[j]]):
            return drafts[:j] + [sample_from(target[j], uniforms[k])], j
    return drafts + [sample_from(target[k], uniforms[k])], k


def _emitted_counts(verify, p, q, trials, seed):
    """Run `verify` on drafts drawn from q (or one-hot proposals drawn from q when one_hot);
    count the token emitted at each position, over the trials that reach it."""
    k, V = q.shape
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(k + 1, V)
    drafts_all = torch.multinomial(q, trials, replacement=True, generator=gen).T.tolist()   # [trials, k]
    us = torch.rand(trials, k + 1, dtype=torch.float64, generator=gen).tolist()
    for drafts, u in zip(drafts_all, us):
        tokens, _ = verify(p, drafts, q, u)
        for pos, t in enumerate(tokens):
            counts[pos, t] += 1
    return counts


def _chi2_pvalues(counts, p):
    pvals = []
    for j in range(p.shape[0]):
        n = counts[j].double().sum()
        if n >= 500:
            expected = p[j].double() / p[j].double().sum() * n
            pvals.append(chisquare(counts[j].double().numpy(), expected.numpy()).pvalue)
    return pvals


@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_tokens_follow_the_target_distribution_and_a_wrong_rule_fails(one_hot):
    """Positions are independent of the prefix here, so the token emitted at position j must be
    distributed as p_j whenever position j is reached. 20k trials, V = 6, k = 3."""
    V, k, trials = 6, 3, 20000
    gen = torch.Generator().manual_seed(7)      # all of the test's randomness: the same p, q every run

    def dirichlet(rows: int) -> torch.Tensor:   # Dirichlet(1, ..., 1): normalised exponentials
        e = -torch.rand(rows, V, generator=gen).log()
        return e / e.sum(-1, keepdim=True)

    p, q = dirichlet(k + 1), dirichlet(k)
    if one_hot:
        # n-gram style: the proposal is a fixed guess; q is one-hot at it (draft_probs None)
        guesses = torch.multinomial(torch.ones(V), k, replacement=True, generator=gen)
        q = torch.zeros(k, V)
        q[torch.arange(k), guesses] = 1.0

    def correct(target, drafts, draft_probs, u):
        return verify_drafts(target, drafts, None if one_hot else draft_probs, u)

    def wrong(target, drafts, draft_probs, u):
        return _wrong_residual(target, drafts, None if one_hot else draft_probs, u)

    good = _chi2_pvalues(_emitted_counts(correct, p, q, trials, seed=1), p)
    bad = _chi2_pvalues(_emitted_counts(wrong, p, q, trials, seed=1), p)
    assert len(good) >= 2
    assert min(good) > 0.01 / len(good), good          # Bonferroni over the positions tested
    assert min(bad) < 1e-6, bad


# ---- the sampler's target distributions ---------------------------------------------------
class _Ctx:
    def __init__(self, params, prompt=(), output=()):
        self.params, self.prompt_token_ids, self.generator = params, list(prompt), None
        self.output_token_ids = list(output)
        self.num_output_tokens = len(self.output_token_ids)


def _reference_probs(logits, p: SamplingParams):
    """Straightforward sort-based temperature -> top-k -> top-p -> min-p, for one row."""
    x = logits.double() / p.temperature
    probs = x.softmax(-1)
    order = probs.argsort(descending=True)
    sp = probs[order]
    keep = torch.ones_like(sp, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    if p.top_p < 1.0:
        sp_k = torch.where(keep, sp, torch.zeros_like(sp)) / torch.where(keep, sp, torch.zeros_like(sp)).sum()
        ahead = sp_k.cumsum(0) - sp_k
        keep &= ahead < p.top_p
        keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sp[keep]
    if p.min_p > 0:
        out[out < p.min_p * out.max()] = 0
    return out / out.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.5, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.2),
])
def test_sampler_probs_match_a_reference(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 1000) * 3
    sampler = Sampler(1000)
    probs = sampler.probs(logits, [_Ctx(params)] * 3)
    for r in range(3):
        torch.testing.assert_close(probs[r].double(), _reference_probs(logits[r], params), atol=1e-6, rtol=1e-4)


def test_sampler_probs_greedy_and_penalties_and_min_tokens():
    logits = torch.tensor([[1.0, 5.0, 2.0, 4.9], [1.0, 5.0, 2.0, 4.9], [1.0, 5.0, 2.0, 4.9]])
    sampler = Sampler(4, eos_token_ids=[1])
    greedy = SamplingParams(temperature=0)
    probs = sampler.probs(logits, [_Ctx(greedy), _Ctx(SamplingParams(temperature=0, repetition_penalty=2.0), output=[1]),
                                   _Ctx(SamplingParams(temperature=0, min_tokens=3), output=[0])])
    assert probs[0].tolist() == [0, 1, 0, 0]      # argmax
    assert probs[1].tolist() == [0, 0, 0, 1]      # token 1 penalised below token 3
    assert probs[2].tolist() == [0, 0, 0, 1]      # EOS (1) masked before min_tokens
    # the same processing as the sampler's own draw
    assert sampler(logits[1:2], [_Ctx(SamplingParams(temperature=0, repetition_penalty=2.0), output=[1])]).token_ids == [3]


# ---- adaptive draft length -------------------------------------------------------------------
def test_best_k_follows_acceptance_and_cost():
    from tokenmill.spec.adaptive import best_k
    c = lambda per_draft: linear_costs(8, per_draft)
    assert best_k([0.95] * 8, c(0.1)) == 8        # a draft that is nearly always right: draft long
    assert best_k([0.05] * 8, c(0.1)) == 0        # nearly always wrong: no drafts at all
    assert best_k([0.05] * 8, c(0.1), min_k=1) == 1
    assert best_k([0.3] * 8, c(0.1)) == 1         # right now and then: one draft pays
    assert best_k([0.8] * 8, c(0.3)) < best_k([0.8] * 8, c(0.05))     # costlier drafts: shorter
    ks = [best_k([a / 10] * 8, c(0.2)) for a in range(10)]
    assert ks == sorted(ks)                       # never shorter for a better acceptance
    # bursty: the first draft is a coin flip, but once it is right the rest follow
    q = [0.5, 0.98, 0.98, 0.98]
    assert best_k(q, linear_costs(4, 0.25)) == 4 and best_k([0.5] * 4, linear_costs(4, 0.25)) == 1
    # measured, not linear: the second verified row is cheap, the third and later ones are not
    # (a quantized target's integer kernels on an AVX2 CPU)
    assert best_k([0.9] * 4, [1.0, 1.1, 1.2, 2.6, 3.0]) == 2


def test_round_costs_from_measured_steps():
    from tokenmill.spec.costs import round_costs
    costs = round_costs({1: 0.040, 2: 0.044, 3: 0.060}, draft_seconds=0.010, max_k=2)
    assert costs == pytest.approx([1.0, (0.044 + 0.010) / 0.040, (0.060 + 0.020) / 0.040])


def test_step_times_interpolate_and_batch_costs_grow_with_the_batch():
    from tokenmill.spec.adaptive import best_k
    from tokenmill.spec.costs import probe_rows, round_costs, seconds_at
    assert probe_rows(4, 16) == [1, 2, 3, 4, 5, 10, 20, 40, 80] and probe_rows(3, 1) == [1, 2, 3, 4]
    # memory-bound up to 4 rows, then linear in rows (compute-bound)
    t = {1: 0.040, 2: 0.041, 4: 0.044, 8: 0.080, 16: 0.160}
    assert seconds_at(t, 3) == pytest.approx(0.0425) and seconds_at(t, 12) == pytest.approx(0.120)
    assert seconds_at(t, 32) == pytest.approx(0.320)             # beyond the last two: their line
    draft = {1: 0.004, 2: 0.004, 8: 0.006}
    one = round_costs(t, draft, 3)
    assert one == pytest.approx([1.0, (0.041 + 0.004) / 0.040, (seconds_at(t, 3) + 0.008) / 0.040,
                                 (0.044 + 0.012) / 0.040])
    wide = round_costs(t, draft, 3, batch=8)                     # 8 sequences: 16-32 verified rows
    assert wide == pytest.approx([1.0, (0.160 + 0.006) / 0.080, (0.240 + 0.012) / 0.080, (0.320 + 0.018) / 0.080])
    assert best_k([0.8] * 3, one) == 3 and best_k([0.8] * 3, wide) == 0


def test_noisy_probes_are_made_monotone_in_rows():
    from tokenmill.spec.costs import monotone_in_rows
    clean = {1: 0.040, 2: 0.041, 4: 0.044, 8: 0.080, 16: 0.160}
    assert monotone_in_rows(clean) == clean                     # already non-decreasing: untouched
    # 14 rows timed slower than 28 (a busy host): both take their mean, the rest stays
    noisy = monotone_in_rows({7: 0.150, 14: 0.300, 28: 0.200, 56: 0.400})
    assert noisy == pytest.approx({7: 0.150, 14: 0.250, 28: 0.250, 56: 0.400})
    # a violation that spreads: the pooled mean is still above the next point, which joins too
    assert monotone_in_rows({1: 0.5, 2: 0.1, 3: 0.2}) == pytest.approx({1: 0.8 / 3, 2: 0.8 / 3, 3: 0.8 / 3})
    values = list(monotone_in_rows({r: (r * 37 % 11) / 10 for r in range(1, 30)}).values())
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))


def test_tracker_drafts_by_the_step_shape_and_stops_probing_where_drafts_cannot_pay():
    from tokenmill.spec.adaptive import AcceptanceTracker
    from tokenmill.spec.costs import MeasuredCosts
    # memory-bound up to 4 rows, compute-bound (linear) past 8; the draft is cheap
    target = {1: 0.040, 2: 0.041, 4: 0.044, 8: 0.080, 16: 0.160}
    measured = MeasuredCosts(target, {1: 0.002, 8: 0.004}, max_k=3, widest=4)
    t = AcceptanceTracker(max_k=3, costs=measured.at(1), measured=measured, probe_every=2)
    assert t.costs_at(1) == measured.at(1) and t.costs_at(9) == measured.at(9)
    assert t.choose(1, batch=1) == 3 and t.choose(1, batch=4) == 0
    assert t.pays_at(1) and not t.pays_at(4) and t.max_paying_batch() in (1, 2, 3)
    # one sequence decoding while a 12-row prefill chunk fills the step: its verified rows cost compute
    assert t.costs_at(1, other_rows=12) == pytest.approx([1.0, (0.140 + 0.002) / 0.130,
                                                          (0.150 + 0.004) / 0.130, (0.160 + 0.006) / 0.130])
    assert t.choose(1, batch=1, other_rows=12) == 0 and not t.pays_at(1, other_rows=12)
    for _ in range(10):
        t.record(5, 3, 0)          # request 5's drafts are always rejected
    assert [t.choose(5, batch=1) for _ in range(4)] == [0, 1, 0, 1]     # alone: it probes now and then
    assert [t.choose(5, batch=4) for _ in range(4)] == [0, 0, 0, 0]     # in a wide batch: never
    assert [t.choose(5, batch=1, other_rows=12) for _ in range(4)] == [0, 0, 0, 0]   # nor beside prefill


def test_tracker_learns_each_requests_acceptance():
    from tokenmill.spec.adaptive import AcceptanceTracker
    t = AcceptanceTracker(max_k=6, costs=linear_costs(6, 0.2))
    assert t.choose(1) >= 3                       # optimistic prior: long drafts get tried
    for _ in range(10):
        t.record(1, 6, 6)        # request 1: every draft accepted
        t.record(2, 6, 0)        # request 2: the first draft always rejected
    assert t.choose(1) == 6 and t.choose(2) == 0     # request 2: drafting does not pay
    q1, q2 = t.conditional_acceptance(1), t.conditional_acceptance(2)
    assert q1[0] > 0.8 and q2[0] < 0.3
    assert q2[1] == t.pooled()[1] < q1[1]         # request 2 never tested position 2: it borrows the pool
    t.forget(2)
    assert t.conditional_acceptance(2) == t.pooled()


def test_tracker_probes_a_request_that_stopped_drafting():
    from tokenmill.spec.adaptive import AcceptanceTracker
    t = AcceptanceTracker(max_k=4, costs=[1.0, 1.6, 2.2, 2.8, 3.4], probe_every=3)   # drafts rarely pay
    for _ in range(10):
        t.record(7, 4, 0)
    assert [t.choose(7) for _ in range(6)] == [0, 0, 1, 0, 0, 1]   # every third round: one draft
