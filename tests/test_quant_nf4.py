"""NF4Linear: code book, quantization error bounds, double quant, state round trip, and the C++
kernel held equal to the dequantize + matmul path (the kernel is skipped when it cannot build)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.quant import nf4
from tokenmill.quant.nf4 import NF4_CODEBOOK, NF4Linear, normal_float_codebook

TABLE = torch.tensor(NF4_CODEBOOK)
MAX_HALF_GAP = (TABLE[1:] - TABLE[:-1]).max().item() / 2


def _weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, :64] = 0.0            # an all-zero block
    w[5, 7] = 0.9              # an outlier block
    return w


def _torch_dequant(lin: NF4Linear) -> torch.Tensor:
    idx = torch.stack([lin.codes >> 4, lin.codes & 0x0F], dim=-1).view(lin.out_features, -1, lin.block_size)
    return (TABLE[idx.long()] * lin._absmax()[:, :, None]).reshape(lin.out_features, lin.in_features)


def test_codebook_values() -> None:
    assert len(NF4_CODEBOOK) == 16 and list(NF4_CODEBOOK) == sorted(NF4_CODEBOOK)
    assert NF4_CODEBOOK[0] == -1.0 and NF4_CODEBOOK[-1] == 1.0
    assert sum(v == 0.0 for v in NF4_CODEBOOK) == 1
    assert torch.equal(normal_float_codebook(), TABLE)   # QLoRA's construction, bit for bit


def test_dequant_error_bound_and_packing() -> None:
    w = _weight()
    lin = NF4Linear.from_float(w, None, block_size=64, double_quant=False)
    assert lin.codes.shape == (96, 64) and lin.codes.dtype == torch.uint8
    absmax = w.reshape(-1, 64).abs().amax(dim=1)
    assert torch.equal(lin.absmax.flatten(), absmax)
    err = (_torch_dequant(lin) - w).reshape(-1, 64).abs()
    assert (err <= MAX_HALF_GAP * absmax[:, None] + 1e-7).all()
    assert torch.equal(lin.dequantize(), _torch_dequant(lin))
    # high nibble = even element: a weight equal to +absmax at column 0 -> code 15 in the high nibble
    w2 = torch.zeros(1, 64)
    w2[0, 0], w2[0, 1] = 1.0, -1.0
    assert NF4Linear.from_float(w2, None, double_quant=False).codes[0, 0].item() == (15 << 4) | 0


def test_double_quant_absmax_and_state_round_trip() -> None:
    w = _weight(n=160, k=256)   # 640 blocks: 3 groups of 256, the last one partial
    lin = NF4Linear.from_float(w, torch.randn(160), block_size=64, double_quant=True)
    exact = w.reshape(-1, 64).abs().amax(dim=1)
    approx = lin._absmax().flatten()
    span = (exact - exact.mean()).abs().max()
    assert (approx - exact).abs().max() <= span / 127 * 0.5 + 1e-7
    assert lin.absmax_q.dtype == torch.int8 and lin.absmax_scale.shape == (3,)
    err = (lin.dequantize() - w).reshape(-1, 64).abs()
    assert (err <= MAX_HALF_GAP * approx.abs()[:, None] + (approx - exact).abs()[:, None] + 1e-6).all()
    state = lin.state_dict()
    assert set(state) == {"codes", "absmax_q", "absmax_scale", "absmax_mean", "bias"}
    back = NF4Linear.from_state(state, state["bias"], 160, 256, 64, True)
    assert torch.equal(back.dequantize(), lin.dequantize()) and torch.equal(back.bias, lin.bias)
    assert lin.weight_bytes() == 160 * 128 + 640 + 3 * 4 + 4


def test_k_not_divisible_by_block() -> None:
    with pytest.raises(ValueError, match=r"\[8, 96\].*block_size=64"):
        NF4Linear.from_float(torch.randn(8, 96), None, block_size=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_kernel_matches_dequant_path(m: int, with_bias: bool, dtype: torch.dtype) -> None:
    if nf4.nf4_kernels() is None:
        pytest.skip("C++ NF4 kernel unavailable")
    w = _weight(n=200, k=192)
    bias = torch.randn(200) if with_bias else None
    lin = NF4Linear.from_float(w, bias)
    x = torch.randn(m, 192).to(dtype)
    got = lin.kernel_forward(x)
    assert got.dtype == dtype and got.shape == (m, 200)
    ref = F.linear(x.float(), _torch_dequant(lin), bias)       # exact fp32 reference
    tol = 1e-4 if dtype == torch.float32 else 8e-3             # bf16: one output rounding
    assert torch.allclose(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    path = lin.dequant_forward(x)                              # the large-M / fallback path
    assert torch.allclose(got.float(), path.float(), rtol=4 * tol, atol=4 * tol * ref.abs().max().item())


@pytest.mark.parametrize("m", [33, 70])
@pytest.mark.parametrize("with_bias", [True, False])
def test_tiled_path_matches_dequant_path(m: int, with_bias: bool) -> None:
    """Large M: the tiled dequantize+GEMM (bitsandbytes nibble order, the code-book lookup) against
    the exact fp32 dequantized weight; N = 700 is not a multiple of the tile."""
    from tokenmill.quant.tiled import tiled_kernels
    if tiled_kernels() is None:
        pytest.skip("tiled kernel unavailable")
    w = _weight(n=700, k=576)
    bias = torch.randn(700) if with_bias else None
    lin = NF4Linear.from_float(w, bias)
    x = torch.randn(m, 576)
    ref = F.linear(x, _torch_dequant(lin), bias)
    got = lin(x)                                               # m above the NF4 row limit (12 or 16 by CPU kind): tiled
    assert torch.allclose(lin.tiled_forward(x), got)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


def test_fallback_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    lin = NF4Linear.from_float(_weight(), torch.randn(96))
    x = torch.randn(2, 128)
    monkeypatch.setattr(nf4, "nf4_kernels", lambda: None)
    out = lin(x)
    assert torch.allclose(out, F.linear(x, _torch_dequant(lin), lin.bias), atol=1e-5)
