"""Quantized matmul paths by rows M: where the weight-only kernels stop beating dequantize+GEMM.

All linears of all 30 SmolLM2-135M layers (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576; ~134M weights, so they stream from memory, not cache), random weights, one
forward of the whole stack per timing, median of 5 rounds. Paths: dense fp32 and bf16 GEMM,
tokenmill's Int8Linear / Int4Linear (rtn4, group 64) / NF4Linear forced onto their small-M
kernel, their tiled dequantize+GEMM (`tiled`, csrc/tiled_dequant_gemm.cpp) or the whole-weight
dequantize+GEMM path, and, where the CPU has VNNI/AMX, `torch._int_mm` (W8A8) and tokenmill's
integer-dot kernel (`int_dot`, csrc/int_dot_linear.cpp: x quantized per block to int8); with
AMX-INT8, `int_dot` is its VNNI half and `AMX` the same kernel on AMX tiles (csrc/int_dot_amx.h).
With AMX-BF16 the tiled path multiplies bf16 x on AMX tiles from a few rows (csrc/tiled_amx.h);
`whole` is the same path with that kernel off (whole-weight decode + one bf16 GEMM).

    .venv/bin/python benchmarks/quant_kernels.py --rows 1,8,32,64,128 --threads 2 [--act-dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.bench.machine import machine_header
from tokenmill.quant import int_dot, kernels, tiled
from tokenmill.quant.group import rtn_quantize
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.nf4 import NF4Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (out, in) per layer
LAYERS = 30


def timed(fn: Callable[[], None], rounds: int = 5) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,64,128")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--act-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="activation dtype fed to the quantized paths (a bf16 model's is bfloat16)")
    args = p.parse_args()
    act = getattr(torch, args.act_dtype)
    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in SHAPES]
    bf16 = [w.bfloat16() for w in weights]
    has_int_dot = int_dot.int_dot_available()
    has_amx = has_int_dot and int_dot.int_dot_kernels().has_amx()
    amx_default = int_dot.int_dot_kernels().amx_min_rows() if has_amx else None
    tiled_ext = tiled.tiled_kernels()
    tiled_amx = act == torch.bfloat16 and tiled_ext is not None and hasattr(tiled_ext, "amx_min_rows")
    int_dot.ENABLED = False                 # these layers keep torch's weight-only kernels
    int8 = [Int8Linear.from_float(w, None) for w in weights]
    int4 = [Int4Linear(rtn_quantize(w, 4, 64), None) for w in weights]
    int_dot.ENABLED = has_int_dot
    dot8 = [Int8Linear.from_float(w, None) for w in weights] if has_int_dot else []
    dot4 = [Int4Linear(rtn_quantize(w, 4, 64), None) for w in weights] if has_int_dot else []
    nf4 = [NF4Linear.from_float(w, None) for w in weights]
    fast_int8 = kernels.cpu_has_fast_int8_dot()
    qint = [m.qweight.t().contiguous() for m in int8] if fast_int8 else []

    header = ["M", "fp32", "bf16", "int8 kernel", "int8 tiled", "int8 deq+mm", "int4 kernel", "int4 tiled",
              "int4 deq+mm", "nf4 kernel", "nf4 tiled",
              "nf4 deq+mm"] + (["W8A8 _int_mm"] if fast_int8 else []) + (
              ["int8 int_dot", "int4 int_dot"] if has_int_dot else []) + (
              ["int8 AMX", "int4 AMX"] if has_amx else []) + (["int8 whole", "int4 whole"] if tiled_amx else [])
    print(" | ".join(f"{h:>12s}" for h in header))
    for m_rows in (int(r) for r in args.rows.split(",")):
        xs = {dt: {k: torch.randn(m_rows, k).to(dt) for k in (576, 1536)} for dt in (torch.float32, torch.bfloat16)}
        row = [timed(lambda: [F.linear(xs[torch.float32][w.shape[1]], w) for w in weights]),
               timed(lambda: [F.linear(xs[torch.bfloat16][w.shape[1]], w) for w in bf16])]
        for mods in (int8, int4):
            for limit, tiles in ((10 ** 6, True), (0, True), (0, False)):
                kernels._OVERRIDE, tiled._ENABLED = limit, tiles
                row.append(timed(lambda: [m(xs[act][m.in_features]) for m in mods]))
        kernels._OVERRIDE, tiled._ENABLED = None, True
        row.append(timed(lambda: [m.kernel_forward(xs[act][m.in_features]) for m in nf4]))
        row.append(timed(lambda: [m.tiled_forward(xs[act][m.in_features]) for m in nf4]))
        row.append(timed(lambda: [m.dequant_forward(xs[act][m.in_features]) for m in nf4]))
        if fast_int8:
            xq = {k: torch.randint(-127, 127, (max(m_rows, 17), k), dtype=torch.int8) for k in (576, 1536)}
            row.append(timed(lambda: [torch._int_mm(xq[q.shape[0]], q) for q in qint]))
        kernels._OVERRIDE = 10 ** 6
        dot = int_dot.int_dot_kernels()
        for amx_rows in ((10 ** 9, 1) if has_amx else (None,)):   # AMX machines: the VNNI kernel, then AMX tiles
            if amx_rows is not None:
                dot.set_amx_min_rows(amx_rows, amx_rows)
            for mods in ((dot8, dot4) if has_int_dot else ()):
                row.append(timed(lambda: [m(xs[act][m.in_features]) for m in mods]))
        if has_amx:
            dot.set_amx_min_rows(*amx_default)
        if tiled_amx:   # the tiled path without its AMX kernel
            default_rows = tiled_ext.amx_min_rows()
            tiled_ext.set_amx_min_rows(10 ** 9)
            for mods in (int8, int4):
                kernels._OVERRIDE = 0
                row.append(timed(lambda: [m(xs[act][m.in_features]) for m in mods]))
            tiled_ext.set_amx_min_rows(default_rows)
        kernels._OVERRIDE = None
        print(" | ".join([f"{m_rows:>12d}"] + [f"{v:12.2f}" for v in row]), flush=True)
    print(f"ms per forward of all 30 layers' linears (median of 5); quantized paths fed {args.act_dtype}")


if __name__ == "__main__":
    main()
