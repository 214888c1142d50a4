"""Calibrated quantization (GPTQ, AWQ, SmoothQuant) of tokenmill's own float Llama model.

SEQUENTIAL, layer by layer ("true sequential" in the GPTQ reference code): the calibration
hidden states enter layer 0; inside a layer the four projections are quantized in execution
order qkv_proj, o_proj, gate_up_proj, down_proj, each from the inputs it receives while every
projection before it (in this and all earlier layers) is already quantized; then the quantized
layer's output becomes the next layer's input. So later layers learn to compensate for (GPTQ) or
are fitted on (AWQ clipping, SmoothQuant ranges) the error the earlier ones actually make.
A projection's input is captured by a forward pre-hook that stops the layer's forward right
there, so each stage only runs the layer up to the projection it needs.

The fused projections share one input: qkv_proj (q, k, v) and gate_up_proj (gate, up) get one
Hessian / sample set / activation range for the fused weight, i.e. the same statistics that
quantizing q, k and v separately from their common input would use.

What each method collects per projection input x [tokens, K]:
  gptq         H = 2/n Σ x xᵀ (HessianAccumulator) -> gptq_quantize
  awq          up to `awq_max_rows` evenly strided rows of x -> scale search + clip search
  smoothquant  max_t |x[t, j]| per input channel

Folding (the float function is unchanged by the scales; only quantization sees them):
  AWQ: per layer, first on the FLOAT layer (one pass capturing qkv, gate_up and down inputs),
    s_qkv is searched and folded as input_layernorm.weight /= s, qkv.weight *= s; s_gu likewise
    into post_attention_layernorm and gate_up; s_down into the up half of gate_up's ROWS
    (up /= s, since silu(gate)·up/s = (silu(gate)·up)/s) and down.weight *= s. All folding
    happens before any projection of the layer is quantized, so the producer (gate_up) is
    quantized with the down scales already in it. o_proj gets no scale: its input is the
    attention output, a mix of v rows per head, and under GQA one v row feeds several query
    heads' o_proj columns, so a per-o-column scale has no single v row to fold into. It still
    gets AWQ's clip search.
  SmoothQuant: s_j = max|X_j|^α / max|W_j|^(1-α); W' = W·diag(s). For qkv_proj and gate_up_proj
    1/s is folded into the preceding RMSNorm (smooth_inv stored as ones: the module still
    quantizes activations per token); o_proj and down_proj have no foldable predecessor and
    keep 1/s as Int8Linear.smooth_inv (one multiply per call).
GPTQ/AWQ scales are rounded to fp16 right away, as the AutoGPTQ/AutoAWQ checkpoint stores them,
so the in-memory model and its saved checkpoint compute bit-identical logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.model.attention import AttentionMetadata, PrefillSpan
from tokenmill.quant.apply import group_size_for, replace_module
from tokenmill.quant.awq import awq_quantize
from tokenmill.quant.config import QuantConfig
from tokenmill.quant.gptq import HessianAccumulator, gptq_quantize
from tokenmill.quant.group import GroupQuant
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.kv_cache import KVCache

CALIBRATED_METHODS = ("gptq", "awq", "smoothquant")
# execution order inside one decoder layer
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
GPTQ_BLOCK = 128


class _Stop(Exception):
    """Raised by a capture hook: the rest of the layer's forward is not needed."""


@dataclass(slots=True)
class CalibBatch:
    """Several calibration sequences as one flat prefill batch."""
    hidden: torch.Tensor          # [T, H] float32 residual stream entering the current layer
    positions: torch.Tensor       # [T]
    meta: AttentionMetadata


