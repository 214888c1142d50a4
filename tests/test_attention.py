"""Paged attention paths (C++ decode kernel, torch fallback, prefill spans) vs a dense fp64 reference."""
import pytest
import torch

from tokenmill.model import attention
from tokenmill.model.attention import AttentionMetadata, PrefillSpan, paged_attention
from tokenmill.model.cpu_kernels import paged_decode_kernels
from tokenmill.quant.kv_cache import QMAX, KVCache, dequantize, quantize


def reference(q, k_ctx, v_ctx, scale, window=None):
    """q: [n, Hq, D] at the last n positions of k_ctx/v_ctx [L, Hk, D]; a window of W keys."""
    n, hq, _ = q.shape
    L, hk, _ = k_ctx.shape
    k = k_ctx.double().repeat_interleave(hq // hk, dim=1)
    v = v_ctx.double().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    pos = torch.arange(L - n, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > pos, float("-inf"))
    if window is not None:
        s = s.masked_fill(torch.arange(L)[None, :] <= pos - window, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def make_case(dtype, hq, hk, lens, prefill=(), bs=4, d=16, seed=0, window=None):
    g = torch.Generator().manual_seed(seed)
    nblocks = 64
    k_cache = torch.randn(nblocks, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, bs, hk, d, generator=g).to(dtype)
    perm = torch.randperm(nblocks, generator=g).tolist()
    seqs = []      # (context len, query len, block table)
    for L, n in [(L, 1) for L in lens] + list(prefill):
        need = -(-L // bs)
        seqs.append((L, n, [perm.pop() for _ in range(need)]))
    q_rows, k_new, v_new, slots, spans = [], [], [], [], []
    for L, n, table in seqs:
        for p in range(L - n, L):
            slots.append(table[p // bs] * bs + p % bs)
        q_rows.append(torch.randn(n, hq, d, generator=g).to(dtype))
        k_new.append(torch.randn(n, hk, d, generator=g).to(dtype))
        v_new.append(torch.randn(n, hk, d, generator=g).to(dtype))
    q, k, v = torch.cat(q_rows), torch.cat(k_new), torch.cat(v_new)
    nd = len(lens)
    width = max(len(t) for L, n, t in seqs[:nd]) if nd else 0
    start = nd
    for L, n, table in seqs[nd:]:
        spans.append(PrefillSpan(start, start + n, L, None if n == L else torch.tensor(table), window))
        start += n
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=nd,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t in seqs[:nd]], dtype=torch.int32) if nd else None,
        decode_context_lens=torch.tensor(lens, dtype=torch.int32) if nd else None,
        prefills=spans, window=window)
    return q, k, v, k_cache, v_cache, meta, seqs


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch) -> str:
    """Decode rows through the C++ kernel, or through the torch fallback."""
    if request.param == "kernel" and paged_decode_kernels() is None:
        pytest.fail("the C++ decode kernel did not compile")
    if request.param == "torch":
        monkeypatch.setattr(attention, "paged_decode_kernels", lambda: None)
    return request.param


def expected(q, k_cache, v_cache, seqs, scale, window=None):
    """Dense reference computed after the cache write (paged_attention writes first)."""
    outs, row = [], 0
    bs = k_cache.shape[1]
    for L, n, table in seqs:
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
        kc = k_cache.view(-1, *k_cache.shape[2:])[slots]
        vc = v_cache.view(-1, *v_cache.shape[2:])[slots]
        outs.append(reference(q[row:row + n], kc, vc, scale, window))
        row += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("prefill", [[(9, 9), (21, 6)], []], ids=["mixed", "decode-only"])
def test_paged_attention_matches_dense_reference(decode_path, dtype, tol, hq, hk, prefill):
    q, k, v, kc, vc, meta, seqs = make_case(dtype, hq, hk, lens=[1, 5, 17, 33], prefill=prefill)
    scale = 0.25
    out = paged_attention(q, k, v, KVCache(kc, vc), meta, scale)
    ref = expected(q, kc, vc, seqs, scale)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("hq,hk,d,lens", [
    (9, 3, 64, [150]),                 # SmolLM2, batch 1: one work item per KV head
    (9, 3, 64, [3, 40, 77, 130, 9]),   # batched: one work item per sequence
    (14, 2, 64, [1, 600]),             # Qwen2.5-0.5B's grouping, a context past TOKENS_PER_TASK
    (32, 8, 128, [5, 31, 18, 2, 64]),  # more query vectors than the vector path holds: scalar path
    (4, 2, 24, [7, 19]),               # head_dim not a multiple of 16: scalar path
])
def test_decode_kernel_shapes_match_dense_reference(dtype, tol, hq, hk, d, lens):
    """The kernel's vector and scalar paths and both ways of cutting the work."""
    if paged_decode_kernels() is None:
        pytest.fail("the C++ decode kernel did not compile")
    q, k, v, kc, vc, meta, seqs = make_case(dtype, hq, hk, lens=lens, bs=16, d=d)
    out = paged_attention(q, k, v, KVCache(kc, vc), meta, d ** -0.5)
    torch.testing.assert_close(out.double(), expected(q, kc, vc, seqs, d ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 5, 8, 40])
def test_sliding_window_matches_dense_reference(decode_path, window):
    """Decode rows and prefill spans (whole and chunked) attend to the last `window` keys only;
    keys before the window hold values that must not count."""
    q, k, v, kc, vc, meta, seqs = make_case(torch.float32, 6, 2, lens=[1, 5, 17, 33], prefill=[(9, 9), (21, 6)],
                                            window=window)
    out = paged_attention(q, k, v, KVCache(kc, vc), meta, 0.25)
    torch.testing.assert_close(out.double(), expected(q, kc, vc, seqs, 0.25, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,rel,floor", [(torch.int8, 0, 0.5), (torch.float8_e4m3fn, 2 ** -4, 2 ** -10),
                                             (torch.float8_e5m2, 2 ** -3, 2 ** -17)])
def test_kv_quantization_error_bound(dtype, rel, floor):
    """Half a step of the format: int8 rounds to scale / 2; fp8 keeps 3 (e4m3) or 2 (e5m2)
    mantissa bits (relative error 2^-4 / 2^-3) down to its subnormals (half the smallest one)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-2, 2, 4)[None, :, None]   # heads of very different ranges
    x[..., 70] *= 50                                 # an outlier dimension: only its group's scale grows
    codes, scale = quantize(x, dtype)
    assert codes.dtype == dtype and scale.shape == (64, 4, 2)      # one scale per 64 values
    torch.testing.assert_close(scale, x.view(64, 4, 2, 64).abs().amax(-1) / QMAX[dtype])
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    bound = (rel * x.abs() + floor * scale.repeat_interleave(64, -1)) * (1 + 1e-5)
    assert (err <= bound).all()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("window, d", [(None, 16), (8, 16), (None, 128)])
def test_quantized_cache_matches_dense_reference_on_its_dequantized_values(decode_path, dtype, window, d):
    """Written rows are quantized, and every path reads exactly the dequantized codes; a prefill
    of a whole prompt attends with its fresh (unquantized) K/V, as vLLM's does. d = 128: two
    scales per row."""
    q, k, v, kc, vc, meta, seqs = make_case(torch.float32, 6, 2, lens=[1, 5, 17, 33], prefill=[(9, 9), (21, 6)],
                                            window=window, d=d)
    (ck, sk), (cv, sv) = quantize(kc, dtype), quantize(vc, dtype)
    cache = KVCache(ck, cv, sk, sv)
    out = paged_attention(q, k, v, cache, meta, 0.25)
    kd, vd = dequantize(ck, sk, torch.float32), dequantize(cv, sv, torch.float32)
    # the new rows were quantized on write
    rows = kd.view(-1, 2, d)[meta.slot_mapping]
    torch.testing.assert_close(rows, dequantize(*quantize(k, dtype), torch.float32))
    for span in meta.prefills:
        if span.block_table is None:
            fresh = meta.slot_mapping[span.start:span.end]
            kd.view(-1, 2, d)[fresh] = k[span.start:span.end]
            vd.view(-1, 2, d)[fresh] = v[span.start:span.end]
    torch.testing.assert_close(out.double(), expected(q, kd, vd, seqs, 0.25, window), atol=1e-5, rtol=1e-5)


def test_bf16_cache_under_an_fp32_model(decode_path):
    """--kv-cache-dtype bfloat16 with fp32 queries: every path reads the rounded bf16 values."""
    q, k, v, kc, vc, meta, seqs = make_case(torch.float32, 6, 2, lens=[1, 5, 17, 33], prefill=[(21, 6)])
    kb, vb = kc.bfloat16(), vc.bfloat16()
    out = paged_attention(q, k, v, KVCache(kb, vb), meta, 0.25)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected(q, kb.float(), vb.float(), seqs, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("d", [16, 128])
def test_fused_quantized_write_is_the_torch_write_bit_for_bit(dtype, d):
    from tokenmill.model.cpu_kernels import fused_layer_kernels
    from tokenmill.quant.kv_cache import write_quantized
    ops = fused_layer_kernels()
    if ops is None:
        pytest.fail("the fused kernels did not compile")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(7, 3, 2, d, generator=g)[:, :, 0] * 5      # a strided view, as the qkv split gives
    v = torch.randn(7, 3, d, generator=g) * torch.logspace(-3, 3, 3)[None, :, None]
    v[2] = 0                                                     # an all-zero row: the 1e-12 floor
    slots = torch.tensor([0, 5, 6, 9, 17, 30, 31])
    caches = []
    for fused in (ops, None):
        groups = d // 64 if d % 64 == 0 else 1
        cache = KVCache(torch.zeros(8, 4, 3, d, dtype=dtype), torch.zeros(8, 4, 3, d, dtype=dtype),
                        torch.ones(8, 4, 3, groups), torch.ones(8, 4, 3, groups))
        write_quantized(k, v, cache, slots, fused)
        caches.append(cache)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b)
