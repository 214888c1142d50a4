"""int8 / rtn4 / nf4 linears: error bounds, the small-M vs large-M path switch, load-time
quantization of a whole model, and QuantConfig's HF round trip."""
import pytest
import torch

from tests.tiny_models import tiny_hf_model
from tokenmill.quant.apply import quantize_model, weight_bytes
from tokenmill.quant.config import QuantConfig
from tokenmill.quant.group import rtn_quantize
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.nf4 import NF4Linear
from tokenmill.quant import kernels


def test_rtn4_error_within_half_step():
    w = torch.randn(48, 576)
    gq = rtn_quantize(w, 4, 128)             # 128 does not divide 576: last group is partial
    assert gq.scales.shape == (48, 5)
    step = gq.scales[:, gq.g_idx.long()]
    assert ((gq.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_int8_error_within_half_step():
    w = torch.randn(32, 200)
    lin = Int8Linear.from_float(w, None)
    assert ((lin.dequantize() - w).abs() <= lin.scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("k,group", [(576, 128), (576, 64), (256, 32)])
def test_int4_paths_agree(k, group, monkeypatch):
    torch.manual_seed(0)
    lin = Int4Linear(rtn_quantize(torch.randn(48, k), 4, group), torch.randn(48))
    assert lin.packed is not None or lin.int_dot is not None
    # 576 with group 128: the kernel runs at group 64 on the unpadded K (no per-call padding)
    assert (lin.kernel_group, lin.kernel_k) == ((64, 576) if (k, group) == (576, 128) else (group, k))
    x = torch.randn(8, k)
    reference = x @ lin.dequantize().T + lin.bias
    monkeypatch.setattr(kernels, "_OVERRIDE", 1000)
    small = lin(x)                          # int-dot or packed int4 kernel (int8 / bf16 activations)
    monkeypatch.setattr(kernels, "_OVERRIDE", 0)
    large = lin(x)                          # dequantize + GEMM
    scale = reference.abs().max()
    assert (large - reference).abs().max() / scale < 1e-5
    assert (small - reference).abs().max() / scale < 2e-2


@pytest.mark.parametrize("smooth", [False, True])
def test_int8_paths_agree(smooth, monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(64, 576)
    inv = torch.rand(576) + 0.5 if smooth else None
    lin = Int8Linear.from_float(w, torch.randn(64), smooth_inv=inv)
    x = torch.randn(8, 576)
    monkeypatch.setattr(kernels, "_OVERRIDE", 1000)
    small = lin(x)
    monkeypatch.setattr(kernels, "_OVERRIDE", 0)
    large = lin(x)
    xs = x if inv is None else x * inv
    reference = xs @ w.T + lin.bias
    scale = reference.abs().max()
    assert (small - large).abs().max() / scale < 2e-2
    assert (large - reference).abs().max() / scale < 3e-2


def _tiled_available() -> bool:
    from tokenmill.quant.tiled import tiled_kernels
    has_avx2 = " avx2" in open("/proc/cpuinfo").read() and " fma" in open("/proc/cpuinfo").read()
    assert tiled_kernels() is not None or not has_avx2, "tiled kernel failed to build on an AVX2 host"
    return tiled_kernels() is not None


@pytest.mark.parametrize("n,k,group,act_order", [(960, 576, 64, False), (50, 576, 128, True),
                                                  (576, 1536, 32, False), (40, 64, -1, False)])
def test_int4_tiled_matches_whole_weight_dequant(n, k, group, act_order, monkeypatch):
    """Large-M path: the tiled C++ dequantize+GEMM against dequantize-everything + F.linear,
    with padding (576 with group 128), act-order permutation and N not a multiple of the tile."""
    from tokenmill.quant import tiled
    from tokenmill.quant.gptq import gptq_quantize
    if not _tiled_available():
        pytest.skip("no tiled kernel on this CPU")
    torch.manual_seed(2)
    w = torch.randn(n, k)
    x = torch.randn(300, k)
    if act_order:
        gq = gptq_quantize(w, x.T @ x / 300 + torch.diag(torch.rand(k)), 4, group, act_order=True)
        assert not torch.equal(gq.g_idx, torch.sort(gq.g_idx).values)
    else:
        gq = rtn_quantize(w, 4, k if group == -1 else group)
    lin = Int4Linear(gq, torch.randn(n))
    monkeypatch.setattr(kernels, "_OVERRIDE", 0)
    got = lin(x[:40])
    monkeypatch.setattr(tiled, "_ENABLED", False)
    ref = lin(x[:40])
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


@pytest.mark.parametrize("smooth", [False, True])
def test_int8_tiled_matches_whole_weight_dequant(smooth, monkeypatch):
    from tokenmill.quant import tiled
    if not _tiled_available():
        pytest.skip("no tiled kernel on this CPU")
    torch.manual_seed(3)
    w = torch.randn(200, 576)
    lin = Int8Linear.from_float(w, torch.randn(200), smooth_inv=torch.rand(576) + 0.5 if smooth else None)
    x = torch.randn(33, 576)
    monkeypatch.setattr(kernels, "_OVERRIDE", 0)
    got = lin(x)
    monkeypatch.setattr(tiled, "_ENABLED", False)
    ref = lin(x)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


@pytest.mark.parametrize("rows", [12, 48])            # tile by tile; the whole weight at once
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,group", [(1536, 64), (576, 128)])   # 576 in groups of 128: K padded to 640
def test_tiled_bf16_tiles_match_the_rounded_weight(bits, rows, k, group, monkeypatch):
    """bf16 activations on a CPU with native bf16 dot products: tiles are decoded straight to
    bf16 (round to nearest even, as torch casts) and multiplied in bf16; against the dequantized
    weight cast by torch, in fp32 (elsewhere both run in fp32, and this checks that path)."""
    from tokenmill.quant import tiled
    if not _tiled_available():
        pytest.skip("no tiled kernel on this CPU")
    torch.manual_seed(5)
    w = torch.randn(1000, k) * 0.05
    lin = Int4Linear(rtn_quantize(w, 4, group), None) if bits == 4 else Int8Linear.from_float(w, None)
    x = torch.randn(rows, k).bfloat16()
    monkeypatch.setattr(kernels, "_OVERRIDE", 0)
    got = lin(x)
    monkeypatch.setattr(tiled, "_ENABLED", False)
    ref_w = lin(torch.eye(k)).T                       # the dequantized weight, fp32 [N, K]
    if kernels.cpu_has_fast_bf16_dot():
        ref_w = ref_w.bfloat16().float()
    ref = x.float() @ ref_w.T
    assert got.dtype == torch.bfloat16
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert ((got.float() - ref).abs().mean() / ref.abs().mean()).item() < 2.5e-3   # truncating: ~4e-3


def test_tiled_kernel_inside_inference_mode():
    """The runner calls linears under torch.inference_mode; the kernel's worker threads write the
    output in place and must inherit that mode (they did not: every tile off the caller's thread
    raised 'Inplace update to inference tensor outside InferenceMode')."""
    from tokenmill.quant import tiled
    if not _tiled_available():
        pytest.skip("no tiled kernel on this CPU")
    torch.manual_seed(4)
    k, n = 1536, 2048                                  # several 384 KiB tiles, so both threads work
    lin = Int4Linear(rtn_quantize(torch.randn(n, k), 4, 64), None)
    x = torch.randn(64, k)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = lin(x)
        with torch.inference_mode():
            got = lin(x)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["int8", "rtn4", "nf4"])
def test_quantized_tiny_model_logits_near_float(method):
    from tests.test_model_runner import make_runner
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.sequence import Sequence

    hf = tiny_hf_model("llama")
    runner, bm = make_runner(hf)
    float_bytes = weight_bytes(runner.model)
    seq = Sequence("0", list(range(3, 40)), SamplingParams(max_tokens=1))
    assert bm.admit(seq, [], 0) and bm.grow(seq, seq.num_tokens)
    ref = runner.execute([(seq, seq.num_tokens)])
    quantize_model(runner.model, QuantConfig(method, group_size=32, block_size=64))
    assert weight_bytes(runner.model) < float_bytes
    assert weight_bytes(runner.model, as_float=torch.float32) == float_bytes   # the start-up log's "float" size
    got = runner.execute([(seq, seq.num_tokens)])
    rel = (got - ref).norm() / ref.norm()
    assert rel < {"int8": 0.02, "rtn4": 0.25, "nf4": 0.25}[method], rel


def test_quant_config_hf_round_trip():
    for cfg in (QuantConfig("gptq", group_size=64, act_order=True), QuantConfig("awq", group_size=128),
                QuantConfig("nf4", double_quant=False), QuantConfig("smoothquant", alpha=0.6)):
        back = QuantConfig.from_hf(cfg.to_hf())
        assert (back.method, back.group_size, back.bits) == (cfg.method, cfg.group_size, cfg.bits)
    with pytest.raises(ValueError, match="group_size"):
        QuantConfig("rtn4", group_size=100)
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantConfig("fp3")


@pytest.mark.parametrize("bits", [4, 8])
def test_tiled_bf16_tiles_match_fp32_tiles(bits):
    """bf16 activations with bf16 tiles (the path CPUs with bf16 dot products take) give the
    fp32-tile result to bf16 precision, bias included, and return bf16."""
    from tokenmill.quant import tiled
    if not _tiled_available():
        pytest.skip("no tiled kernel on this CPU")
    torch.manual_seed(5)
    n, k, g = 300, 576, 64 if bits == 4 else 576
    gq = rtn_quantize(torch.randn(n, k), bits, g) if bits == 4 else None
    if bits == 4:
        codes = Int4Linear(gq, None)
        args = (codes.q4, codes.scales, codes.offsets)
    else:
        lin = Int8Linear.from_float(torch.randn(n, k), None)
        args = (lin.qweight, lin.scale, None)
    x, bias = torch.randn(40, k).bfloat16(), torch.randn(n)
    ext = tiled.tiled_kernels()
    fp32 = ext.tiled_dequant_linear(x, *args, bias, bits, g, False)
    bf16 = ext.tiled_dequant_linear(x, *args, bias, bits, g, True)
    assert fp32.dtype == bf16.dtype == torch.bfloat16
    err = (bf16.float() - fp32.float()).abs().max() / fp32.float().abs().max()
    assert 0 < err < 2e-2


@pytest.mark.parametrize("fmt,rows,k,group", [("int4", 33, 576, 128), ("int4", 100, 1536, 64), ("int4", 16, 576, 32),
                                              ("int8", 48, 576, None), ("int8", 70, 1536, None),
                                              ("nf4", 45, 576, 64)])
def test_tiled_amx_strips_match_the_rounded_weight(fmt, rows, k, group):
    """The tiled path's AMX kernel (CPUs with AMX-BF16, bf16 x: strips of 32 columns decoded to bf16
    in the tile layout): against x @ (the dequantized weight rounded to bf16) in fp32, + bias, with
    a partial last block of rows (33, 100, 16, 70, 45 rows) and K padded to the group (576 in 128s)."""
    from tokenmill.quant import tiled
    ext = tiled.tiled_kernels() if _tiled_available() else None
    if ext is None or not hasattr(ext, "amx_min_rows"):
        pytest.skip("built without the AMX-BF16 tiled kernel")
    torch.manual_seed(6)
    n = 96
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
    if fmt == "int4":
        lin = Int4Linear(rtn_quantize(w, 4, group), None)
        call = lambda x: ext.tiled_dequant_linear(x, lin.q4, lin.scales, lin.offsets, bias, 4, group, True)  # noqa: E731
    elif fmt == "int8":
        lin = Int8Linear.from_float(w, None)
        call = lambda x: ext.tiled_dequant_linear(x, lin.qweight, lin.scale, None, bias, 8, k, True)  # noqa: E731
    else:
        lin = NF4Linear.from_float(w, None)
        call = lambda x: ext.tiled_nf4_linear(x, lin.codes, lin._absmax(), lin.table, bias, 64, True)  # noqa: E731
    ref_w = lin.dequantize()
    x = torch.randn(rows, k).bfloat16()
    ref = x.float() @ ref_w.bfloat16().float().T + bias
    default = ext.amx_min_rows()
    try:
        ext.set_amx_min_rows(1)
        got = call(x)
        ext.set_amx_min_rows(10 ** 9)
        whole = call(x)                      # the same path without the AMX kernel
    finally:
        ext.set_amx_min_rows(default)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    scale = ref.abs().max()
    assert ((got.float() - ref).abs().max() / scale).item() < 1e-2        # one bf16 output rounding
    assert ((got.float() - ref).abs().mean() / ref.abs().mean()).item() < 2.5e-3
    assert ((got.float() - whole.float()).abs().max() / scale).item() < 1e-2
