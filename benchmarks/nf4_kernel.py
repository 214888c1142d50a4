"""NF4 linear vs fp32 dense on the SmolLM2-135M projection shapes, all 30 layers: sets
`weight_only_max_rows("nf4")` in tokenmill/quant/kernels.py (the M where the tiled dequantize + GEMM overtakes the kernel).

    .venv/bin/python benchmarks/nf4_kernel.py --threads 2

Per M (activation rows) it times one pass over all 120 linears (30 x qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536), median of 5 rounds, for: fp32 dense F.linear, the NF4 C++
kernel, and NF4 dequantize + F.linear. Every layer has its own weights so nothing stays in
cache between passes. NF4 weights are random codes/absmax (from_state): the speed of a pass
does not depend on the values, and quantizing 106 M weights would take longer than timing.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenmill.bench.machine import machine_header
import torch.nn.functional as F

from tokenmill.quant.nf4 import NF4Linear, nf4_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (N, K) per layer
LAYERS = 30


def random_nf4(n: int, k: int, block: int = 64) -> NF4Linear:
    nb = n * k // block
    state = {"codes": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
             "absmax_q": torch.randint(-127, 128, (nb,), dtype=torch.int8),
             "absmax_scale": torch.full((-(-nb // 256),), 1e-4), "absmax_mean": torch.tensor(0.02)}
    return NF4Linear.from_state(state, None, n, k, block, double_quant=True)


def median_ms(fn: Callable[[], None], rounds: int = 5) -> float:
    fn()   # warm-up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    if nf4_kernels() is None:
        raise SystemExit("the C++ NF4 kernel is unavailable")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    dense = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    nf4 = [random_nf4(n, k) for _ in range(LAYERS) for n, k in SHAPES]
    dense_mb = sum(w.numel() * w.element_size() for w in dense) / 1e6
    nf4_mb = sum(q.codes.numel() + q.absmax_f32.numel() * 4 for q in nf4) / 1e6   # what the kernel reads
    print(f"{LAYERS} layers, {sum(w.numel() for w in dense) / 1e6:.1f} M weights; "
          f"bytes read: {args.dtype} dense {dense_mb:.0f} MB, NF4 {nf4_mb:.0f} MB; threads {args.threads}")
    print(f"{'M':>4} {'dense ms':>9} {'GB/s':>5} {'nf4 kernel':>10} {'GB/s':>5} {'nf4 deq+mm':>10}")
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in SHAPES}}
        t_dense = median_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in dense])
        t_kern = median_ms(lambda: [q.kernel_forward(xs[q.in_features]) for q in nf4])
        t_deq = median_ms(lambda: [q.dequant_forward(xs[q.in_features]) for q in nf4])
        print(f"{m:>4} {t_dense:>9.1f} {dense_mb / t_dense:>5.1f} {t_kern:>10.1f} {nf4_mb / t_kern:>5.1f} "
              f"{t_deq:>10.1f}")


if __name__ == "__main__":
    main()