def prefill_metadata(lengths: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
    """Whole-sequence prefills of the given lengths laid out back to back, cache slots 0..T-1."""
    spans, start = [], 0
    for n in lengths:
        spans.append(PrefillSpan(start, start + n, n, None))
        start += n
    return AttentionMetadata(slot_mapping=torch.arange(start, device=device), num_decode_tokens=0,
                             decode_block_tables=None, decode_context_lens=None, prefills=spans)


def make_batches(sequences: list[list[int]], max_batch_tokens: int) -> list[tuple[list[list[int]], AttentionMetadata, torch.Tensor]]:
    out, cur = [], []
    for seq in sequences:
        if cur and sum(map(len, cur)) + len(seq) > max_batch_tokens:
            out.append(cur)
            cur = []
        cur.append(list(seq))
    if cur:
        out.append(cur)
    batches = []
    for group in out:
        lengths = [len(s) for s in group]
        positions = torch.cat([torch.arange(n) for n in lengths])
        batches.append((group, prefill_metadata(lengths), positions))
    return batches


@dataclass
class _Stats:
    """Statistics of one projection's input, as the method needs them."""
    in_features: int
    method: str
    max_rows: int
    total_rows: int
    hessian: HessianAccumulator | None = None
    samples: list[torch.Tensor] = field(default_factory=list)
    absmax: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.in_features).float()
        if self.method == "gptq":
            if self.hessian is None:
                self.hessian = HessianAccumulator(self.in_features)
            self.hessian.add(x)
        elif self.method == "awq":
            stride = max(1, -(-self.total_rows // self.max_rows))
            self.samples.append(x[::stride].clone())
        elif self.method == "smoothquant":
            m = x.abs().amax(dim=0)
            self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)

    def x(self) -> torch.Tensor:
        return torch.cat(self.samples)[: self.max_rows]


def _fp16_scales(gq: GroupQuant) -> GroupQuant:
    gq.scales = gq.scales.half().float()
    return gq


class _Calibrator:
    def __init__(self, model: nn.Module, sequences: list[list[int]], qcfg: QuantConfig,
                 max_batch_tokens: int, awq_max_rows: int) -> None:
        self.model, self.qcfg = model, qcfg
        self.awq_max_rows = awq_max_rows
        self.batches = make_batches(sequences, max_batch_tokens)
        self.total_rows = sum(len(s) for s in sequences)
        cfg = model.cfg
        biggest = max(sum(map(len, g)) for g, _, _ in self.batches)
        shape = (1, biggest, cfg.num_kv_heads, cfg.head_dim)
        self.kv = KVCache(torch.zeros(shape), torch.zeros(shape))
        with torch.no_grad():
            self.hidden = [model.embed_tokens(torch.tensor([t for s in g for t in s])).float()
                           for g, _, _ in self.batches]

    def _forward(self, layer: nn.Module, x: torch.Tensor, meta: AttentionMetadata, pos: torch.Tensor) -> torch.Tensor:
        return layer(x, pos, self.model.rope, self.kv, meta)

    def capture(self, layer: nn.Module, names: list[str], stop: bool) -> dict[str, _Stats]:
        """Run the layer over every batch, collecting the inputs of `names` (stopping at the
        first of them when `stop`, which then must be the only one)."""
        stats, handles = {}, []
        for name in names:
            mod = layer.get_submodule(name)
            st = stats[name] = _Stats(mod.in_features, self.qcfg.method, self.awq_max_rows, self.total_rows)

            def hook(_m, args, st=st):
                st.add(args[0])
                if stop:
                    raise _Stop
            handles.append(mod.register_forward_pre_hook(hook))
        try:
            for x, (_, meta, pos) in zip(self.hidden, self.batches):
                try:
                    self._forward(layer, x, meta, pos)
                except _Stop:
                    pass
        finally:
            for h in handles:
                h.remove()
        return stats

    # ---- AWQ scale search and folding (float layer) --------------------------------------
    def awq_fold(self, layer: nn.Module) -> None:
        stats = self.capture(layer, ["self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"], stop=False)
        qcfg = self.qcfg
        mlp = layer.mlp
        for name, norm in (("self_attn.qkv_proj", layer.input_layernorm),
                           ("mlp.gate_up_proj", layer.post_attention_layernorm)):
            lin = layer.get_submodule(name)
            _, s = awq_quantize(lin.weight, stats[name].x(), 4, group_size_for(qcfg, lin.in_features), clip=False)
            fold_into_norm(norm, lin, s)
        down, gu = mlp.down_proj, mlp.gate_up_proj
        if gu.bias is None:
            _, s = awq_quantize(down.weight, stats["mlp.down_proj"].x(), 4,
                                group_size_for(qcfg, down.in_features), clip=False)
            fold_into_up_rows(gu, down, s)

    # ---- one projection ------------------------------------------------------------------
    def quantize_one(self, layer: nn.Module, name: str, st: _Stats) -> nn.Module:
        lin = layer.get_submodule(name)
        qcfg = self.qcfg
        w = lin.weight.detach().float()
        bias = None if lin.bias is None else lin.bias.detach().float().clone()
        gs = group_size_for(qcfg, lin.in_features)
        if qcfg.method == "gptq":
            gq = gptq_quantize(w, st.hessian.hessian(), 4, gs, qcfg.damp_percent, GPTQ_BLOCK, qcfg.act_order)
            return Int4Linear(_fp16_scales(gq), bias)
        if qcfg.method == "awq":
            gq, _ = awq_quantize(w, st.x(), 4, gs, search_scale=False, clip=True)
            return Int4Linear(_fp16_scales(gq), bias)
        # smoothquant
        s = smoothquant_scales(st.absmax, w, qcfg.alpha)
        norm = {"self_attn.qkv_proj": layer.input_layernorm,
                "mlp.gate_up_proj": layer.post_attention_layernorm}.get(name)
        if norm is not None:
            fold_into_norm(norm, lin, s)
            return Int8Linear.from_float(lin.weight.detach().float(), bias, smooth_inv=torch.ones_like(s))
        return Int8Linear.from_float(w * s, bias, smooth_inv=1.0 / s)

    def run(self, progress: bool, fold_only: bool) -> None:
        from tqdm import tqdm
        layers = self.model.layers
        bar = tqdm(total=len(layers), desc=f"quantize {self.qcfg.method}", unit="layer", disable=not progress)
        for i, layer in enumerate(layers):
            if self.qcfg.method == "awq":
                self.awq_fold(layer)
            for name in LAYER_LINEARS:
                if fold_only and self.qcfg.method == "awq":
                    break
                bar.set_postfix_str(f"layer {i} {name.split('.')[-1]}")
                st = self.capture(layer, [name], stop=True)[name]
                if fold_only:      # smoothquant: fold what is foldable, keep the float projections
                    if name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
                        lin = layer.get_submodule(name)
                        norm = layer.input_layernorm if name.startswith("self_attn") else layer.post_attention_layernorm
                        fold_into_norm(norm, lin, smoothquant_scales(st.absmax, lin.weight.float(), self.qcfg.alpha))
                    continue
                replace_module(layer, name, self.quantize_one(layer, name, st))
            with torch.no_grad():
                self.hidden = [self._forward(layer, x, meta, pos) for x, (_, meta, pos) in zip(self.hidden, self.batches)]
            bar.update(1)
        bar.close()
        if self.qcfg.quantize_lm_head and not fold_only:
            self._lm_head()

    def _lm_head(self) -> None:
        head = self.model.lm_head
        st = _Stats(head.in_features, self.qcfg.method, self.awq_max_rows, self.total_rows)
        with torch.no_grad():
            for x in self.hidden:
                st.add(self.model.norm(x))
        qcfg, w = self.qcfg, head.weight.detach().float()
        gs = group_size_for(qcfg, head.in_features)
        if qcfg.method == "gptq":
            mod: nn.Module = Int4Linear(_fp16_scales(gptq_quantize(w, st.hessian.hessian(), 4, gs, qcfg.damp_percent,
                                                                   GPTQ_BLOCK, qcfg.act_order)), None)
        elif qcfg.method == "awq":      # no scale: the final norm's weight cannot absorb it when tied
            mod = Int4Linear(_fp16_scales(awq_quantize(w, st.x(), 4, gs, search_scale=False)[0]), None)
        else:
            s = smoothquant_scales(st.absmax, w, qcfg.alpha)
            mod = Int8Linear.from_float(w * s, None, smooth_inv=1.0 / s)
        replace_module(self.model, "lm_head", mod)


def smoothquant_scales(x_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α) over input channels j (both clamped away from 0)."""
    xm = x_absmax.float().clamp(min=1e-5)
    wm = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (xm.pow(alpha) / wm.pow(1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def fold_into_norm(norm: nn.Module, linear: nn.Linear, s: torch.Tensor) -> None:
    """norm.weight /= s, linear.weight *= s (columns): linear(norm(x)) is unchanged."""
    norm.weight.div_(s.to(norm.weight.dtype))
    linear.weight.mul_(s.to(linear.weight.dtype)[None, :])


@torch.no_grad()
def fold_into_up_rows(gate_up: nn.Linear, down: nn.Linear, s: torch.Tensor) -> None:
    """up rows (second half of gate_up) /= s, down.weight *= s (columns): down(silu(g)·u) unchanged."""
    inter = gate_up.out_features // 2
    gate_up.weight[inter:].div_(s.to(gate_up.weight.dtype)[:, None])
    down.weight.mul_(s.to(down.weight.dtype)[None, :])


@torch.no_grad()
def quantize_calibrated(model: nn.Module, sequences: list[list[int]], qcfg: QuantConfig, *,
                        max_batch_tokens: int = 4096, awq_max_rows: int = 4096, progress: bool = True,
                        fold_only: bool = False) -> None:
    """Quantize a float32 LlamaForCausalLM in place with GPTQ, AWQ or SmoothQuant, calibrated on
    `sequences` (token id lists). `fold_only` applies AWQ / SmoothQuant's scale folding but keeps
    the float projections (the float function must not change: a test hook)."""
    if qcfg.method not in CALIBRATED_METHODS:
        raise ValueError(f"{qcfg.method} needs no calibration; use quant.apply.quantize_model")
    if model.cfg.architecture not in ("llama", "qwen2"):
        # the calibrator replays Llama's layer (one rope, plain embeddings, two norms per block)
        raise ValueError(f"{qcfg.method} calibration supports llama and qwen2 models, not {model.cfg.architecture}")
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("calibration needs at least one non-empty sequence")
    _Calibrator(model, sequences, qcfg, max_batch_tokens, awq_max_rows).run(progress, fold_only)
