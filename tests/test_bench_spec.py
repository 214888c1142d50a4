"""`tokenmill bench spec` end to end on tiny models (the real run uses the Qwen2.5-Coder pair)."""
import json

import pytest

from tests.tiny_models import save_tiny_model_dir
from tokenmill.bench.spec_bench import parse_spec_variants
from tokenmill.cli import build_parser


def test_parse_spec_variants():
    got = parse_spec_variants("none,draft:4,ngram:2,draft:auto:6")
    assert [(v.label, v.method, v.k, v.adaptive) for v in got] == [
        ("none", None, 0, False), ("draft-k4", "draft_model", 4, False), ("ngram-k2", "ngram", 2, False),
        ("draft-auto6", "draft_model", 6, True)]
    got = parse_spec_variants("llama.cpp,llama.cpp:4")
    assert [(v.label, v.method, v.k) for v in got] == [("llama.cpp", "llama.cpp", 0), ("llama.cpp-draft4", "llama.cpp", 4)]
    got = parse_spec_variants("draft:4/b2,ngram:auto:3/b8")
    assert [(v.label, v.k, v.adaptive, v.disable_by_batch_size) for v in got] == [
        ("draft-k4-b2", 4, False, 2), ("ngram-auto3-b8", 3, True, 8)]
    for bad in ("draft", "draft:0", "eagle:3", "ngram:x", "draft:auto", "draft:fast:3", "llama.cpp:0",
                "none/b2", "draft:4/b0", "draft:4/bx", "llama.cpp:4/b2"):
        with pytest.raises(ValueError, match="bad variant"):
            parse_spec_variants(bad)


def test_bench_spec_runs_every_variant_and_writes_json(tmp_path, capsys):
    model = save_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "spec.json"
    args = build_parser().parse_args(["bench", "spec", "--model", model, "--draft", model, "--variants",
                                      "none,draft:2,ngram:3", "--num-prompts", "3", "--max-tokens", "12",
                                      "--repeats", "2", "--dtype", "float32", "--kv-cache-memory", str(1 << 22),
                                      "--max-model-len", "256", "--output-json", str(out)])
    args.func(args)
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"none", "draft-k2", "ngram-k3"}
    assert rows["none"]["ratio_vs_none"] == pytest.approx(1.0)
    # the draft is the target itself: every draft is accepted, up to 3 tokens per round (fewer
    # only where max_tokens leaves room for fewer drafts)
    assert rows["draft-k2"]["acceptance_rate"] == pytest.approx(1.0)
    assert 2.5 < rows["draft-k2"]["mean_acceptance_length"] <= 3.0
    assert all(len(r["per_repeat"]["tok_s"]) == 2 and r["tok_s"] > 0 for r in rows.values())
    assert "vs none" in capsys.readouterr().out


def test_bench_spec_concurrency_curve_reports_where_speculation_is_off(tmp_path):
    model = save_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "spec.json"
    args = build_parser().parse_args(["bench", "spec", "--model", model, "--draft", model, "--variants",
                                      "none,draft:2/b2", "--num-prompts", "2", "--max-tokens", "10",
                                      "--concurrency", "1,4", "--repeats", "1", "--dtype", "float32",
                                      "--kv-cache-memory", str(1 << 22), "--max-model-len", "256",
                                      "--output-json", str(out)])
    args.func(args)
    rows = {(r["concurrency"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(1, "none"), (1, "draft-k2-b2"), (4, "none"), (4, "draft-k2-b2")}
    assert rows[(1, "draft-k2-b2")]["spec_off_share"] == 0.0      # one stream: always drafting
    assert rows[(4, "draft-k2-b2")]["spec_off_share"] > 0.5       # 4 streams > 2: off while all run
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--concurrency", "1,0"])
