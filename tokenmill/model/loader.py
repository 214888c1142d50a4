"""GGUF and HF-safetensors checkpoints -> (ModelConfig, HF-named dense tensors).

Everything downstream speaks HF names and HF layouts, so GGUF is translated here once:
names are mapped, quantized blocks are dequantized (gguf's numpy kernels), and llama.cpp's
Q/K row permutation is undone. Tensors are converted one at a time so peak memory is about
the output state dict plus one fp32 tensor.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.model.registry import GGUF_ROPE_TYPES, UnsupportedConfig, check_gguf_keys
from tokenmill.model.rope import RopeScaling

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "gemma3")
GGUF_ROPE_TENSORS = ("rope_freqs.weight",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per block: llama.cpp's ffn_norm is the one before the MLP
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# llama.cpp's Gemma 3: every sixth layer attends globally (no GGUF key says so; transformers
# assumes the same `sliding_window_pattern` of 6 for a GGUF), local layers use rope base 10,000
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if m := _BLOCK_RE.match(name):
        layer, part, kind = m.groups()
        names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    # e.g. rope_freqs (Llama 3 rope scaling) would change the math: refuse rather than ignore.
    raise ValueError(f"GGUF tensor {name!r} has no HF equivalent that tokenmill supports")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's `permute` (rows of each head: interleaved -> halves).

    llama.cpp stores rotary pairs interleaved (GPT-J style); HF rotates the two halves of
    each head (NeoX style). Works on weights [rows, cols] and biases [rows].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def fast_gguf_reader_class() -> type:
    """gguf's GGUFReader over a plain ndarray view of its memory map: np.memmap's per-slice
    overhead made parsing Gemma 3's 262k-token vocabulary take 15 s (5 s this way)."""
    from gguf import GGUFReader

    class FastGGUFReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)     # still backed by (and keeping alive) the map

    return FastGGUFReader


@functools.lru_cache(maxsize=4)
def gguf_reader(path: Path, stamp: tuple[int, int]) -> Any:
    """The parsed GGUF (memory-mapped), kept: start-up reads it for the config and the weights.
    `stamp` (size, mtime) keys a changed file afresh."""
    return fast_gguf_reader_class()(path)


def _open_gguf(path: Path) -> Any:
    st = path.stat()
    return gguf_reader(path.resolve(), (st.st_size, st.st_mtime_ns))


