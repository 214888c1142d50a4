"""Sampler: vLLM semantics, per-request seeds, support sets of the truncation filters."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tokenmill.engine.sampler import Sampler, apply_penalties
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

V = 7
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
LOGITS = torch.tensor(PROBS).log() + 3.0   # shift: softmax is unchanged


def seq(prompt=(1, 2, 3), output=(), **kw) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**kw))
    for t in output:
        s.append_token(t)
    return s


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000).to(torch.bfloat16)
    seqs = [seq(temperature=0.0) for _ in range(16)]
    out = Sampler(1000)(logits, seqs)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_padded_vocab_columns_never_sampled():
    logits = torch.zeros(2, 10)
    logits[:, 8:] = 100.0                     # padding columns of a padded lm_head
    out = Sampler(8)(logits, [seq(temperature=0.0), seq(temperature=1.0)])
    assert all(t < 8 for t in out.token_ids)


def _run(sampler: Sampler, seqs: list[Sequence], logits_for, steps: int) -> None:
    for _ in range(steps):
        logits = torch.stack([logits_for(s) for s in seqs])
        for s, t in zip(seqs, sampler(logits, seqs).token_ids):
            s.append_token(t)


def test_seed_reproducible_independent_of_batch():
    flat = torch.zeros(50)
    fn = lambda s: flat  # noqa: E731  uniform: every draw is pure noise
    alone = seq(seed=1234)
    _run(Sampler(50, seed=0), [alone], fn, 20)

    batch = [seq(), seq(seed=7), seq(seed=1234), seq(temperature=0.0), seq(top_k=5)]
    _run(Sampler(50, seed=99), batch, fn, 20)
    again = [seq(top_p=0.9), seq(seed=1234), seq()]
    _run(Sampler(50, seed=5), again, fn, 20)

    assert alone.output_token_ids == batch[2].output_token_ids == again[1].output_token_ids
    assert batch[1].output_token_ids != alone.output_token_ids       # different seed differs
    assert len(set(alone.output_token_ids)) > 5                      # and it really samples


def test_unseeded_depends_on_global_seed():
    fn = lambda s: torch.zeros(50)  # noqa: E731
    a, b, c = seq(), seq(), seq()
    _run(Sampler(50, seed=1), [a], fn, 20)
    _run(Sampler(50, seed=1), [b], fn, 20)
    _run(Sampler(50, seed=2), [c], fn, 20)
    assert a.output_token_ids == b.output_token_ids != c.output_token_ids


def _empirical(n: int = 10000, **kw) -> dict[int, float]:
    """Sample n times (one batch of n identical rows) from LOGITS with a seeded global generator."""
    seqs = [seq(**kw)] * n   # unseeded: all rows share the global generator anyway
    ids = Sampler(V, seed=123)(LOGITS.expand(n, V).clone(), seqs).token_ids
    return {t: c / n for t, c in Counter(ids).items()}


def _expected(keep: list[int], power: float = 1.0) -> dict[int, float]:
    w = {i: PROBS[i] ** power for i in keep}
    z = sum(w.values())
    return {i: x / z for i, x in w.items()}


@pytest.mark.parametrize("kw, keep", [
    ({}, [0, 1, 2, 3, 4, 5, 6]),
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_k": 1}, [0]),
    ({"top_p": 0.5}, [0, 1]),              # mass before token 1 is 0.40 < 0.5, before token 2 is 0.65
    ({"top_p": 0.7}, [0, 1, 2]),
    ({"top_p": 0.1}, [0]),                 # always keep the top token
    ({"min_p": 0.3}, [0, 1, 2]),           # threshold 0.12
    ({"min_p": 0.2}, [0, 1, 2, 3]),        # threshold 0.08
    ({"top_k": 3, "top_p": 0.6}, [0, 1]),  # top-p on the top-k renormalised probs (.5,.3125,.1875)
    ({"top_k": 5, "min_p": 0.2}, [0, 1, 2, 3]),
])
def test_support_sets(kw, keep):
    emp = _empirical(**kw)
    assert set(emp) == set(keep)
    for t, p in _expected(keep).items():
        assert abs(emp[t] - p) < 0.02, (t, emp[t], p)


def test_temperature_sharpens():
    emp = _empirical(temperature=0.5)          # p^(1/T) = p^2, renormalised
    for t, p in _expected(list(range(V)), power=2.0).items():
        assert abs(emp.get(t, 0.0) - p) < 0.02


def test_mixed_batch_rows_keep_their_own_params():
    kinds = [({"top_k": 2}, {0, 1}), ({"min_p": 0.3}, {0, 1, 2}), ({"temperature": 0.0}, {0}),
             ({"top_p": 0.5, "seed": None}, {0, 1}), ({}, set(range(V)))]
    seqs, groups = [], []
    for r in range(3000):
        kw, allowed = kinds[r % len(kinds)]
        if "seed" in kw:
            kw = {**kw, "seed": r}   # each seeded row draws from its own generator
        seqs.append(seq(**kw))
        groups.append(allowed)
    ids = Sampler(V)(LOGITS.expand(len(seqs), V).clone(), seqs).token_ids
    for g in range(len(kinds)):
        seen = {t for t, a, r in zip(ids, groups, range(len(ids))) if r % len(kinds) == g}
        assert seen == kinds[g][1]


def test_apply_penalties_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0],
                           [2.0, -1.0, 0.5, -3.0, 1.0]])
    # row 0: output has token0 x2, token1 x1; prompt has token2 (and an out-of-range id)
    # row 1: neutral penalties, same tokens -> unchanged
    out = apply_penalties(logits.clone(), [[2, 99], [2]], [[0, 1, 0], [0, 1, 0]],
                          torch.tensor([2.0, 1.0]), torch.tensor([0.5, 0.0]), torch.tensor([0.25, 0.0]))
    expected = [2.0 / 2 - 2 * 0.25 - 0.5,       # seen, positive -> divide; frequency x2; presence
                -1.0 * 2 - 1 * 0.25 - 0.5,      # seen, negative -> multiply
                0.5 / 2,                        # prompt only: repetition, no presence/frequency
                -3.0,                           # unseen: unchanged
                1.0]
    assert out[0].tolist() == pytest.approx(expected)
    assert out[1].tolist() == logits[1].tolist()


def test_apply_penalties_matches_dense_reference():
    torch.manual_seed(0)
    R, Vb = 6, 50
    logits = torch.randn(R, Vb) * 3
    prompts = [torch.randint(0, Vb, (n,)).tolist() for n in (0, 5, 20, 1, 30, 7)]
    outs = [torch.randint(0, Vb, (n,)).tolist() for n in (3, 0, 40, 9, 2, 15)]
    rep, pres, freq = torch.rand(R) + 0.5, torch.rand(R) * 4 - 2, torch.rand(R) * 4 - 2
    counts = torch.zeros(R, Vb)
    seen = torch.zeros(R, Vb, dtype=torch.bool)
    for r in range(R):
        for t in outs[r]:
            counts[r, t] += 1
        seen[r, prompts[r]] = True
    seen |= counts > 0
    p = torch.where(seen, rep[:, None], torch.ones(()))
    ref = torch.where(logits > 0, logits / p, logits * p) - freq[:, None] * counts - pres[:, None] * (counts > 0)
    got = apply_penalties(logits.clone(), prompts, outs, rep, pres, freq)
    assert torch.allclose(got, ref, atol=1e-5)


def test_penalties_through_sampler():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 4)
    seqs = [seq(prompt=[1], output=[0], temperature=0.0),                       # no penalty
            seq(prompt=[3], output=[0], temperature=0.0, repetition_penalty=2.0),  # 2.5 < 4
            seq(prompt=[1], output=[0], temperature=0.0, repetition_penalty=2.0),  # 2.5 vs 2.0
            seq(output=[0, 0, 0], temperature=0.0, frequency_penalty=0.5, presence_penalty=0.1)]
    assert Sampler(4)(logits, seqs).token_ids == [0, 1, 0, 1]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[1.0, 9.0, 8.0, 7.0]] * 5)       # eos = 1, stop id = 2
    s = Sampler(4, eos_token_ids=[1])
    seqs = [seq(temperature=0.0, min_tokens=2),                          # blocks eos
            seq(temperature=0.0, min_tokens=2, stop_token_ids=[2]),      # blocks eos and 2
            seq(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[2]),  # eos allowed
            seq(temperature=0.0, min_tokens=2, output=[3, 3]),           # min reached
            seq(temperature=1.0, min_tokens=1, stop_token_ids=[2])]      # random row too
    ids = s(logits, seqs).token_ids
    assert ids[:4] == [2, 3, 1, 1]
    assert ids[4] not in (1, 2)


def test_logprobs_from_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    seqs = [seq(temperature=0.0, logprobs=3, repetition_penalty=10.0, output=[int(logits[0].argmax())]),
            seq(temperature=0.7, logprobs=0, seed=5),
            seq(temperature=0.0)]
    out = Sampler(30)(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 1):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp is not None and lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
    # row 0: the penalty moved the argmax away from the raw top token, so rank > 1
    assert out.logprobs[0].rank > 1
    top = ref[0].topk(3)
    assert list(out.logprobs[0].top) == top.indices.tolist()
    assert list(out.logprobs[0].top.values()) == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.logprobs[1].top == {}
    assert out.logprobs[2] is None
    assert math.isfinite(out.logprobs[1].logprob)


def test_top_p_nucleus_larger_than_first_candidate_batch():
    # 3000 tokens with slowly decaying logits: the top_p=0.5 nucleus holds ~600 tokens, more than
    # the first top-K guess, so the candidate set must grow until it covers the nucleus
    Vb = 3000
    logits = -torch.arange(Vb, dtype=torch.float32) * 1e-3
    probs = torch.softmax(logits.double(), -1)
    before = probs.cumsum(-1) - probs
    m = int((before < 0.5).sum())
    assert m > 500
    n = 1500
    ids = Sampler(Vb, seed=3)(logits.expand(n, Vb).clone(), [seq(top_p=0.5)] * n).token_ids
    assert max(ids) < m and max(ids) > m - 30
    # same rows mixed with top-k rows, which stay within their k
    seqs = [seq(top_p=0.5), seq(top_k=10)] * (n // 2)
    ids = Sampler(Vb, seed=4)(logits.expand(n, Vb).clone(), seqs).token_ids
    assert max(ids[0::2]) < m and max(ids[0::2]) > m - 30
    assert set(ids[1::2]) == set(range(10))


def test_inverse_cdf_never_picks_zero_weight():
    from tokenmill.engine.sampler import _inverse_cdf
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 5)
    u = torch.tensor([0.0, 0.49, 0.5, 0.999999, 1.0])   # 1.0: what u * total can round up to
    assert _inverse_cdf(w, u).tolist() == [1, 1, 3, 3, 3]


def test_nan_logits_still_yield_a_valid_token_id():
    sampler = Sampler(vocab_size=8, seed=0)
    logits = torch.full((2, 8), float("nan"))
    out = sampler(logits, [seq(temperature=1.0), seq(temperature=0.5, top_p=0.9)])
    assert all(0 <= t < 8 for t in out.token_ids)


@pytest.mark.parametrize("kw", [dict(temperature=float("inf")), dict(top_p=float("nan")),
                                dict(repetition_penalty=5e-324), dict(presence_penalty=float("nan"))])
def test_non_finite_or_degenerate_params_rejected(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
