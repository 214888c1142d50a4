"""Tensor parallelism on this machine: decode step time of TP=1 and TP=2 (gloo, 2 processes x 1
thread vs 1 process x 2 threads) at batch 1 and 32, and the share of the TP=2 step that rank 0
spends inside collectives (all-reduces of o_proj / down_proj / embedding, the logits gather,
waiting for the other rank included). The step's broadcast of its inputs is counted apart.

Greedy, ignore_eos, the same prompts for both; each configuration runs `--repeats` times in
interleaved rounds (the machine is shared); medians.

    .venv/bin/python benchmarks/tp_decode.py --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.machine import machine_header, machine_info

RESULTS = Path(__file__).parent / "results" / "tp_decode.json"


def decode_step_ms(llm: LLM, batch: int, tokens: int) -> tuple[float, float, float]:
    """(ms per decode step, ms of collectives per step, ms of step broadcast per step) over `tokens` steps
    after the prompts' prefill (measured apart by a 1-token run)."""
    prompts = [f"Request {i}: write a long story about a lighthouse keeper." for i in range(batch)]
    tp = llm.engine.tp

    def run(n: int) -> tuple[float, float, float]:
        c0, b0 = (tp.collective_s, tp.broadcast_s) if tp else (0.0, 0.0)
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        c1, b1 = (tp.collective_s, tp.broadcast_s) if tp else (0.0, 0.0)
        return time.perf_counter() - t0, c1 - c0, b1 - b0
    prefill = run(1)
    total = run(tokens + 1)
    return tuple(1000 * (t - p) / tokens for t, p in zip(total, prefill))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=str(RESULTS))
    args = p.parse_args()
    print(machine_header(), flush=True)
    kw = dict(dtype=args.dtype, max_model_len=512, kv_cache_memory=512 << 20, max_num_seqs=max(args.batches),
              max_num_batched_tokens=4096, enable_prefix_caching=False)
    samples: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    for r in range(args.repeats):
        for tp in (1, 2):
            with LLM(args.model, tensor_parallel_size=tp, num_threads=2 // tp, **kw) as llm:
                decode_step_ms(llm, 1, 4)              # warm-up
                for b in args.batches:
                    samples.setdefault((tp, b), []).append(decode_step_ms(llm, b, args.tokens))
                    print(f"round {r} tp={tp} batch={b}: {samples[(tp, b)][-1][0]:.1f} ms/step", flush=True)
    rows = []
    print(f"\n{'batch':>5} {'TP=1 ms/step':>13} {'TP=2 ms/step':>13} {'TP2/TP1':>8} {'collectives':>12} {'broadcast':>10}")
    for b in args.batches:
        one = statistics.median(s[0] for s in samples[(1, b)])
        two, comm, bcast = (statistics.median(s[i] for s in samples[(2, b)]) for i in range(3))
        rows.append({"batch": b, "tp1_ms": one, "tp2_ms": two, "tp2_collective_ms": comm, "tp2_broadcast_ms": bcast})
        print(f"{b:>5} {one:>13.1f} {two:>13.1f} {two / one:>7.2f}x {comm:>7.1f} ms {100 * comm / two:>3.0f}%"
              f" {bcast:>5.1f} ms")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps({"machine": machine_info(), "config": vars(args), "rows": rows,
                                                  "samples": {f"tp{k[0]}_b{k[1]}": v for k, v in samples.items()}},
                                                 indent=1) + "\n")
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
