"""`bench scheduler`: the table math, the dialogue sampler, and each workload at toy scale
against a live tokenmill server (shared with the server tests)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.server_fixtures import SERVED_NAME, get_server, load_tokenizer
from tests.test_bench_serve_datasets import WordTokenizer, _conv
from tokenmill.bench import scenarios as sc
from tokenmill.bench.datasets import DatasetConfig, multiturn_dialogues
from tokenmill.bench.scheduler_bench import EXPERIMENTS, scrape_counters, table
from tokenmill.bench.sharegpt import Conversation


def _runs(values: dict[str, list[float]]) -> dict[str, list[dict[str, Any]]]:
    return {lb: [{"numbers": {"TTFT P50 (ms)": v}} for v in vs] for lb, vs in values.items()}


def test_table_reports_medians_and_median_of_paired_ratios() -> None:
    runs = _runs({"caching on": [10.0, 30.0, 20.0], "caching off": [100.0, 100.0, 400.0]})
    text = table(EXPERIMENTS["prefix"], runs)
    row = next(line for line in text.splitlines() if line.startswith("TTFT P50"))
    # medians 20 and 100; paired ratios 0.1, 0.3, 0.05 -> median 0.1 (not 20/100)
    assert row.split()[-3:] == ["20.00", "100.00", "0.100x"]


def test_multiturn_dialogues_keep_user_turns_in_order() -> None:
    convs = [_conv(i, 1) for i in range(3)] + [_conv(i, 3) for i in range(3, 6)]
    cfg = DatasetConfig(name="multiturn", num_prompts=0, seed=1, max_turns=2)
    dialogues = multiturn_dialogues(WordTokenizer(), cfg, 3, conversations=convs)
    assert len(dialogues) == 3
    for d in dialogues:   # single-turn conversations are skipped; max_turns caps the rest
        assert len(d.user_turns) == len(d.output_lens) == 2
        i = d.user_turns[0].split()[0]
        assert d.user_turns == [f"{i} turn0 " + "w5 " * 5, f"{i} turn1 " + "w5 " * 5]
    with pytest.raises(ValueError):
        multiturn_dialogues(WordTokenizer(), cfg, 4, conversations=convs)


def _english_convs(n: int, turns: int) -> list[Conversation]:
    out = []
    for i in range(n):
        t: list[tuple[str, str]] = []
        for k in range(turns):
            t += [("human", f"Conversation {i}, question {k}: name a few colors and fruits."),
                  ("gpt", "Red, green and blue; apples, pears and plums are common.")]
        out.append(Conversation(str(i), t))
    return out


def _run(workload: sc.Workload) -> tuple[sc.Groups, dict[str, float], dict[str, float]]:
    srv = get_server("main")
    before = scrape_counters(srv.url)
    groups, _ = asyncio.run(sc.run_workload(srv.url, SERVED_NAME, load_tokenizer(), workload, seed=3, timeout_s=300))
    return groups, before, scrape_counters(srv.url)


@pytest.mark.slow
def test_prefix_workload_hits_the_cache() -> None:
    w = sc.PrefixWorkload(num_questions=3, prefix_len=96, question_len=8, output_len=2)
    groups, before, after = _run(lambda c, seed: sc.prefix_workload(c, seed, w))
    qs = groups["question"]
    assert len(qs) == 3 and all(r.success and r.output_tokens == 2 for r in qs)
    hits = after["tokenmill:prefix_cache_hits"] - before["tokenmill:prefix_cache_hits"]
    assert hits >= 2 * 96 // 16 * 16 - 16       # questions 2 and 3 reuse the shared prompt's full blocks


@pytest.mark.slow
def test_multiturn_workload_sends_generated_answers_back() -> None:
    w = sc.MultiturnWorkload(num_conversations=2, max_turns=2, max_output_tokens=6, think_time_s=0.0,
                             start_gap_s=0.0, conversations=_english_convs(2, 2))
    groups, _, _ = _run(lambda c, seed: sc.multiturn_workload(c, seed, w))
    first, later = groups["turn 1"], groups["turns >= 2"]
    assert len(first) == len(later) == 2 and all(r.success and r.text for r in first + later)
    # turn 2's prompt holds turn 1's prompt, the generated answer and the new question
    assert min(r.prompt_len for r in later) > max(r.prompt_len for r in first) + 6


@pytest.mark.slow
def test_interference_workload_sends_long_prompts_while_streams_decode() -> None:
    w = sc.InterferenceWorkload(num_streams=2, stream_prompt_len=16, stream_output_len=24, long_prompt_len=300,
                                long_output_len=2, first_long_at_s=0.05, long_every_s=0.5)
    groups, _, _ = _run(lambda c, seed: sc.interference_workload(c, seed, w))
    streams, longs = groups["stream"], groups["long prompt"]
    assert len(streams) == 2 and all(r.success and r.output_tokens == 24 for r in streams)
    assert longs and all(r.success and r.prompt_len >= 250 for r in longs)
    assert min(r.start for r in longs) < max(r.latency for r in streams)


@pytest.mark.slow
def test_priority_workload_splits_and_is_accepted() -> None:
    w = sc.PriorityWorkload(num_requests=10, request_rate=50.0, max_output_tokens=4,
                            conversations=_english_convs(12, 1))
    groups, _, _ = _run(lambda c, seed: sc.priority_workload(c, seed, w))
    assert len(groups["high"]) == 2 and len(groups["low"]) == 8
    assert all(r.success for rs in groups.values() for r in rs)
