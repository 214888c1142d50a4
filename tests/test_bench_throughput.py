"""`tokenmill bench throughput` end to end on a tiny random model, plus the report maths."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.bench import sharegpt
from tokenmill.bench.args import add_bench_args
from tokenmill.bench.report import Sample, Workload, format_table, summarize
from tokenmill.bench.sharegpt import Conversation
from tests.tiny_models import save_tiny_model_dir

WORDS = "hello world the quick brown fox jumps over lazy dog".split()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(argv)


def test_defaults_follow_the_spec() -> None:
    args = _parse(["throughput"])
    assert (args.model, args.num_prompts, args.hf_batch_size, args.dtype, args.repeats, args.max_num_seqs) == \
        ("smollm2-135m-instruct", 200, 32, "bfloat16", 3, 256)
    assert not args.skip_hf and not args.enable_prefix_caching
    assert args.output_json == "benchmarks/results/throughput.json"


def test_summary_uses_medians_and_paired_ratios() -> None:
    w = Workload(num_requests=10, prompt_tokens=100, output_tokens=200, decode_tokens=8, prefill_tokens=64)
    hf = [Sample(10.0, 1.0, 1.0), Sample(20.0, 2.0, 1.0), Sample(40.0, 1.0, 2.0)]
    tm = [Sample(2.0, 0.5, 0.5), Sample(5.0, 0.5, 0.5), Sample(4.0, 0.5, 0.5)]
    s = summarize({"hf": hf, "tokenmill": tm}, w)
    assert s["median"]["hf"]["output_tok_s"] == pytest.approx(10.0)      # 200 / 20
    assert s["median"]["tokenmill"]["output_tok_s"] == pytest.approx(50.0)  # 200 / 4
    assert s["ratio"]["output_tok_s"] == pytest.approx(5.0)               # median of 5, 4, 10
    assert s["ratio"]["prefill_tok_s"] == pytest.approx(2.0)
    table = format_table(s, w)
    assert "5.00x" in table and "(64-token prompt)" in table
    only_tm = summarize({"tokenmill": tm}, w)
    assert "ratio" not in only_tm and " - " in format_table(only_tm, w)


@pytest.fixture
def tiny_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    convs = [Conversation(f"c{i}", [("human", " ".join(WORDS[: 3 + i % 7]) * 2),
                                    ("gpt", " ".join(WORDS * (1 + i % 3)))]) for i in range(30)]
    monkeypatch.setattr(sharegpt, "load_sharegpt", lambda *a, **k: convs)
    return Path(save_tiny_model_dir(tmp_path / "model"))


def test_end_to_end_tiny_model(tiny_setup: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.bench.throughput import run_throughput_bench

    out = tmp_path / "res" / "throughput.json"
    args = _parse(["throughput", "--model", str(tiny_setup), "--num-prompts", "6", "--hf-batch-size", "4",
                   "--dtype", "float32", "--repeats", "2", "--max-num-seqs", "4", "--kv-cache-memory", str(1 << 22),
                   "--max-output-tokens", "12", "--decode-tokens", "10", "--prefill-tokens", "48",
                   "--output-json", str(out)])
    doc = run_throughput_bench(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["repeats_done"] == 2 and doc["workload"]["num_requests"] == 6 and doc["workload"]["prefill_tokens"] == 48
    assert len(doc["runs"]["hf"]) == len(doc["runs"]["tokenmill"]) == 2
    assert set(doc["ratio"]) == set(doc["median"]["hf"])
    # fp32 greedy: both engines must produce the same batch-1 continuation
    assert doc["batch1_greedy_common_prefix"] == 10
    assert doc["hf_generated_tokens_incl_padding"] >= doc["workload"]["output_tokens"]
    assert "offline output tok/s" in capsys.readouterr().out


def test_skip_hf(tiny_setup: Path, tmp_path: Path) -> None:
    from tokenmill.bench.throughput import run_throughput_bench

    args = _parse(["throughput", "--model", str(tiny_setup), "--num-prompts", "3", "--dtype", "float32",
                   "--repeats", "1", "--kv-cache-memory", str(1 << 22), "--max-output-tokens", "5",
                   "--decode-tokens", "4", "--prefill-tokens", "16", "--output-json", "", "--skip-hf"])
    doc = run_throughput_bench(args)
    assert set(doc["median"]) == {"tokenmill"} and "ratio" not in doc
    assert doc["batch1_greedy_common_prefix"] is None


def test_hf_left_padded_batch_matches_tokenmill(tiny_setup: Path) -> None:
    """The HF baseline's static batches (left padding, no EOS stop) generate the same greedy
    tokens as tokenmill, so both sides do the same useful work."""
    import torch

    from tokenmill.bench.hf_runner import HFRunner
    from tokenmill.bench.tm_runner import TokenmillRunner

    hf = HFRunner(tiny_setup, torch.float32)
    tm = TokenmillRunner(str(tiny_setup), "float32", 4, 1 << 22)
    prompts = [hf.tokenizer(t)["input_ids"] for t in ("fox", "lazy dog", "the quick brown fox jumps over")]
    assert len(prompts[0]) < len(prompts[1]) < len(prompts[2])
    hf_out, _ = hf._generate(prompts, 8)
    tm_out, _ = tm._generate(prompts, [8] * 3)
    assert hf_out.tolist() == tm_out
    assert len(set(tm_out[0])) > 3  # a non-degenerate continuation


def test_engines_table_ratios_are_same_repeat_pairs_against_the_anchor() -> None:
    from tokenmill.bench.report import format_engines_table
    w = Workload(num_requests=10, prompt_tokens=1000, output_tokens=500, decode_tokens=100, prefill_tokens=512)
    # repeat 1: both fast; repeat 2: both slow -> paired ratio exactly 2 although the medians mix
    samples = {"llama.cpp-q4_1": [Sample(10.0, 1.0, 0.5), Sample(20.0, 2.0, 1.0)],
               "tokenmill-rtn4": [Sample(5.0, 0.5, 0.25), Sample(10.0, 1.0, 0.5)]}
    table = format_engines_table(summarize(samples, w), w, "llama.cpp-q4_1")
    row = next(line for line in table.splitlines() if line.startswith("tokenmill-rtn4"))
    assert row.count("(2.00x)") == 3
    assert "(1.00x)" in next(line for line in table.splitlines() if line.startswith("llama.cpp-q4_1"))


def test_llama_cpp_variant_spec_is_validated(tmp_path: Path) -> None:
    from tokenmill.bench.throughput import _llama_cpp_variants
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert _llama_cpp_variants(f"q4_1={gguf}") == [("q4_1", gguf)]
    assert _llama_cpp_variants(None) == []
    for bad in (str(gguf), f"q4_1={tmp_path / 'missing.gguf'}", f"={gguf}"):
        with pytest.raises(ValueError, match="label=GGUF_FILE"):
            _llama_cpp_variants(bad)
