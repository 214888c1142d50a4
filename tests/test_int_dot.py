"""The integer-dot kernel (AVX512-VNNI or AVX2 CPUs) against its definition in torch: the dequantized
weight times the block-quantized activation, and the layers that use it against their float
weights."""
import pytest
import torch

from tokenmill.cpu_extension import cpu_flags
from tokenmill.quant import kernels
from tokenmill.quant.group import rtn_quantize
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.int_dot import (Int4DotWeights, Int8DotWeights, int8_block, int_dot_kernels,
                                     quantize_blocks_reference)


def _available() -> bool:
    assert int_dot_kernels() is not None or " avx2" not in cpu_flags(), "kernel failed to build on an AVX2 CPU"
    return int_dot_kernels() is not None


pytestmark = pytest.mark.skipif(not _available(), reason="no AVX2 on this CPU")


def _int4_weight(n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, k // group) * 0.02 + 1e-3).half().float()      # the kernel keeps fp16 tables
    offsets = (-torch.randint(0, 16, (n, k // group)) * scales).half().float()
    w = q.float() * scales.repeat_interleave(group, 1) + offsets.repeat_interleave(group, 1)
    return q, scales, offsets, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 4, 6, 17])
def test_int4_kernel_is_block_quantized_x_times_weight(m, dtype):
    torch.manual_seed(m)
    n, k, group = 963, 576, 64                     # odd N: the last row pair has one row
    q, scales, offsets, w = _int4_weight(n, k, group)
    x = torch.randn(m, k).to(dtype)
    got = Int4DotWeights.build(q, scales, offsets, None, None, group).linear(x)
    assert got.dtype == dtype and got.shape == (m, n)
    ref = quantize_blocks_reference(x, group) @ w.T
    tol = 1e-5 if dtype == torch.float32 else 8e-3                        # bf16 output rounding
    assert (got.float() - ref).abs().max() <= tol * ref.abs().max()


def test_int4_kernel_permutes_x_and_adds_bias():
    torch.manual_seed(1)
    n, k, group = 64, 1536, 128
    q, scales, offsets, w = _int4_weight(n, k, group)
    perm, bias = torch.randperm(k), torch.randn(n)
    x = torch.randn(5, k)
    got = Int4DotWeights.build(q, scales, offsets, perm, bias, group).linear(x)
    ref = quantize_blocks_reference(x[:, perm], group) @ w.T + bias
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("k", [576, 1536, 64])
def test_int8_kernel_is_block_quantized_x_times_weight(k):
    torch.manual_seed(k)
    n, block = 130, int8_block(k)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    row_scale = torch.rand(n) * 0.01
    x = torch.randn(7, k)
    x[2] = 0                                      # an all-zero row: scale 0, no division by zero
    got = Int8DotWeights.build(codes, row_scale, None, block).linear(x)
    ref = quantize_blocks_reference(x, block) @ (codes.float() * row_scale[:, None]).T
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (got[2] == 0).all()


@pytest.mark.parametrize("group", [64, 128])
def test_int4_linear_takes_the_int_dot_path(group, monkeypatch):
    torch.manual_seed(2)
    lin = Int4Linear(rtn_quantize(torch.randn(96, 576), 4, group), torch.randn(96))
    assert lin.int_dot is not None and lin.packed is None
    x = torch.randn(3, 576)
    monkeypatch.setattr(kernels, "_OVERRIDE", 1000)
    with torch.inference_mode():                  # as the runner calls it
        got = lin(x)
    w = lin.dequantize()
    ref = quantize_blocks_reference(x, 64) @ w.T + lin.bias
    assert (got - ref).abs().max() <= 2e-3 * ref.abs().max()             # fp16 tables vs fp32
    exact = x @ w.T + lin.bias
    assert (got - exact).abs().max() <= 2e-2 * exact.abs().max()


@pytest.mark.parametrize("smooth", [False, True])
def test_int8_linear_takes_the_int_dot_path(smooth, monkeypatch):
    torch.manual_seed(3)
    w = torch.randn(80, 1536)
    inv = torch.rand(1536) + 0.5 if smooth else None
    lin = Int8Linear.from_float(w, torch.randn(80), smooth_inv=inv)
    assert lin.int_dot is not None
    x = torch.randn(4, 1536)
    monkeypatch.setattr(kernels, "_OVERRIDE", 1000)
    got = lin(x)
    xs = x if inv is None else x * inv
    ref = quantize_blocks_reference(xs, lin.int_dot.block) @ lin.dequantize().T + lin.bias
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.skipif(not (int_dot_kernels() is not None and int_dot_kernels().has_amx()), reason="no AMX-INT8")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4, 16, 33, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(101, 1536, 128), (117, 576, 64)])   # one strip per run; runs of 2, a short last
def test_amx_tiles_match_the_vnni_kernel(bits, m, dtype, n, k, group):
    """The AMX kernel (whole 16-row strips; the rows past them stay on VNNI) against the VNNI
    kernel on the same call: same integer products, fp32 sums in another order."""
    torch.manual_seed(m + bits)
    bias, perm = torch.randn(n), torch.randperm(k)
    if bits == 4:
        q, scales, offsets, _ = _int4_weight(n, k, group)
        weights = Int4DotWeights.build(q, scales, offsets, perm, bias, group)
    else:
        weights = Int8DotWeights.build(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01,
                                       bias, int8_block(k))
    x = torch.randn(m, k).to(dtype)
    mod = int_dot_kernels()
    saved = mod.amx_min_rows()
    try:
        mod.set_amx_min_rows(1, 1)
        amx = weights.linear(x)
        mod.set_amx_min_rows(1 << 40, 1 << 40)
        vnni = weights.linear(x)
    finally:
        mod.set_amx_min_rows(*saved)
    assert amx.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7   # bf16: two roundings of nearly equal fp32 sums, an ulp apart
    assert ((amx.float() - vnni.float()).abs() <= tol * vnni.float().abs() + 1e-5 * vnni.float().abs().max()).all()
