"""`tokenmill bench <sub-command>` arguments."""
from __future__ import annotations

import argparse

DEFAULT_JSON = "benchmarks/results/throughput.json"


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
