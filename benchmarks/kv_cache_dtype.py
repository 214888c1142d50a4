"""KV-cache dtype: the decode step at batch 32 and the capacity a byte budget buys.

1. speed: 32 sequences with ~`--context`-token prompts, all decoding; the median engine step
   time over `--steps` steps, in `--repeats` rounds interleaved across the variants (median of
   the rounds), for each model dtype x KV dtype, in one run;
2. capacity: for SmolLM2 and Gemma 3 (configs read from their GGUFs), each KV dtype, and for
   Gemma 3 with and without its sliding window: KV blocks the engine's planner gives a
   `--budget` of bytes, and the max number of concurrent 2,048-token requests, next to the
   closed-form memory formula (layers x tokens x 2 x KV heads x (head_dim x bytes + scale)).

    .venv/bin/python benchmarks/kv_cache_dtype.py --model smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.engine.kv_groups import blocks_per_sequence, plan_kv_groups
from tokenmill.hub import resolve_model
from tokenmill.model.loader import read_model_config
from tokenmill.quant.kv_cache import KV_CACHE_DTYPES, token_head_bytes, storage_dtype
from tokenmill.sampling_params import SamplingParams

REQUEST_TOKENS = 2048


def decoding_engine(model: str, dtype: str, kv: str, batch: int, context: int, steps: int, repeats: int):
    """An engine with `batch` sequences of ~context tokens, all past their prompts."""
    from tokenmill.llm import LLM
    # early sequences decode while later ones prefill: room for all of it
    budget = context * batch // 200 + steps * repeats + 64
    llm = LLM(model=model, dtype=dtype, kv_cache_dtype=kv, max_model_len=context + budget,
              max_num_seqs=batch, kv_cache_memory=1 << 30, enable_prefix_caching=False)
    engine = llm.engine
    ids = list(range(1000, 1000 + context))
    for i in range(batch):
        engine.add_request(str(i), [ids[0] + i] + ids[1:], SamplingParams(temperature=0, ignore_eos=True,
                                                                          max_tokens=budget))
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.step()
    return llm


def step_times(engines: dict, batch: int, steps: int, repeats: int) -> dict[str, float]:
    """Median step ms per engine: `repeats` interleaved rounds (the machine is shared and drifts),
    each the median of `steps` steps; the median of the rounds."""
    rounds: dict[str, list[float]] = {key: [] for key in engines}
    for _ in range(repeats):
        for key, llm in engines.items():
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                llm.engine.step()
                times.append(time.perf_counter() - t0)
            assert len(llm.engine.scheduler.running) == batch
            rounds[key].append(statistics.median(times))
    return {key: statistics.median(r) * 1e3 for key, r in rounds.items()}


def capacity_rows(budget: int, block_size: int) -> list[dict]:
    rows = []
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        cfg = read_model_config(resolve_model(name))
        variants = [("-", cfg)]
        if cfg.sliding_window is not None:
            variants = [("on", cfg), ("off", dataclasses.replace(cfg, sliding_window=None, layer_types=None))]
        for window, c in variants:
            for kv in [k for k in KV_CACHE_DTYPES if k != "auto"]:
                dt = storage_dtype("auto" if kv == "bfloat16" else kv, torch.bfloat16)
                layer_token = 2 * c.num_kv_heads * token_head_bytes(c.head_dim, dt)
                groups = plan_kv_groups(c, budget, block_size, layer_token * block_size, REQUEST_TOKENS, 256)
                fits = min(g.num_blocks // blocks_per_sequence(g.window, REQUEST_TOKENS, block_size) for g in groups)
                # the formula: global layers x full length + local layers x the window
                per_request = sum(len(g.layers) * (REQUEST_TOKENS if g.window is None else min(g.window, REQUEST_TOKENS))
                                  for g in groups) * layer_token
                rows.append({"model": name, "window": window, "kv": kv, "bytes_per_token_layer": layer_token,
                             "blocks": [g.num_blocks for g in groups], "groups": [len(g.layers) for g in groups],
                             "max_requests_2k": fits, "formula_requests_2k": budget / per_request,
                             "formula_mib_per_request": per_request / 2 ** 20})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes")
    ap.add_argument("--kv", default="auto,int8,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=480)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=lambda s: int(float(s) * 2 ** 30), default=2 ** 30, help="GiB for capacity")
    ap.add_argument("--output-json", type=Path, default=Path("benchmarks/results/kv_cache_dtype.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(machine_header(), flush=True)
    engines = {(dtype, kv): decoding_engine(args.model, dtype, kv, args.batch, args.context, args.steps, args.repeats)
               for dtype in args.dtypes.split(",") for kv in args.kv.split(",")}
    speed = []
    for (dtype, kv), ms in step_times(engines, args.batch, args.steps, args.repeats).items():
        speed.append({"dtype": dtype, "kv": kv, "step_ms": ms})
        print(f"{args.model} {dtype:<9} KV {kv:<9} batch {args.batch} x ~{args.context} ctx: decode step "
              f"{ms:7.1f} ms (median of {args.repeats} interleaved rounds x median of {args.steps} steps)", flush=True)
    cap = capacity_rows(args.budget, 16)
    print(f"\ncapacity under {args.budget / 2 ** 30:g} GiB, {REQUEST_TOKENS}-token requests, 16-token blocks:")
    print(f"{'model':<22} {'window':<6} {'KV':<9} {'B/token/layer':>13} {'blocks (per group)':>20} "
          f"{'max 2k reqs':>11} {'formula':>8} {'MiB/req':>8}")
    for r in cap:
        blocks = " + ".join(f"{n}x{l}L" for n, l in zip(r["blocks"], r["groups"]))
        print(f"{r['model']:<22} {r['window']:<6} {r['kv']:<9} {r['bytes_per_token_layer']:>13} {blocks:>20} "
              f"{r['max_requests_2k']:>11} {r['formula_requests_2k']:>8.1f} {r['formula_mib_per_request']:>8.2f}")
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps({"machine": machine_info(), "model": args.model, "batch": args.batch,
                                            "context": args.context, "speed": speed, "capacity": cap}, indent=1))
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
