"""Continuous batching: which sequences run this step, and how many tokens each.

Every step fills a token budget: running sequences first (one decode token each, or the next
chunk of an unfinished prefill), then waiting sequences in policy order. A sequence is
scheduled for `num_tokens - num_computed_tokens` tokens plus its speculative drafts, capped by
the budget when chunked prefill is on (drafts are cut first). The budget is `idle_budget` (larger) in a step where no sequence has produced
output yet: nobody streams, so no inter-token latency suffers from big prefill chunks,
which run faster per token. When the KV cache runs out, the lowest-priority, latest-arrived running
sequence is preempted: its blocks are freed and it is requeued to be recomputed (the prefix
cache usually makes that cheap). Nothing is dropped: a preempted sequence keeps its tokens.
With LoRA, the running set holds at most `max_loras` distinct adapters (one step's slots): a
waiting sequence whose adapter would exceed that is passed over, later ones may go first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.block_manager import BlockManager
from tokenmill.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (seq, num new tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", idle_budget: int | None = None,
                 max_loras: int | None = None) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r} (fcfs | priority)")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.idle_budget = max(max_num_batched_tokens, idle_budget or 0)
        self.chunked = enable_chunked_prefill
        self.policy = policy
        self.max_loras = max_loras
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def _key(self, seq: Sequence) -> tuple:
        """Sort key: smaller runs sooner. FCFS ignores priority."""
        if self.policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids = []
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _make_room_for_priority(self) -> None:
        """Priority policy: while the most important waiting sequence cannot be admitted, and a
        less important one runs, preempt the least important running sequence."""
        while self.waiting and self.running:
            head = self.waiting[0]
            worst = max(self.running, key=self._key)
            if self._key(worst) <= self._key(head):
                return
            cached = self.bm.find_cached_prefix(head)
            chunk = head.num_tokens - len(cached) * self.bm.block_size
            if not self.chunked and chunk > self.max_num_batched_tokens:
                return                                   # could never be admitted this way
            chunk = min(chunk, self.max_num_batched_tokens)
            if len(self.running) < self.max_num_seqs and self.bm.can_admit(head, cached, chunk):
                return
            self._preempt(worst)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.policy == "priority":
            self._make_room_for_priority()
        self.running.sort(key=self._key)
        # a preempted sequence waiting for its recompute has streamed too: its user waits on this step
        streaming = any(seq.num_output_tokens for seq in self.running + self.waiting)
        budget = self.max_num_batched_tokens if streaming else self.idle_budget
        scheduled: set[int] = set()
        memory_short = False
        # 1. running sequences, most important first; preempt from the back when memory is short
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            owed = seq.num_tokens - seq.num_computed_tokens
            n = owed + len(seq.spec_token_ids)       # speculative drafts are verified with the last token
            if owed > budget and not self.chunked:
                continue
            n = min(n, budget)
            del seq.spec_token_ids[max(0, n - owed):]   # drafts past the budget wait for another step
            while not self.bm.grow(seq, n):
                memory_short = True
                victim = max((s for s in self.running if s.seq_id not in scheduled), key=self._key)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                out.scheduled.append((seq, n))
                scheduled.add(seq.seq_id)
                budget -= n
        # 2. waiting sequences, while memory, budget and seat limits allow (not when running
        #    sequences just ran out of memory: admitting more would only thrash)
        adapters = {id(s.lora) for s in self.running if s.lora is not None}
        i = 0
        while i < len(self.waiting) and not memory_short and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if (self.max_loras is not None and seq.lora is not None and id(seq.lora) not in adapters
                    and len(adapters) >= self.max_loras):
                i += 1                       # its adapter would not fit this batch's slots
                continue
            cached = self.bm.find_cached_prefix(seq)
            n = seq.num_tokens - len(cached) * self.bm.block_size
            if n > budget and not self.chunked:
                break
            n = min(n, budget)
            if not self.bm.admit(seq, cached, n):
                break
            self.waiting.pop(i)
            if seq.lora is not None:
                adapters.add(id(seq.lora))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out
