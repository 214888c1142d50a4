"""Which checkpoints tokenmill runs, and the decision for every config key it may meet.

A config key either changes the forward pass or it does not. Those that do are honoured (parsed
into ModelConfig and implemented) or refused by name before any weight is read; those that do
not are listed here explicitly. A key in neither list is refused too, so supporting a new
checkpoint is a decision, not an accident. The README's supported-models table is generated
from this file (`python -m tokenmill.model.registry`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.config import ModelConfig, UnsupportedConfig
from tokenmill.model.rope import ROPE_TYPES, RopeScaling

__all__ = ["UnsupportedConfig", "model_config_from_hf", "check_gguf_keys", "supported_models_markdown"]


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str                      # ModelConfig.architecture
    model_types: tuple[str, ...]   # HF config `model_type`
    hf_classes: tuple[str, ...]    # HF config `architectures`
    gguf_arch: str | None
    features: str                  # what is honoured, for the README table
    verified: str                  # how parity is checked


ARCHITECTURES = (
    Architecture("llama", ("llama",), ("LlamaForCausalLM",), "llama",
                 "GQA/MQA, head_dim != hidden/heads, tied or untied head, attention_bias (q/k/v/o), mlp_bias, "
                 "rope scaling linear / dynamic / llama3 / yarn (GGUF: rope_freqs, rope.scaling.*)",
                 "tests/test_config_parity.py (tiny random models vs transformers fp32); "
                 "SmolLM2-135M GGUF greedy parity (tests/test_parity_smollm2.py)"),
    Architecture("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), "qwen2",
                 "q/k/v bias, GQA, tied or untied head, rope scaling as Llama (Qwen2.5 yarn); "
                 "sliding window (use_sliding_window / max_window_layers / layer_types)",
                 "tests/test_config_parity.py; Qwen2 GGUF loader tests (tests/test_loader.py)"),
    Architecture("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), "gemma3",
                 "GGUF only: sliding-window local layers (every sixth layer global) with their own rope base "
                 "and KV group, q/k norm, (1 + w) norms, GELU-tanh, query_pre_attn_scalar",
                 "Gemma 3 270M GGUF greedy parity (tests/test_parity_gemma3.py)"),
    Architecture("llama", ("mistral",), ("MistralForCausalLM",), None,
                 "Llama math, sliding window on every layer",
                 "tests/test_config_parity.py"),
)

# ---- HF config.json keys ------------------------------------------------------------------

# Keys with no effect on the logits: bookkeeping, training-only settings, generation defaults
# (tokenmill takes sampling settings from the request), token ids (eos is read separately).
HARMLESS_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "id2label", "label2id", "problem_type", "return_dict", "output_attentions", "output_hidden_states",
    "use_return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
    "bos_token_id", "pad_token_id", "sep_token_id", "unk_token_id", "decoder_start_token_id",
    "use_cache", "initializer_range", "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop",
    "pretraining_tp",            # training-time tensor-parallel slicing; the same math at inference
    "_attn_implementation_autoset", "attn_implementation",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
    "quantization_config",       # read by the quantized-checkpoint loader, which refuses what it cannot run
})

# Keys parsed into ModelConfig (their values are validated where they are read).
HONOURED_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "eos_token_id", "rope_theta", "rope_scaling", "rope_parameters",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "hidden_act",
})


def _neutral(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v in ok


# Keys that change the forward pass and are refused unless their value is the neutral one.
CONDITIONAL_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "partial_rotary_factor": (_neutral(None, 1, 1.0), "rotary embedding over the whole head (1.0)"),
    "attn_logit_softcapping": (_neutral(None), "no attention logit soft-capping"),
    "final_logit_softcapping": (_neutral(None), "no final logit soft-capping"),
    "use_mrope": (_neutral(None, False), "1-D rotary positions (no multimodal rope)"),
    "pruned_heads": (_neutral(None, {}), "no pruned heads"),
    "num_experts": (_neutral(None, 0), "dense MLPs (no mixture of experts)"),
    "num_local_experts": (_neutral(None, 0), "dense MLPs (no mixture of experts)"),
    "n_routed_experts": (_neutral(None, 0), "dense MLPs (no mixture of experts)"),
    "num_experts_per_tok": (_neutral(None, 0), "dense MLPs (no mixture of experts)"),
    "moe_intermediate_size": (_neutral(None, 0), "dense MLPs (no mixture of experts)"),
    "shared_expert_intermediate_size": (_neutral(None, 0), "dense MLPs (no mixture of experts)"),
    "decoder_sparse_step": (_neutral(None, 0, 1), "dense MLPs (no mixture of experts)"),
    "embedding_multiplier": (_neutral(None, 1, 1.0), "unscaled embeddings"),
    "residual_multiplier": (_neutral(None, 1, 1.0), "unscaled residuals"),
    "logits_scaling": (_neutral(None, 1, 1.0), "unscaled logits"),
    "attention_multiplier": (_neutral(None), "attention scale head_dim ** -0.5"),
    "query_pre_attn_scalar": (_neutral(None), "attention scale head_dim ** -0.5"),
}

ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "dynamic": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"},
}
ACTIVATIONS = ("silu", "swish")


def _refuse(key: str, value: Any, supported: str) -> UnsupportedConfig:
    return UnsupportedConfig(f"config key {key!r} = {value!r} changes the model's math in a way tokenmill "
                             f"does not implement (supported: {supported})")


def architecture_for(cfg: dict[str, Any]) -> Architecture:
    model_type = cfg.get("model_type", "llama")
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            classes = cfg.get("architectures") or list(arch.hf_classes)
            bad = [c for c in classes if c not in arch.hf_classes]
            if bad:
                raise _refuse("architectures", classes, ", ".join(arch.hf_classes))
            return arch
    known = sorted(t for a in ARCHITECTURES for t in a.model_types)
    raise UnsupportedConfig(f"unsupported architecture: config key 'model_type' = {model_type!r} "
                            f"(supported: {', '.join(known)})")


def check_hf_keys(cfg: dict[str, Any]) -> None:
    for key, value in cfg.items():
        if key in HARMLESS_KEYS or key in HONOURED_KEYS:
            continue
        if key in CONDITIONAL_KEYS:
            ok, supported = CONDITIONAL_KEYS[key]
            if not ok(value):
                raise _refuse(key, value, supported)
            continue
        raise UnsupportedConfig(
            f"config key {key!r} = {value!r} is not known to tokenmill, so it may change the math; refusing "
            f"rather than guessing (if it does not affect the forward pass, add it to HARMLESS_KEYS in "
            f"tokenmill/model/registry.py)")


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either the transformers-4 (`rope_theta` + `rope_scaling`) or the
    transformers-5 (`rope_parameters`) layout."""
    # transformers 5 folds a legacy `rope_scaling` into `rope_parameters`; the explicit one wins
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise _refuse(f"{key}.rope_type", rope_type, ", ".join(ROPE_TYPES))
    for k, v in rope.items():
        if k not in ROPE_KEYS[rope_type] and v is not None:
            raise _refuse(f"{key}.{k}", v, f"{rope_type} rope takes {', '.join(sorted(ROPE_KEYS[rope_type]))}")
    if rope_type == "default":
        return theta, None
    fields = {k: rope[k] for k in ROPE_KEYS[rope_type] - {"rope_type", "type", "rope_theta"} if rope.get(k) is not None}
    if rope_type in ("llama3", "yarn"):
        fields.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if rope_type == "yarn" and "factor" not in fields:   # DeepSeek-style: implied by the two lengths
        fields["factor"] = cfg["max_position_embeddings"] / fields["original_max_position_embeddings"]
    if "factor" not in fields:
        raise _refuse(f"{key}.factor", None, f"{rope_type} rope needs a factor")
    try:
        return theta, RopeScaling(rope_type=rope_type, **fields)
    except (TypeError, ValueError) as exc:
        raise _refuse(key, rope, str(exc)) from None