def _f32(x: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.9999997e-06. Round to the shortest repr."""
    return float(str(np.float32(x)))


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_rope(reader: Any, arch: str, tensors: dict[str, Any]) -> RopeScaling | None:
    """llama.cpp's rope scaling keys -> the HF-equivalent RopeScaling (same formulas: linear is
    freq_scale = 1/factor; yarn uses beta_fast 32 / beta_slow 1 and mscale 0.1 ln(factor) + 1
    times attn_factor; Llama-3 is stored as the per-pair `rope_freqs` divisors)."""
    def a(key: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{key}", default)

    kind = a("rope.scaling.type", "none")
    if kind not in GGUF_ROPE_TYPES:
        raise UnsupportedConfig(f"GGUF key '{arch}.rope.scaling.type' = {kind!r} is not supported "
                                f"(supported: {', '.join(GGUF_ROPE_TYPES)})")
    factors = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        factors = tuple(float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1))
    rope_type = GGUF_ROPE_TYPES[kind]
    if rope_type == "default" and factors is None:
        return None
    fields: dict[str, Any] = {"rope_type": rope_type, "freq_factors": factors}
    if rope_type != "default":
        fields["factor"] = _f32(a("rope.scaling.factor", 1.0))
    if rope_type == "yarn":
        fields["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length",
                                                           a("context_length", 2048)))
        fields["beta_fast"] = _f32(a("rope.scaling.yarn_beta_fast", 32.0))
        fields["beta_slow"] = _f32(a("rope.scaling.yarn_beta_slow", 1.0))
        attn = a("rope.scaling.attn_factor")
        if attn is not None:
            mscale = 1.0 if fields["factor"] <= 1 else 0.1 * math.log(fields["factor"]) + 1.0
            fields["attention_factor"] = _f32(attn) * mscale
    return RopeScaling(**fields)


def gguf_config(reader: Any) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` keys) and the tensor list."""
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})")
    check_gguf_keys(arch, list(reader.fields))
    tensors = {t.name: t for t in reader.tensors}

    def a(key: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{key}", default)

    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(a("attention.key_length") or a("rope.dimension_count") or hidden // heads)
    for key in ("rope.dimension_count", "attention.value_length"):
        if a(key) is not None and int(a(key)) != head_dim:
            raise UnsupportedConfig(f"GGUF key '{arch}.{key}' = {a(key)} differs from the head size {head_dim} "
                                    f"(partial rotary / different value heads are not supported)")
    # GGUF shapes are innermost-first: token_embd is [hidden, vocab].
    vocab = int(tensors["token_embd.weight"].shape[1])
    eos = [_meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    window = a("attention.sliding_window")
    layers = int(a("block_count"))
    gemma3 = arch == "gemma3"
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(a("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope(reader, arch, tensors),
        max_position_embeddings=int(a("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        sliding_window=None if window is None else int(window),
        eos_token_ids=eos_ids,
        layer_types=[("full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention")
                     for i in range(layers)] if gemma3 and window is not None else None,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if gemma3 else None,
        # llama.cpp: head_dim, except Gemma 3 27B (62 layers), which scales by hidden / heads
        query_pre_attn_scalar=(hidden // heads if layers == 62 else head_dim) if gemma3 else None,
    )


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = _open_gguf(path)  # memory-mapped: only one tensor is materialised at a time
    cfg = gguf_config(reader)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in GGUF_ROPE_TENSORS:   # already in cfg.rope_scaling
            continue
        name = gguf_to_hf_name(t.name, cfg.architecture)
        shape = tuple(int(d) for d in reversed(t.shape))
        # A plain ndarray view skips np.memmap's per-slice overhead: dequantize is ~2x faster.
        arr = dequantize(t.data.view(np.ndarray), t.tensor_type).reshape(shape)
        if not arr.flags.writeable:  # F32 comes back as a view of the read-only mmap
            arr = arr.copy()
        w = torch.from_numpy(arr)
        if cfg.architecture == "llama":  # qwen2 conversion does not permute
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_qk(w, cfg.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_qk(w, cfg.num_kv_heads)
        elif cfg.architecture == "gemma3" and name.endswith("norm.weight"):
            w = w - 1        # llama.cpp stores Gemma's (1 + w); HF layout holds w
        weights[name] = w.to(dtype).contiguous()
    return cfg, weights


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    quantized = "quantization_config" in hf
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, w in load_file(f).items():
            # A quantized checkpoint's codes, zeros, scales etc. stay exactly as stored (the
            # quantized modules are built from them); only float weights/biases take `dtype`.
            if not quantized or (w.is_floating_point() and name.rpartition(".")[2] in ("weight", "bias")):
                w = w.to(dtype)
            weights[name] = w
    return cfg, weights


def read_model_config(path: Path) -> ModelConfig:
    """Only the config (cheap): the engine validates it against its settings before any weight
    is read."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_config(_open_gguf(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    raise ValueError(f"{path} is neither a .gguf file nor a directory with config.json")


def checkpoint_quant_config(path: Path) -> "QuantConfig | None":
    """The QuantConfig of an HF directory whose config.json has `quantization_config`, else None."""
    from tokenmill.quant.config import QuantConfig

    path = Path(path)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    return None if qc is None else QuantConfig.from_hf(qc)


def load_model_weights(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a .gguf file or an HF directory into (config, HF-named tensors of `dtype`).

    With tied embeddings there is no `lm_head.weight`: the model reuses `model.embed_tokens`.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        cfg, weights = _load_hf_dir(path, dtype)
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return cfg, weights
    raise ValueError(f"{path} is neither a .gguf file nor a directory with config.json")


def load_tokenizer(path: Path) -> Any:
    """HF tokenizer for a .gguf file (built from its metadata) or an HF directory."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf":
        # Building a fast tokenizer from GGUF metadata takes ~10 s; keep the result beside the
        # other caches, keyed by the file's identity, so later starts load it in well under 1 s.
        from tokenmill.hub import tokenmill_home

        st = path.stat()
        cache = tokenmill_home() / "tokenizers" / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"
        if (cache / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(cache)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if getattr(tok, "chat_template", None) is None:
            # Older transformers did not carry the template over from the GGUF metadata.
            template = _meta(_open_gguf(path), "tokenizer.chat_template")
            if template:
                tok.chat_template = template
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(tmp)
        _publish_dir(tmp, cache)
        return tok
    return AutoTokenizer.from_pretrained(path)


def _publish_dir(tmp: Path, dest: Path) -> None:
    """Rename a finished `tmp` directory to `dest`. Two processes starting at once may both
    build it: renaming onto a directory the other just published fails (ENOTEMPTY), and then
    the other's copy, equally complete, is kept."""
    try:
        os.replace(tmp, dest)
    except OSError:
        if not dest.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
