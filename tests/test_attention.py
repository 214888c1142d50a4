"""Paged attention paths (C++ decode kernel, torch fallback, prefill spans) vs a dense fp64 reference."""
import pytest
import torch

from tokenmill.model import attention
from tokenmill.model.attention import AttentionMetadata, PrefillSpan, paged_attention
from tokenmill.model.cpu_kernels import paged_decode_kernels


def reference(q, k_ctx, v_ctx, scale):
    """q: [n, Hq, D] at the last n positions of k_ctx/v_ctx [L, Hk, D]."""
    n, hq, _ = q.shape
    L, hk, _ = k_ctx.shape
    k = k_ctx.double().repeat_interleave(hq // hk, dim=1)
    v = v_ctx.double().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    pos = torch.arange(L - n, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def make_case(dtype, hq, hk, lens, prefill=(), bs=4, d=16, seed=0):
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
        spans.append(PrefillSpan(start, start + n, L, None if n == L else torch.tensor(table)))
        start += n
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=nd,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t in seqs[:nd]], dtype=torch.int32) if nd else None,
        decode_context_lens=torch.tensor(lens, dtype=torch.int32) if nd else None,
        prefills=spans)
    return q, k, v, k_cache, v_cache, meta, seqs


def expected(q, k_cache, v_cache, seqs, scale):
    """Dense reference computed after the cache write (paged_attention writes first)."""
    outs, row = [], 0
    bs = k_cache.shape[1]
    for L, n, table in seqs:
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
        kc = k_cache.view(-1, *k_cache.shape[2:])[slots]
        vc = v_cache.view(-1, *v_cache.shape[2:])[slots]
        outs.append(reference(q[row:row + n], kc, vc, scale))
        row += n
    return torch.cat(outs)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("prefill", [[(9, 9), (21, 6)], []], ids=["mixed", "decode-only"])
def test_paged_attention_matches_dense_reference(monkeypatch, use_kernel, dtype, tol, hq, hk, prefill):
    if use_kernel and paged_decode_kernels() is None:
        pytest.fail("the C++ decode kernel did not compile")
    if not use_kernel:
        monkeypatch.setattr(attention, "paged_decode_kernels", lambda: None)
    q, k, v, kc, vc, meta, seqs = make_case(dtype, hq, hk, lens=[1, 5, 17, 33], prefill=prefill)
    scale = 0.25
    out = paged_attention(q, k, v, kc, vc, meta, scale)
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
    out = paged_attention(q, k, v, kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(out.double(), expected(q, kc, vc, seqs, d ** -0.5), atol=tol, rtol=tol)