def sliding_window_from_hf(cfg: dict[str, Any], arch: Architecture) -> tuple[int | None, list[str] | None]:
    """(window, layer types): the window some layer attends through (None: full attention
    everywhere) and which layers do (None: all of them)."""
    window = cfg.get("sliding_window")
    if window is None:
        return None, None
    if "mistral" in arch.model_types:
        return int(window), None
    if "qwen2" not in arch.model_types:
        raise _refuse("sliding_window", window, "null: transformers' Llama attends to the whole context")
    # Qwen2 (as transformers): the window counts only with use_sliding_window, on the layers
    # explicit layer_types name, else on layers >= max_window_layers
    if not cfg.get("use_sliding_window"):
        return None, None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = cfg.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(cfg["num_hidden_layers"])]
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise _refuse("layer_types", sorted(unknown), "full_attention, sliding_attention")
    if "sliding_attention" not in layer_types:
        return None, None
    return int(window), list(layer_types)


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    arch = architecture_for(cfg)
    if arch.name == "gemma3":
        raise UnsupportedConfig("Gemma 3 loads from GGUF only (its HF config.json keys are not mapped yet)")
    check_hf_keys(cfg)
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise _refuse("hidden_act", act, ", ".join(ACTIVATIONS))
    theta, scaling = rope_from_hf(cfg)
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    qwen2 = arch.name == "qwen2"
    window, layer_types = sliding_window_from_hf(cfg, arch)
    return ModelConfig(
        architecture=arch.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        # HF Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four
        attention_bias=qwen2 or bool(cfg.get("attention_bias", False)),
        o_proj_bias=not qwen2 and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=window,
        layer_types=layer_types,
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
    )


