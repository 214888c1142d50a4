"""AutoGPTQ / AutoAWQ int32 packings: exact round trips and agreement with a naive unpacker."""
import pytest
import torch

from tokenmill.quant.formats import pack_awq, pack_gptq, unpack_awq, unpack_gptq
from tokenmill.quant.group import GroupQuant, rtn_quantize


def _gq(n: int, k: int, gs: int, seed: int = 0, shuffle_g_idx: bool = False) -> GroupQuant:
    g = torch.Generator().manual_seed(seed)
    gq = rtn_quantize(torch.randn(n, k, generator=g), 4, gs)
    gq.zeros = torch.randint(1, 16, gq.zeros.shape, generator=g).float()   # v1 cannot hold zero 0
    if shuffle_g_idx:                                   # act-order style grouping
        gq.g_idx = gq.g_idx[torch.randperm(k, generator=g)].contiguous()
    return gq


def _same(a: GroupQuant, b: GroupQuant) -> None:
    assert torch.equal(a.q, b.q) and torch.equal(a.zeros, b.zeros) and torch.equal(a.g_idx, b.g_idx)
    assert torch.equal(b.scales, a.scales.half().float())
    assert (a.bits, a.group_size) == (b.bits, b.group_size)


@pytest.mark.parametrize("k,gs,shuffle", [(576, 128, False), (576, 128, True), (256, 64, False)])
def test_gptq_round_trip(k, gs, shuffle):
    gq = _gq(48, k, gs, shuffle_g_idx=shuffle)
    d = pack_gptq(gq)
    assert d["qweight"].shape == (k // 8, 48) and d["qweight"].dtype == torch.int32
    assert d["qzeros"].shape == (gq.scales.shape[1], 6) and d["scales"].dtype == torch.float16
    _same(gq, unpack_gptq(d["qweight"], d["qzeros"], d["scales"], d["g_idx"], 4, gs))


@pytest.mark.parametrize("k,gs", [(576, 128), (256, 64)])
def test_awq_round_trip(k, gs):
    gq = _gq(48, k, gs, seed=1)
    d = pack_awq(gq)
    assert d["qweight"].shape == (k, 6) and d["qzeros"].shape == (gq.scales.shape[1], 6)
    _same(gq, unpack_awq(d["qweight"], d["qzeros"], d["scales"], gs))


def test_gptq_refuses_zero_point_zero():
    gq = _gq(8, 64, 32)
    gq.zeros[0, 0] = 0
    with pytest.raises(ValueError):
        pack_gptq(gq)


def _nibble(word: int, i: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * i)) & 0xF


def test_gptq_matches_naive_unpacker():
    g = torch.Generator().manual_seed(3)
    n, k, gs = 16, 32, 16
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // gs, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(k // gs, n, generator=g).half()
    gq = unpack_gptq(qweight, qzeros, scales, None, 4, gs)
    for i in range(k // 8):
        for c in range(n):
            for j in range(8):
                assert gq.q[c, 8 * i + j] == _nibble(int(qweight[i, c]), j)
    for grp in range(k // gs):
        for wi in range(n // 8):
            for j in range(8):
                assert gq.zeros[8 * wi + j, grp] == _nibble(int(qzeros[grp, wi]), j) + 1
    assert torch.equal(gq.g_idx.long(), torch.arange(k) // gs)


def test_awq_matches_naive_unpacker():
    g = torch.Generator().manual_seed(4)
    n, k, gs = 16, 32, 16
    order = [0, 2, 4, 6, 1, 3, 5, 7]          # AutoAWQ: nibble slot i holds column 8w + order[i]
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // gs, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(k // gs, n, generator=g).half()
    gq = unpack_awq(qweight, qzeros, scales, gs)
    for r in range(k):
        for wi in range(n // 8):
            for slot in range(8):
                assert gq.q[8 * wi + order[slot], r] == _nibble(int(qweight[r, wi]), slot)
    for grp in range(k // gs):
        for wi in range(n // 8):
            for slot in range(8):
                assert gq.zeros[8 * wi + order[slot], grp] == _nibble(int(qzeros[grp, wi]), slot)
    assert torch.equal(gq.scales, scales.float().t())
