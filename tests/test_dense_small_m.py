"""The small-batch fp32 linear kernel (csrc/dense_small_m.h) against F.linear, and its use by
the model's Linear (eager) and the C++ decode stack (same choice, same bits)."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.cpu_kernels import dense_small_m_kernels
from tokenmill.model.layers import Linear

ext = dense_small_m_kernels()
pytestmark = pytest.mark.skipif(ext is None, reason="no SIMD build of the small-batch kernel on this CPU")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n, k", [(33, 64), (130, 77), (96, 1000)])     # K not a multiple of the vector width too
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, n, k, bias):
    torch.manual_seed(rows * n + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(ext.small_m_linear(x, w, b), F.linear(x, w, b), atol=2e-5 * k ** 0.5, rtol=1e-5)


def test_non_contiguous_x_and_refusals():
    x = torch.randn(16, 64)[::2]                 # 8 strided rows
    w = torch.randn(40, 64)
    torch.testing.assert_close(ext.small_m_linear(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="rows"):
        ext.small_m_linear(torch.randn(9, 64), w, None)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.small_m_linear(x.bfloat16(), w.bfloat16(), None)


def test_linear_module_takes_the_kernel_only_where_it_applies(monkeypatch):
    lin = Linear(64, 48)
    calls = []
    real = ext.small_m_linear
    monkeypatch.setattr(ext, "small_m_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, 5, 8, 9, 32):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        assert lin(torch.randn(0, 64)).shape == (0, 48)
        lin.bfloat16()(torch.randn(2, 64, dtype=torch.bfloat16))
    assert calls == [1, 5, 8]                     # > 8 rows and bf16 stay on F.linear
    x = torch.randn(3, 64, requires_grad=True)
    Linear(64, 48)(x).sum().backward()            # autograd: the torch path, which has a backward
    assert x.grad is not None


@pytest.mark.parametrize("rows", [9, 12, 16])
def test_chunked_rows_match_f_linear_and_each_chunk_alone(rows):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 96), torch.randn(200, 96), torch.randn(200)
    out = ext.small_m_linear_chunked(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=2e-4, rtol=1e-5)
    assert torch.equal(out[8:], ext.small_m_linear(x[8:], w, b))     # a chunk's bits as on its own


def test_chunked_only_where_it_was_measured_to_pay(monkeypatch):
    assert ext.chunked_pays(12, 3072, 576) and ext.chunked_pays(16, 49152, 576)
    assert not ext.chunked_pays(8, 3072, 576) and not ext.chunked_pays(17, 3072, 576)
    assert not ext.chunked_pays(12, 576, 1536)                      # deeper than wide: MKL
    calls = []
    real = ext.small_m_linear_chunked
    monkeypatch.setattr(ext, "small_m_linear_chunked", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        wide = Linear(64, 128)
        for rows in (8, 12, 16, 17):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(wide(x), F.linear(x, wide.weight, wide.bias), atol=1e-4, rtol=1e-5)
        Linear(128, 64)(torch.randn(12, 128))
    assert calls == [12, 16]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_codes_match_the_dequantized_weight(rows):
    from tokenmill.quant.int8 import Int8Linear
    torch.manual_seed(rows)
    layer = Int8Linear.from_float(torch.randn(70, 100), torch.randn(70))
    x = torch.randn(rows, 100)
    want = F.linear(x, layer.dequantize(), layer.bias)
    torch.testing.assert_close(ext.small_m_linear_int8(x, layer.qweight, layer.scale, layer.bias), want,
                               atol=1e-4, rtol=1e-5)
    if layer.int_dot is None:            # CPUs without VNNI: the layer's forward takes this kernel
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
