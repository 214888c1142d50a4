"""Calibrated quantization (GPTQ / AWQ / SmoothQuant), quantized checkpoints and `tokenmill quantize`
on tiny random models: save -> load is bit-exact, scale folding keeps the float function,
calibration beats round-to-nearest, AutoGPTQ-layout files load through LLM."""
import json
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model_dir
from tokenmill.config import EngineConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model.llama import hf_module_sources, hf_row_sizes
from tokenmill.model.loader import checkpoint_quant_config, load_model_weights
from tokenmill.quant import formats
from tokenmill.quant.apply import quantize_model
from tokenmill.quant.calibrate import CALIBRATED_METHODS, prefill_metadata, quantize_calibrated
from tokenmill.quant.kv_cache import KVCache
from tokenmill.quant.checkpoint import save_quantized
from tokenmill.quant.config import QuantConfig
from tokenmill.quant.group import rtn_quantize
from tokenmill.quantize import load_float_model

GS = 32          # tiny model: hidden 64, intermediate 128


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qckpt")
    return {arch: Path(save_tiny_model_dir(root / arch, arch=arch)) for arch in ("llama", "qwen2")}


def _seqs(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=g).tolist() for _ in range(n)]


CALIB = _seqs(8, 48, 1)
HELD_OUT = _seqs(4, 32, 2)


def logits(model, ids):
    cfg = model.cfg
    shape = (1, len(ids), cfg.num_kv_heads, cfg.head_dim)
    kv = [KVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    meta = prefill_metadata([len(ids)])
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv, [meta] * cfg.num_layers))


def quantized(src, qcfg):
    model, cfg, hf = load_float_model(src)
    if qcfg.method in CALIBRATED_METHODS:
        quantize_calibrated(model, CALIB, qcfg, progress=False)
    else:
        quantize_model(model, qcfg)
    return model, cfg, hf


def load_dir(path):
    mc, w = load_model_weights(path, torch.float32)
    runner = ModelRunner(EngineConfig(kv_cache_memory=1 << 20), mc, w, torch.device("cpu"), torch.float32, 512,
                         checkpoint_quant=checkpoint_quant_config(path))
    return runner.model


