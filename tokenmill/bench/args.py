"""`tokenmill bench <sub-command>` arguments."""
from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_JSON = "benchmarks/results/throughput.json"
SCHEDULER_EXPERIMENTS = ("prefix", "multiturn", "interference", "priority")   # scheduler_bench.EXPERIMENTS


def positive_int_list(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; an argparse type, so a bad list is a usage error."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}")
    return values


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("throughput", help="offline ShareGPT throughput: tokenmill vs HF transformers generate")
    p.add_argument("--model", default="smollm2-135m-instruct", help="known model name, .gguf file or HF dir")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--hf-batch-size", type=int, default=32, help="HF static batch size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=3, help="measurements per engine; medians are reported")
    p.add_argument("--max-num-seqs", type=int, default=256, help="tokenmill max concurrent sequences")
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="tokenmill KV cache bytes")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="let tokenmill reuse cached prompts across repeats (off: fair vs HF)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode length")
    p.add_argument("--prefill-tokens", type=int, default=512, help="batch-1 prefill prompt length")
    p.add_argument("--seed", type=int, default=0, help="ShareGPT sampling seed")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both engines")
    p.add_argument("--output-json", default=DEFAULT_JSON)
    p.add_argument("--skip-hf", action="store_true", help="measure tokenmill only")
    p.add_argument("--quantization", default="none",
                   help="comma list of tokenmill variants: none (the --dtype weights), int8, rtn4, nf4, ...")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantized variants quantize the lm_head too")
    p.add_argument("--llama-cpp", default=None, metavar="LABEL=GGUF,...",
                   help="llama-server anchors, e.g. q4_1=model.Q4_1.gguf,q8_0=model.Q8_0.gguf")
    p.add_argument("--llama-cpp-parallel", type=int, default=32, help="llama-server slots (-np)")
    p.add_argument("--llama-cpp-port", type=int, default=18180)
    _add_serve_parser(sub)
    _add_compare_parser(sub)
    _add_scheduler_parser(sub)
    _add_quality_parser(sub)
    from tokenmill.bench.quant_speed import add_quant_speed_parser
    add_quant_speed_parser(sub)


def add_workload_args(p: argparse.ArgumentParser, request_rate: str = "inf", num_prompts: int = 200,
                      with_sla: bool = True) -> None:
    """Dataset, arrival process and SLA: shared by `serve`, `compare` and `tune` so all run one
    workload (`tune` states its SLA as P95 targets of its own)."""
    from tokenmill.bench.datasets import DATASETS

    p.add_argument("--dataset", default="sharegpt", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--tokenizer", default="smollm2-135m-instruct",
                   help="known model name, .gguf or HF dir whose tokenizer counts prompt tokens")
    p.add_argument("--request-rate", default=request_rate,
                   help="requests/s; comma list for a sweep, e.g. 1,2,4,8,inf")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="max requests in flight")
    p.add_argument("--seed", type=int, default=0)
    if with_sla:
        p.add_argument("--goodput", nargs="*", default=["ttft:500", "tpot:40"],
                       help="per-request SLA in ms, KEY:MS with KEY in ttft|tpot|e2el")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--max-duration", type=float, default=1800.0, help="seconds; later requests are cancelled")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="sharegpt/multiturn prompt limit")
    p.add_argument("--max-output-tokens", type=int, default=256, help="sharegpt/multiturn output cap")
    p.add_argument("--random-input-len", type=int, default=128, help="random prompt / prefix-shared question tokens")
    p.add_argument("--random-output-len", type=int, default=64, help="random / prefix-shared output tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=512, help="prefix-shared system prompt tokens")
    p.add_argument("--max-turns", type=int, default=4, help="multiturn turns per conversation")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--save-result", default=None, help="write all metrics and raw timings to this JSON")
    if with_sla:
        p.add_argument("--plot", default=None, help="write TTFT/ITL CDFs (and the rate sweep) to this PNG")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="online load test of a running OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    add_workload_args(p)


def _add_compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="same workload against tokenmill, llama.cpp llama-server, HF generate")
    p.add_argument("--model", default="smollm2-135m-instruct", help="known model name or .gguf file")
    p.add_argument("--anchors", default="tokenmill,llama.cpp,hf",
                   help="comma list from tokenmill, tokenmill-default (the engine's scheduler defaults, with "
                        "--tokenmill-default-args), llama.cpp, hf (HF: offline static batches)")
    p.add_argument("--parallel", type=int, default=32, help="max-num-seqs / llama-server -np slots")
    p.add_argument("--ctx-per-seq", type=int, default=1024, help="context per sequence (max-model-len)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="tokenmill and HF compute dtype")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--hf-max-seconds", type=float, default=600.0,
                   help="HF stops after the static batch that crosses this many seconds")
    p.add_argument("--port", type=int, default=8123, help="loopback port for the servers, one at a time")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--merge-result", default=None,
                   help="earlier compare JSON (same workload) whose servers/HF figures are added to this table")
    p.add_argument("--llama-server", default="llama-cpp-server", help="llama.cpp server binary")
    p.add_argument("--tokenmill-args", default="",
                   help="extra `tokenmill serve` flags, e.g. --tokenmill-args='--quantization int8 --quantize-lm-head'")
    p.add_argument("--tokenmill-default-args", default="",
                   help="`tokenmill serve` flags of the tokenmill-default anchor (no --max-num-seqs: the engine's own)")
    add_workload_args(p)


