"""Micro-benchmark of the decode hot path: the C++ paged decode-attention kernel alone, and one
whole `LLMEngine.step` with B sequences decoding (SmolLM2-135M, bf16).

    .venv/bin/python benchmarks/decode_step.py --batch 32 --context 400 --threads 2

Prints medians of 5 timing rounds. Run on a quiet machine; compare commits by running it on each.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.bench.machine import machine_header

from tokenmill import LLM, SamplingParams
from tokenmill.model.cpu_kernels import paged_decode_kernels


def kernel_ms(batch: int, context: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
              block: int = 16, iters: int = 30) -> float:
    """Median ms per call (= per layer) of the decode kernel on random bf16 K/V."""
    k = paged_decode_kernels()
    if k is None:
        raise SystemExit("the C++ decode kernel is unavailable")
    width = -(-context // block)
    blocks = batch * width
    kc = torch.randn(blocks, block, kv_heads, head_dim).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(blocks).view(batch, width).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim).to(torch.bfloat16)
    for _ in range(3):
        k.paged_decode_attention(q, kc, vc, tables, lens, head_dim ** -0.5, 0)
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            k.paged_decode_attention(q, kc, vc, tables, lens, head_dim ** -0.5, 0)
        rounds.append((time.perf_counter() - t) / iters * 1000)
    return statistics.median(rounds)


def step_ms(batch: int, context: int, steps: int = 5) -> float:
    """Median ms of one engine step with `batch` sequences decoding at ~`context` tokens."""
    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", max_model_len=context + 256,
              max_num_seqs=max(batch, 1), kv_cache_memory=2 << 30, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [(i * 7 + j) % 40000 + 100 for j in range(context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens
              for s in engine.scheduler.waiting + engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        rounds.append((time.perf_counter() - t) / steps * 1000)
    return statistics.median(rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    print(f"decode kernel, B={args.batch} context={args.context} bf16: "
          f"{kernel_ms(args.batch, args.context):.3f} ms per layer")
    ms = step_ms(args.batch, args.context)
    print(f"engine decode step, B={args.batch} context~{args.context}: {ms:.1f} ms ({args.batch / ms * 1000:.0f} tok/s)")


if __name__ == "__main__":
    main()
