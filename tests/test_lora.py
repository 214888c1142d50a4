"""Multi-LoRA on tiny random models: PEFT's own merge is the reference (peft is a test
dependency only), mixed batches against requests run alone, prefix-cache isolation, the
adapter checks, and LoRALinear over quantized bases."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model_dir
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.lora.adapter import load_adapter
from tokenmill.lora.layers import LoRABatch, LoRALinear
from tokenmill.lora.peft_format import random_adapter
from tokenmill.model.layers import Linear
from tokenmill.model.loader import read_model_config
from tokenmill.quant.group import rtn_quantize
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear

PROMPTS = ["hello world", "the quick brown fox jumps over", "lazy dog", "你好世界 hello the quick"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return Path(save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, Path]:
    """Three adapters that differ in rank, targets and scaling."""
    cfg, root = read_model_config(tiny), tmp_path_factory.mktemp("adapters")
    return {
        "all8": random_adapter(root / "all8", cfg, 8, seed=1, std=0.5),
        "qv4": random_adapter(root / "qv4", cfg, 4, targets=("q_proj", "v_proj"), seed=2, std=1.0),
        "mlp16rs": random_adapter(root / "mlp16rs", cfg, 16, targets=("gate_proj", "up_proj", "down_proj"),
                                  seed=3, std=0.3, use_rslora=True, alpha=8),
    }


def tiny_llm(model: Path, **kw) -> LLM:
    kw = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 16 << 20, "enable_lora": True} | kw
    return LLM(str(model), **kw)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def peft_merged_greedy(model_dir: Path, adapter: Path, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    import peft
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(hf, str(adapter)).merge_and_unload().eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            g = merged.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            out.append(g[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("name", ["all8", "qv4", "mlp16rs"])
def test_adapter_output_equals_peft_merged_weights(tiny, adapters, name):
    llm = tiny_llm(tiny)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 1, str(adapters[name])))
    ref = peft_merged_greedy(tiny, adapters[name], [o.prompt_token_ids for o in outs], GREEDY.max_tokens)
    assert tokens(outs) == ref
    base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(base) != tokens(outs)          # the adapter changes the output


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_gives_each_request_its_alone_tokens(tiny, adapters, max_loras):
    """3 adapters + base in one generate call (4 prompts each) == each request alone; with
    max_loras=2 the scheduler keeps at most 2 adapters per step."""
    llm = tiny_llm(tiny, max_loras=max_loras, max_num_seqs=16)
    requests = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    prompts = [p for p in PROMPTS for _ in requests]
    loras = [r for _ in PROMPTS for r in requests]
    seen: list[int] = []
    prepare = llm.engine.lora.prepare
    def spy(runs):
        seen.append(len({id(a) for a, _, _ in runs if a is not None}))
        return prepare(runs)
    llm.engine.lora.prepare = spy
    mixed = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert max(seen) == min(max_loras, 3)
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False, lora_request=r))[0] for p, r in zip(prompts, loras)]
    assert mixed == alone
    assert len({tuple(t) for t in mixed[:4]}) == 4      # base and the three adapters all differ


def test_adapters_never_share_prefix_cache_blocks(tiny, adapters, tmp_path):
    llm = tiny_llm(tiny)
    prompt = list(range(3, 3 + 100))                    # 6 full 16-token blocks
    one = LoRARequest("a", 1, str(adapters["all8"]))
    two = LoRARequest("b", 2, str(adapters["qv4"]))
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=one)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=one)[0]
    other = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=two)[0]
    base = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 96
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_rewritten_adapter_does_not_hit_its_old_blocks(tiny, tmp_path):
    cfg = read_model_config(tiny)
    path = random_adapter(tmp_path / "a", cfg, 8, seed=5, std=0.5)
    llm = tiny_llm(tiny)
    prompt = [{"prompt_token_ids": list(range(3, 103))}]
    req = LoRARequest("a", 1, str(path))
    old = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=req)[0]
    random_adapter(path, cfg, 8, seed=6, std=0.5)         # same name and path, new weights
    new = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=req)[0]
    assert new.num_cached_tokens == 0
    fresh = tiny_llm(tiny).generate(prompt, GREEDY, use_tqdm=False, lora_request=req)[0]
    assert new.outputs[0].token_ids == fresh.outputs[0].token_ids != old.outputs[0].token_ids


def test_lora_on_int8_base_mixes_like_alone(tiny, adapters):
    llm = tiny_llm(tiny, quantization="int8")
    reqs = [LoRARequest("all8", 1, str(adapters["all8"])), None]
    prompts = PROMPTS[:2] * 2
    loras = [reqs[0], reqs[0], reqs[1], reqs[1]]
    mixed = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False, lora_request=r))[0] for p, r in zip(prompts, loras)]
    assert mixed == alone and mixed[0] != mixed[2]


@pytest.mark.parametrize("kind", ["float", "int8", "int4"])
def test_lora_linear_adds_each_runs_delta_to_its_slices(kind, tiny, adapters):
    """Rows of two adapters and base rows through one fused qkv layer == base + scaling * B A x
    per slice, computed densely."""
    torch.manual_seed(0)
    cfg = read_model_config(tiny)
    out_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    w = torch.randn(sum(out_sizes), cfg.hidden_size)
    base = {"float": lambda: Linear(cfg.hidden_size, sum(out_sizes), bias=False),
            "int8": lambda: Int8Linear.from_float(w, None),
            "int4": lambda: Int4Linear(rtn_quantize(w, 4, 32), None)}[kind]()
    if kind == "float":
        base.weight.data.copy_(w)
    batch = LoRABatch()
    layer = LoRALinear(base, out_sizes, 2, batch)
    name = "layers.1.self_attn.qkv_proj"
    ads = [load_adapter(n, adapters[n], cfg, 16) for n in ("all8", "qv4")]
    for slot, ad in enumerate(ads):
        layer.set_slot(slot, ad.slices(name), torch.float32, torch.device("cpu"))
    x = torch.randn(7, cfg.hidden_size)
    batch.segments = [(1, 0, 2), (0, 3, 6)]               # rows 2 and 6 are base rows
    with torch.no_grad():
        got = layer(x)
        want = base(x)
        for slot, start, end in batch.segments:
            deltas = [torch.zeros(end - start, s) if lw is None else lw.scaling * x[start:end] @ lw.a.T @ lw.b.T
                      for s, lw in zip(out_sizes, ads[slot].slices(name))]
            want[start:end] += torch.cat(deltas, dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _write_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(cfg | changes))


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"r": 32}, "max-lora-rank"),
    ({"r": 4}, "do not fit rank 4"),
])
def test_adapter_fields_that_change_the_math_are_refused_by_name(tiny, tmp_path, change, message):
    cfg = read_model_config(tiny)
    path = random_adapter(tmp_path / "a", cfg, 8, seed=1)
    _write_config(path, **change)
    with pytest.raises(ValueError, match=message):
        load_adapter("a", path, cfg, 16)


def test_adapter_for_another_model_and_pickles_are_refused(tiny, tmp_path):
    cfg = read_model_config(tiny)
    wide = random_adapter(tmp_path / "wide", cfg, 4, layers=range(2))
    bigger = dataclasses.replace(cfg, num_layers=3)
    other = random_adapter(tmp_path / "other", bigger, 4)
    with pytest.raises(ValueError, match="not a projection of this"):
        load_adapter("o", other, cfg, 16)
    load_adapter("w", wide, cfg, 16)
    (wide / "adapter_model.safetensors").rename(wide / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_adapter("w", wide, cfg, 16)


def test_lora_request_to_an_engine_without_lora_is_an_error(tiny, adapters):
    llm = LLM(str(tiny), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters["qv4"])))


def test_lora_flags_use_vllm_names():
    import argparse

    from tokenmill.engine_args import add_engine_args, engine_config_from_args
    from tokenmill.lora.manager import parse_lora_modules
    parser = argparse.ArgumentParser()
    add_engine_args(parser, positional_model=True)
    cfg = engine_config_from_args(parser.parse_args(
        ["m", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--max-lora-rank", "32",
         "--max-cpu-loras", "3", "--lora-dir", "/d"]))
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, cfg.lora_dir) == (True, 2, 32, 3, "/d")
    assert parse_lora_modules(cfg.lora_modules) == {"a": "/x", "b": "/y"}
    for bad in (["a"], ["=x"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_modules(bad)


@pytest.mark.parametrize("kw, message", [
    ({"lora_modules": ["a=/x"], "enable_lora": False}, "need enable_lora"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
    ({"lora_modules": ["a=/nonexistent"]}, "no adapter_config.json"),
    ({"lora_dir": "/nonexistent"}, "not a directory"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
])
def test_bad_lora_engine_settings_are_refused(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm(tiny, **kw)


def test_cli_generate_with_an_adapter(tiny, adapters, capsys):
    from tokenmill.cli import main
    common = ["generate", "--model", str(tiny), "--dtype", "float32", "--max-model-len", "256",
              "--kv-cache-memory", "16M", "--prompt", "hello world", "--max-tokens", "6"]
    main(common)
    base = capsys.readouterr().out
    main(common + ["--enable-lora", "--lora-modules", f"qv={adapters['qv4']}", "--lora", "qv"])
    adapted = capsys.readouterr().out
    llm = tiny_llm(tiny)
    want = llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False,
                        lora_request=LoRARequest("qv", 1, str(adapters["qv4"])))[0].outputs[0].text
    assert adapted == want + "\n" and adapted != base
    with pytest.raises(SystemExit, match="not among"):
        main(common + ["--enable-lora", "--lora", "nope"])