def _add_scheduler_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scheduler", help="prefix caching / chunked prefill / priority: feature on vs off")
    p.add_argument("experiment", choices=[*SCHEDULER_EXPERIMENTS, "all"])
    p.add_argument("--model", default="smollm2-135m-instruct", help="known model name, .gguf file or HF dir")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; medians are reported")
    p.add_argument("--seed", type=int, default=0, help="repeat k uses seed + k")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output-dir", default="benchmarks/results", help="writes scheduler_<experiment>.json here")


def _add_quality_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="batch-1 decode with and without speculative decoding (draft model, n-gram)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="target: known name, .gguf or HF dir")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model for draft:K variants")
    p.add_argument("--variants", default="none,draft:2,draft:4,draft:6,draft:auto:6,ngram:4",
                   help="comma list of none | draft:K | ngram:K, or draft:auto:K / ngram:auto:K (adaptive k <= K)")
    p.add_argument("--num-prompts", type=int, default=20, help="prompts (at most 20)")
    p.add_argument("--prompt-set", choices=("code", "mixed"), default="code",
                   help="code tasks, or code and prose alternating (where adaptive k matters)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=positive_int_list, default=[1],
                   help="comma list of stream counts, e.g. 1,2,4,8,16 (closed loop; llama.cpp variants at 1 only)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="target's load-time quantization (int8 | rtn4 | nf4)")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize the target's lm_head too")
    p.add_argument("--draft-quantization", default=None, help="draft's load-time quantization")
    p.add_argument("--draft-quantize-lm-head", action="store_true", help="quantize the draft's lm_head too")
    p.add_argument("--llama-server", default="llama-cpp-server", help="llama-server binary for llama.cpp variants")
    p.add_argument("--port", type=int, default=8191, help="first loopback port for llama-server anchors")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-json", type=Path, default=None)

    p = sub.add_parser("quality", help="held-out ShareGPT perplexity and greedy agreement per weight format")
    p.add_argument("--model", default="smollm2-135m-instruct", help="known model name, .gguf file or HF dir")
    p.add_argument("--variants", default=None,
                   help="comma list of label=MODEL[@METHOD][:kv=KV_DTYPE] (default: float=<model>); "
                        "the first is the reference")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--eval-tokens", type=int, default=50000, help="predicted tokens for perplexity")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="longest perplexity chunk")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="step budget: small budgets make the prompt's later rows read K/V back from the cache, "
                        "which KV-cache formats need (a whole-prompt prefill attends with fresh K/V)")
    p.add_argument("--agree-prompts", type=int, default=50)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-json", default=None, help="default: benchmarks/results/quality_<model>.json")