@pytest.mark.parametrize("arch,qcfg", [
    ("llama", QuantConfig("gptq", group_size=GS)),
    ("qwen2", QuantConfig("gptq", group_size=GS, act_order=True)),
    ("llama", QuantConfig("awq", group_size=GS)),
    ("llama", QuantConfig("smoothquant", quantize_lm_head=True)),
    ("qwen2", QuantConfig("int8")),
    ("llama", QuantConfig("rtn4", group_size=GS)),
    ("llama", QuantConfig("nf4", block_size=32)),
], ids=lambda v: v if isinstance(v, str) else v.method + ("-act" if v.act_order else ""))
def test_save_load_is_bit_identical(tiny_dirs, tmp_path, arch, qcfg):
    model, cfg, hf = quantized(tiny_dirs[arch], qcfg)
    out = save_quantized(model, qcfg, hf, tmp_path / "q", hf_module_sources, lambda n: hf_row_sizes(cfg, n))
    written = json.loads((out / "config.json").read_text())
    assert written["quantization_config"] == qcfg.to_hf()
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)      # HF (un-fused) names
    if qcfg.method == "gptq":
        assert {"model.layers.0.self_attn.k_proj." + k for k in ("qweight", "qzeros", "scales", "g_idx")} <= names
    if qcfg.method == "awq":
        assert "model.layers.1.mlp.up_proj.qzeros" in names and "model.layers.1.mlp.up_proj.g_idx" not in names
    loaded = load_dir(out)
    assert type(loaded.layers[0].self_attn.qkv_proj) is type(model.layers[0].self_attn.qkv_proj)
    assert type(loaded.lm_head) is type(model.lm_head)
    for ids in HELD_OUT[:2]:
        assert torch.equal(logits(loaded, ids), logits(model, ids))


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_scale_folding_keeps_the_float_function(tiny_dirs, method):
    model, _, _ = load_float_model(tiny_dirs["llama"])
    refs = [logits(model, ids) for ids in HELD_OUT]
    norms = [layer.input_layernorm.weight.clone() for layer in model.layers]
    quantize_calibrated(model, CALIB, QuantConfig(method, group_size=GS), progress=False, fold_only=True)
    assert not torch.equal(model.layers[0].input_layernorm.weight, norms[0])       # something was folded
    assert isinstance(model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
    for ids, ref in zip(HELD_OUT, refs):
        got = logits(model, ids)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4


def test_gptq_and_awq_beat_rtn(tiny_dirs, tmp_path):
    """On a tiny model with a few large-activation channels (as real LLMs have: scaled RMSNorm
    weights), where activation-aware methods have something to find."""
    from safetensors.torch import load_file, save_file
    src = tmp_path / "outliers"
    src.mkdir()
    for f in tiny_dirs["llama"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[::16] *= 12.0
    save_file(tensors, str(src / "model.safetensors"))
    float_model, _, _ = load_float_model(src)
    refs = [logits(float_model, ids) for ids in HELD_OUT]

    def err(method):
        model, _, _ = quantized(src, QuantConfig(method, group_size=GS))
        return sum(((logits(model, ids) - ref).norm() / ref.norm()).item() for ids, ref in zip(HELD_OUT, refs))

    rtn, gptq, awq = err("rtn4"), err("gptq"), err("awq")
    print(f"held-out relative logit error: rtn4 {rtn:.4f} gptq {gptq:.4f} awq {awq:.4f}")
    assert gptq < 0.9 * rtn and awq < 0.9 * rtn


def test_autogptq_layout_checkpoint_loads_through_llm(tiny_dirs, tmp_path, monkeypatch):
    """A checkpoint written projection by projection with pack_gptq (as AutoGPTQ lays it out)
    loads through LLM(model=DIR) and computes what its dequantized weights compute."""
    from safetensors.torch import load_file, save_file
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    src = tiny_dirs["llama"]
    tensors = load_file(str(src / "model.safetensors"))
    ref_model, _, hf = load_float_model(src)
    out = tmp_path / "autogptq"
    out.mkdir()
    dequant = {}
    for name in list(tensors):
        proj = name.removesuffix(".weight")
        if ".layers." in name and name.endswith("_proj.weight"):
            gq = rtn_quantize(tensors.pop(name).float(), 4, GS)
            dequant[name] = gq.dequantize()
            tensors.update({f"{proj}.{k}": v for k, v in formats.pack_gptq(gq).items()})
    save_file(tensors, str(out / "model.safetensors"))
    hf = dict(hf, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": GS, "desc_act": False,
                                       "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(hf))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    # the reference: the float model with the dequantized weights (scales rounded to fp16, as stored)
    ref_tensors = load_file(str(src / "model.safetensors"))
    for name in dequant:
        unpacked = formats.unpack_gptq(tensors[name.replace(".weight", ".qweight")],
                                       tensors[name.replace(".weight", ".qzeros")],
                                       tensors[name.replace(".weight", ".scales")],
                                       tensors[name.replace(".weight", ".g_idx")], 4, GS)
        ref_tensors[name] = unpacked.dequantize()
    ref_model.load_hf_state_dict(ref_tensors)

    from tokenmill.quant import kernels
    monkeypatch.setattr(kernels, "_OVERRIDE", 0)     # fp32 dequant path: comparable to 1e-4
    llm = LLM(model=str(out), dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=1 << 20)
    model = llm.engine.runner.model
    assert llm.engine.runner.quant.method == "gptq"
    assert type(model.layers[0].mlp.gate_up_proj).__name__ == "Int4Linear"
    for ids in HELD_OUT[:2]:
        torch.testing.assert_close(logits(model, ids), logits(ref_model, ids), rtol=1e-4, atol=1e-4)
    res = llm.generate([{"prompt_token_ids": HELD_OUT[0][:8]}], SamplingParams(max_tokens=4, temperature=0.0),
                       use_tqdm=False)
    ref_next = int(logits(ref_model, HELD_OUT[0][:8])[-1].argmax())
    assert res[0].outputs[0].token_ids[0] == ref_next


def test_cli_quantize_end_to_end(tiny_dirs, tmp_path):
    from tokenmill.cli import main
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(["hello world, the quick brown fox jumps over the lazy dog. " * 3,
                                 "the lazy dog sleeps; the quick fox jumps again and again.",
                                 "你好世界 hello world the fox " * 4]))
    out = tmp_path / "cli-gptq"
    main(["quantize", str(tiny_dirs["llama"]), "--method", "gptq", "--group-size", str(GS), "--act-order",
          "--calib", f"text:{text}", "--calib-max-len", "64", "--out", str(out)])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["desc_act"] is True
    llm = LLM(model=str(out), dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=1 << 20)
    res = llm.generate("hello world", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(res[0].outputs[0].token_ids) == 5
