"""What a step over 1..8 query rows of one sequence costs the target model: the price of
speculative verification (1 + k rows) against a plain decode step (1 row).

Loads MODEL, prefills a 60-token context, then times the runner's forward over its last token
and rows - 1 draft tokens (as the engine verifies them: decode rows, one per position), median
of `--repeats`.
Also times one fp32 linear of the model's gate_up shape through F.linear (MKL) and through
tokenmill's small-batch kernel (csrc/dense_small_m.h), weights streamed from memory.

    .venv/bin/python benchmarks/verify_cost.py --model qwen2.5-coder-0.5b-instruct --rows 1,2,3,5,7
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenmill.bench.machine import machine_header
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.cpu_kernels import dense_small_m_kernels
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def step_times(engine: LLMEngine, rows_list: list[int], repeats: int) -> dict[int, float]:
    seq = Sequence("verify", list(range(100, 160)), SamplingParams(max_tokens=None))
    engine.block_manager.admit(seq, [], 60 + max(rows_list))
    engine.runner.execute([(seq, 60)])
    out = {}
    for rows in rows_list:
        seq.spec_token_ids = list(range(200, 199 + rows))  # the last context token + rows - 1 drafts
        times = []
        for i in range(repeats + 1):         # the first run warms this shape up (not timed)
            seq.num_computed_tokens = 59
            t = time.perf_counter()
            engine.runner.execute([(seq, rows)])
            if i:
                times.append(time.perf_counter() - t)
        out[rows] = statistics.median(times) * 1e3
    return out


def linear_times(n: int, k: int, rows_list: list[int], repeats: int) -> dict[int, tuple[float, float | None]]:
    ext = dense_small_m_kernels()
    weights = [torch.randn(n, k) for _ in range(max(4, (1 << 30) // (n * k * 4)))]   # ~1 GiB: from memory
    out = {}
    for rows in rows_list:
        x = torch.randn(rows, k)
        def run(fn) -> float:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                for w in weights:
                    fn(x, w)
                times.append((time.perf_counter() - t) / len(weights))
            return statistics.median(times) * 1e3
        out[rows] = (run(lambda x, w: F.linear(x, w)),
                     run(lambda x, w: ext.small_m_linear(x, w, None)) if ext and rows <= ext.max_rows else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--rows", default="1,2,3,5,7")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory=1 << 28,
                                    quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                                    num_threads=args.threads,
                                    enable_prefix_caching=False))
    cfg = engine.model_config
    with torch.inference_mode():
        steps = step_times(engine, rows_list, args.repeats)
        lin = linear_times(2 * cfg.intermediate_size, cfg.hidden_size, rows_list, args.repeats)
    print(f"{'rows':>4} {'step ms':>9} {'vs 1 row':>9} {'gate_up F.linear ms':>20} {'small-batch kernel ms':>22}")
    for rows in rows_list:
        fl, sm = lin[rows]
        print(f"{rows:>4} {steps[rows]:>9.1f} {steps[rows] / steps[rows_list[0]]:>8.2f}x {fl:>20.3f} "
              f"{'-' if sm is None else f'{sm:.3f}':>22}")


if __name__ == "__main__":
    main()
