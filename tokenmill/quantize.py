"""`tokenmill quantize`: a model (known name, .gguf or HF dir) -> a quantized HF-layout directory.

Calibration sources (`--calib`):
  sharegpt:N   the first N usable conversations of ShareGPT with index < CALIBRATION_END (the
               quality benchmark scores conversations >= HELD_OUT_START, never these), rendered
               with the tokenizer's chat template (human -> user, gpt -> assistant; other roles
               dropped) or, without a template, as plain text joined by blank lines
  sharegpt-plain:N  the same conversations as plain text, turns joined by blank lines (the
               format `bench quality` scores perplexity on)
  text:PATH    one calibration sequence per paragraph (blank-line separated) of a local file
Every sequence is truncated to `calib_max_len` tokens; sequences under MIN_CALIB_TOKENS are skipped.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import ModelConfig
from tokenmill.hub import resolve_model
from tokenmill.model import causal_lm_class
from tokenmill.model.llama import LlamaForCausalLM, hf_module_sources, hf_row_sizes
from tokenmill.model.registry import hf_config_from_model
from tokenmill.model.loader import load_model_weights, load_tokenizer
from tokenmill.quant.apply import quantize_model
from tokenmill.quant.calibrate import CALIBRATED_METHODS, quantize_calibrated
from tokenmill.quant.checkpoint import save_quantized
from tokenmill.quant.config import QuantConfig

log = logging.getLogger("tokenmill")
MIN_CALIB_TOKENS = 8


def load_float_model(path: Path) -> tuple[LlamaForCausalLM, ModelConfig, dict[str, Any]]:
    """float32 model on CPU plus the HF config dict to save next to it."""
    path = Path(path)
    hf = None
    if path.is_dir():
        hf = json.loads((path / "config.json").read_text())
        if "quantization_config" in hf:
            raise ValueError(f"{path} is already quantized ({hf['quantization_config'].get('quant_method')})")
    cfg, weights = load_model_weights(path, torch.float32)
    model = causal_lm_class(cfg.architecture)(cfg, cfg.max_position_embeddings)
    model.load_hf_state_dict(weights)
    return model.eval(), cfg, hf if hf is not None else hf_config_from_model(cfg)


def _chat_ids(tokenizer: Any, turns: list[tuple[str, str]]) -> list[int] | None:
    roles = {"human": "user", "gpt": "assistant"}
    msgs = [{"role": roles[r], "content": t} for r, t in turns if r in roles and t.strip()]
    if not msgs:
        return None
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        except Exception:       # templates that insist on strict alternation etc.
            pass
    return list(tokenizer("\n\n".join(m["content"] for m in msgs))["input_ids"])


def calibration_sequences(spec: str, tokenizer: Any, max_len: int = 512) -> list[list[int]]:
    kind, _, arg = spec.partition(":")
    seqs: list[list[int]] = []
    if kind in ("sharegpt", "sharegpt-plain"):
        from tokenmill.bench.sharegpt import CALIBRATION_END, load_sharegpt
        n = int(arg or 128)
        if n > CALIBRATION_END:
            raise ValueError(f"sharegpt calibration reads conversations < {CALIBRATION_END}; asked for {n}")
        for conv in load_sharegpt(limit=CALIBRATION_END):
            if len(seqs) == n:
                break
            ids = (_chat_ids(tokenizer, conv.turns) if kind == "sharegpt"
                   else list(tokenizer(conv.plain_text())["input_ids"]))
            if ids is not None and len(ids) >= MIN_CALIB_TOKENS:
                seqs.append(ids[:max_len])
        if len(seqs) < n:
            raise ValueError(f"only {len(seqs)} usable ShareGPT calibration conversations, asked for {n}")
    elif kind == "text":
        text = Path(arg).read_text(encoding="utf-8")
        for para in (p.strip() for p in text.split("\n\n")):
            ids = list(tokenizer(para)["input_ids"]) if para else []
            if len(ids) >= MIN_CALIB_TOKENS:
                seqs.append(ids[:max_len])
        if not seqs:
            raise ValueError(f"{arg}: no paragraph of at least {MIN_CALIB_TOKENS} tokens")
    else:
        raise ValueError(f"unknown calibration source {spec!r} (use sharegpt:N, sharegpt-plain:N or text:PATH)")
    return seqs


def quantize_to_dir(model_name: str, qcfg: QuantConfig, out: str | Path, calib: str = "sharegpt:128",
                    calib_max_len: int = 512, progress: bool = True) -> Path:
    t0 = time.perf_counter()
    path = resolve_model(model_name)
    model, cfg, hf = load_float_model(path)
    tokenizer = load_tokenizer(path)
    if qcfg.method in CALIBRATED_METHODS:
        seqs = calibration_sequences(calib, tokenizer, calib_max_len)
        log.info("calibrating %s on %d sequences (%d tokens)", qcfg.method, len(seqs), sum(map(len, seqs)))
        quantize_calibrated(model, seqs, qcfg, progress=progress)
    else:
        quantize_model(model, qcfg)
    out = save_quantized(model, qcfg, hf, out, hf_module_sources, lambda n: hf_row_sizes(cfg, n), tokenizer)
    log.info("quantized %s with %s into %s in %.1fs", model_name, qcfg.method, out, time.perf_counter() - t0)
    return out
