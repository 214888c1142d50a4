"""The step token budget: small while some sequence streams output (it bounds the inter-token
stall), the larger idle budget while nobody does."""
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def _run(sched: Scheduler) -> dict[str, int]:
    """One step as the engine does it: computed tokens advance, a finished prefill samples a token."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)
    return {seq.request_id: n for seq, n in out.scheduled}


def _seq(name: str, n: int) -> Sequence:
    return Sequence(name, list(range(3, 3 + n)), SamplingParams(max_tokens=50, ignore_eos=True))


def test_prefill_takes_the_idle_budget_until_a_sequence_streams():
    sched = Scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=64, idle_budget=256)
    sched.add(_seq("a", 300))
    assert _run(sched) == {"a": 256}          # nothing streams: one big chunk
    assert _run(sched) == {"a": 44}           # the rest; "a" samples its first token
    sched.add(_seq("b", 300))
    # "a" streams now: the step keeps to the small budget, b's chunks share it with a's decode token
    assert _run(sched) == {"a": 1, "b": 63}
    assert _run(sched) == {"a": 1, "b": 63}


def test_without_an_idle_budget_every_step_keeps_the_step_budget():
    sched = Scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(_seq("a", 100))
    assert _run(sched) == {"a": 64}
    assert _run(sched) == {"a": 36}


def test_a_preempted_sequence_still_counts_as_streaming():
    """Its user has seen tokens, so its recompute must not stall others behind a big chunk."""
    sched = Scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=64, idle_budget=256)
    a = _seq("a", 40)
    sched.add(a)
    _run(sched)
    sched._preempt(a)
    sched.add(_seq("b", 300))
    steps = _run(sched)
    assert set(steps) == {"a", "b"} and sum(steps.values()) == 64
