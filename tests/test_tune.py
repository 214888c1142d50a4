"""`tokenmill tune`: the search logic on a scripted goodput landscape, and one real point
against a live tiny-model server."""
from __future__ import annotations

import argparse

import pytest

from tokenmill.bench import tune
from tokenmill.bench.tune import Point, Tuner, engine_defaults, format_table, invalid_reason, parse_axes
from tokenmill.cli import build_parser
from tests.tiny_models import save_tiny_model_dir


def tune_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["tune", "--no-progress", *extra])


def test_parse_axes():
    assert parse_axes(["max-num-seqs=4,8", "--max-num-batched-tokens=256"]) == [
        ("max-num-seqs", [4, 8]), ("max-num-batched-tokens", [256])]
    for bad in ("max-num-seqs", "max-num-seqs=", "max-num-seqs=a", "=4", "max-num-seqs=0"):
        with pytest.raises(ValueError, match="bad --axis"):
            parse_axes([bad])


def test_start_is_the_engine_defaults_and_refused_combinations_are_skipped():
    from tokenmill.config import SCHEDULER_DEFAULTS
    assert tuple(engine_defaults("cpu").values()) == SCHEDULER_DEFAULTS["cpu"]
    assert invalid_reason({"max-num-batched-tokens": 1024, "max-idle-batched-tokens": 512})
    assert invalid_reason({"max-num-batched-tokens": 512, "max-idle-batched-tokens": 512}) is None


class ScriptedTuner(Tuner):
    """Goodput = a function of the setting and the rate; the SLA holds up to a setting's capacity."""

    def __init__(self, args, landscape) -> None:
        super().__init__(args, requests=[])
        self.landscape = landscape
        self.calls: list[tuple[int, int, float]] = []

    def measure_point(self, setting, rate):
        self.calls.append((setting["max-num-seqs"], setting["max-num-batched-tokens"], rate))
        capacity = self.landscape(setting)
        meets = rate <= capacity
        goodput = rate * capacity / (capacity + 1) if meets else 0.1   # grows with the rate and the capacity
        return Point(dict(setting), rate, goodput, 0.0, 100.0,
                     20.0 if meets else 80.0, 10, 0, meets)


def test_coordinate_search_finds_the_best_setting_and_stops_each_ladder_at_the_first_miss():
    args = tune_args("--request-rate", "1,2,4,8")
    best_seqs, best_budget = 8, 512
    def landscape(s):   # capacity peaks at seqs=8, budget=512
        return 4.0 - abs(s["max-num-seqs"] - best_seqs) / 4 - abs(s["max-num-batched-tokens"] - best_budget) / 512
    tuner = ScriptedTuner(args, landscape)
    start = {"max-num-seqs": 12, "max-num-batched-tokens": 256}
    best = tuner.search(start, [("max-num-seqs", [4, 8, 12, 16]), ("max-num-batched-tokens", [128, 256, 512, 1024])])
    assert best == {"max-num-seqs": 8, "max-num-batched-tokens": 512}
    # every setting measured once (the start is not re-run when it reappears on an axis)
    settings = [(s, b) for s, b, _ in tuner.calls]
    assert len(set(settings)) == 4 + 4 - 1
    # a ladder stops at its first miss: capacity 4 at the best setting -> rates 1, 2, 4, 8 (8 misses)
    assert [r for s, b, r in tuner.calls if (s, b) == (8, 512)] == [1, 2, 4, 8]
    assert [r for s, b, r in tuner.calls if (s, b) == (16, 256)] == [1, 2]   # capacity 1.5: misses at 2
    table = format_table(tuner.points(), best, tuner.sla)
    assert sum(line.startswith("*") for line in table.splitlines()) == 4    # the chosen setting's rows


def test_budget_stops_the_search(monkeypatch):
    args = tune_args("--budget-minutes", "1", "--request-rate", "1,2,4,8")
    tuner = ScriptedTuner(args, lambda s: 100.0)
    now = [0.0]
    monkeypatch.setattr(tune.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(tune, "MIN_POINT_SECONDS", 15.0)
    tuner.deadline = 60.0
    scripted = tuner.measure_point
    def point_taking_40_s(setting, rate):
        now[0] += 40.0
        return scripted(setting, rate)
    tuner.measure_point = point_taking_40_s
    tuner.search({"max-num-seqs": 12, "max-num-batched-tokens": 256}, [("max-num-seqs", [4, 8])])
    assert [r for _, _, r in tuner.calls] == [1, 2]          # 60 s left, then 20 s, then none
    assert [reason for _, reason in tuner.skipped] == ["budget spent before rate 4", "budget spent", "budget spent"]


@pytest.mark.slow
def test_one_real_point_against_a_live_server(tmp_path, capsys):
    model = save_tiny_model_dir(tmp_path / "model")
    args = tune_args(str(model), "--tokenizer", str(model), "--dtype", "float32", "--max-model-len", "128",
                     "--dataset", "random", "--random-input-len", "16", "--random-output-len", "8",
                     "--num-prompts", "4", "--request-rate", "inf", "--ttft-p95", "60000", "--tpot-p95", "10000",
                     "--axis", "max-num-seqs=12",    # = the start: one setting, one server
                     "--serve-args", "--kv-cache-memory 8M", "--save-result", str(tmp_path / "tune.json"))
    doc = tune.run_tune(args)
    out = capsys.readouterr().out
    assert doc["best"] == engine_defaults("cpu")
    [point] = doc["points"]
    assert point["completed"] == 4 and point["failed"] == 0 and point["meets_sla"] and point["goodput"] > 0
    assert "best: --max-num-seqs 12" in out and "tokenmill bench compare --anchors tokenmill,tokenmill-default" in out
    assert (tmp_path / "tune.json").exists()