# ---- GGUF metadata keys ({arch}.*) ------------------------------------------------------

GGUF_HONOURED = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.attn_factor",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "attention.sliding_window",
})
GGUF_HARMLESS = frozenset({"rope.scaling.finetuned", "attention.layer_norm_epsilon_unused"})
GGUF_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json that `model_config_from_hf` reads back as `cfg` (for a quantized
    checkpoint of a GGUF model). What HF's layout cannot say is refused by name."""
    if cfg.architecture not in ("llama", "qwen2"):
        raise UnsupportedConfig(f"tokenmill writes no HF config.json for {cfg.architecture} models yet")
    if cfg.rope_scaling is not None and cfg.rope_scaling.freq_factors is not None:
        raise UnsupportedConfig("GGUF rope_freqs (per-frequency rope factors) have no HF config.json form")
    qwen2 = cfg.architecture == "qwen2"
    if (not qwen2 and cfg.attention_bias != cfg.o_proj_bias) or (qwen2 and (not cfg.attention_bias or cfg.o_proj_bias)):
        raise UnsupportedConfig(f"{cfg.architecture} with q/k/v bias={cfg.attention_bias} and o_proj bias="
                                f"{cfg.o_proj_bias} has no HF config.json form")
    out: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if not qwen2:
        out["attention_bias"] = cfg.attention_bias
        out["mlp_bias"] = cfg.mlp_bias
    elif cfg.mlp_bias:
        raise UnsupportedConfig("qwen2 with MLP biases has no HF config.json form")
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": s.rope_type, **{k: v for k in ROPE_KEYS[s.rope_type]
                               if k not in ("rope_type", "type", "rope_theta")
                               and (v := getattr(s, k, None)) is not None}}
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
        if not qwen2:    # Llama math with a window on every layer is Mistral
            out.update(architectures=["MistralForCausalLM"], model_type="mistral")
        if qwen2:
            out.update(use_sliding_window=True, max_window_layers=0)
        if cfg.layer_types is not None:
            out["layer_types"] = list(cfg.layer_types)
    if cfg.eos_token_ids:
        out["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    return out


def check_gguf_keys(arch: str, keys: list[str]) -> None:
    prefix = f"{arch}."
    for full in keys:
        if not full.startswith(prefix):
            continue   # general.*, tokenizer.*: metadata, not math
        key = full[len(prefix):]
        if key not in GGUF_HONOURED and key not in GGUF_HARMLESS:
            raise UnsupportedConfig(f"GGUF key {full!r} is not known to tokenmill, so it may change the math; "
                                    f"refusing rather than guessing")


def supported_models_markdown() -> str:
    rows = ["| Architecture (HF `model_type`) | HF class | GGUF | Honoured | Verified by |",
            "|---|---|---|---|---|"]
    for a in ARCHITECTURES:
        rows.append(f"| {', '.join(a.model_types)} | {', '.join(a.hf_classes)} | {a.gguf_arch or '-'} | "
                    f"{a.features} | {a.verified} |")
    refused = sorted(CONDITIONAL_KEYS)
    rows.append("")
    rows.append("Refused by name at load time, before any weight is read: any config key outside the explicit "
                "harmless/honoured lists in `tokenmill/model/registry.py`, rope types other than "
                f"{', '.join(ROPE_TYPES)}, `hidden_act` other than {', '.join(ACTIVATIONS)}, and non-neutral "
                f"values of {', '.join(f'`{k}`' for k in refused)}.")
    return "\n".join(rows)


if __name__ == "__main__":
    print(supported_models_markdown())
