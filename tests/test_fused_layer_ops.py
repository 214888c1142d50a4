"""The fused CPU ops of a decoder layer (csrc/fused_layer_ops.cpp) against the torch code they
replace, and a whole model's logits with and without them."""
from __future__ import annotations

import pytest
import torch

from tokenmill.model import layers
from tokenmill.model.cpu_kernels import fused_layer_kernels
from tokenmill.model.layers import RMSNorm, silu_and_mul
from tokenmill.model.rope import RopeScaling, RotaryEmbedding


@pytest.fixture
def torch_path(monkeypatch):
    """Call inside a test to run the torch reference instead of the kernels."""
    def off() -> None:
        monkeypatch.setattr(layers, "fused_layer_kernels", lambda: None)
    return off


def _require_kernels() -> None:
    if fused_layer_kernels() is None:
        pytest.fail("the fused layer ops did not compile on this CPU host")


@pytest.mark.parametrize("wdtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_and_add_rms_norm_match_torch(torch_path, wdtype, tol, rows):
    _require_kernels()
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.rand(576) + 0.5).to(wdtype)
    x = torch.randn(rows, 576) * 30
    delta = torch.randn(rows, 576).to(wdtype)
    with torch.inference_mode():
        got_n = norm(x)
        got_sum, got_add = norm.add_forward(x, delta)
        x_before = x.clone()
        torch_path()
        ref_n = norm(x)
        ref_sum, ref_add = norm.add_forward(x, delta)
    assert torch.equal(x, x_before)                       # the residual input is not modified
    assert got_n.dtype == wdtype and got_add.dtype == wdtype and got_sum.dtype == torch.float32
    torch.testing.assert_close(got_sum, ref_sum, rtol=0, atol=0)
    torch.testing.assert_close(got_n.float(), ref_n.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_add.float(), ref_add.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rope_in_place_matches_torch_on_qkv_views(torch_path, dtype, tol):
    """q and k as strided views of one fused qkv row (as the model passes them), llama3
    scaling so the table is not the plain one, positions out of order."""
    _require_kernels()
    torch.manual_seed(1)
    hq, hk, d = 9, 3, 64
    rope = RotaryEmbedding(d, 4096, 100000.0, RopeScaling("llama3", 8.0, 1024), 1024)
    qkv = torch.randn(11, (hq + 2 * hk) * d).to(dtype)
    positions = torch.tensor([0, 5, 4095, 17, 1, 2, 3, 800, 801, 2047, 9])

    def split(t):
        q, k, _ = t.split([hq * d, hk * d, hk * d], dim=-1)
        return q.view(11, hq, d), k.view(11, hk, d)
    with torch.inference_mode():
        work = qkv.clone()
        got_q, got_k = rope(positions, *split(work))
        assert got_q.data_ptr() == work.data_ptr()             # rotated in place, v untouched
        assert torch.equal(work[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])
        torch_path()
        ref_q, ref_k = rope(positions, *split(qkv.clone()))
    torch.testing.assert_close(got_q.float(), ref_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), ref_k.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_and_mul_matches_torch(torch_path, dtype, tol):
    _require_kernels()
    torch.manual_seed(2)
    gate_up = (torch.randn(5, 2 * 1536) * 4).to(dtype)
    with torch.inference_mode():
        got = silu_and_mul(gate_up)
        torch_path()
        ref = silu_and_mul(gate_up)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_kernels_stay_out_of_autograd():
    """With gradients on (LoRA training), the torch path runs and gradients flow."""
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(torch_path, dtype):
    """K/V as strided views of a qkv output land in the same slots as with index_copy_; a slot
    outside the cache is refused."""
    from tokenmill.model.attention import write_kv_cache
    _require_kernels()
    torch.manual_seed(3)
    hk, d, blocks, bs = 3, 64, 5, 4
    qkv = torch.randn(7, (9 + 2 * hk) * d).to(dtype)
    _, k, v = qkv.split([9 * d, hk * d, hk * d], dim=-1)
    k, v = k.view(7, hk, d), v.view(7, hk, d)
    slots = torch.tensor([19, 0, 3, 8, 9, 10, 17])
    caches = [torch.zeros(blocks, bs, hk, d, dtype=dtype) for _ in range(4)]
    with torch.inference_mode():
        write_kv_cache(k, v, caches[0], caches[1], slots)
        with pytest.raises(RuntimeError, match="outside the cache"):
            write_kv_cache(k, v, caches[0].clone(), caches[1].clone(), torch.tensor([0, 1, 2, 3, 4, 5, 20]))
        torch_path()
        write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0
