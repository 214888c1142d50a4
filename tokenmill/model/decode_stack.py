"""All decoder layers of a pure-decode CPU step in one C++ call (csrc/decode_stack.cpp).

The eager layers spend as long in Python and op dispatch as in their matmuls at batch 1; the
stack runs the same kernels, in the same order, on the same tensors (held, not copied) and gives
the same bits. A linear joins the stack by describing itself: `nn.Linear` as a dense matmul, a
quantized layer through its `stack_linear(ext, dtype)` (None = it cannot, e.g. SmoothQuant's
smoothing, NF4, LoRA wrappers). One linear that cannot keeps the whole model on the eager path.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from tokenmill.cpu_extension import kernel_family
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.cpu_kernels import dense_small_m_kernels
from tokenmill.model.layers import Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.quant.kv_cache import KVCache

@functools.cache
def decode_stack_kernels() -> ModuleType | None:
    return kernel_family("decode_stack")


def _stack_linear(module: nn.Module, ext: ModuleType, dtype: torch.dtype):
    if type(module) in (nn.Linear, Linear):
        return ext.Linear.dense(module.weight, module.bias, dense_small_m_kernels() is not None)
    describe = getattr(module, "stack_linear", None)
    return None if describe is None else describe(ext, dtype)


class DecodeStack:
    """The C++ stack of a model's decoder layers; `build` returns None where it cannot apply."""

    def __init__(self, stack, dtype: torch.dtype) -> None:
        self._stack, self.max_rows, self.dtype = stack, stack.max_rows, dtype
        self.suspended = False     # set for a step whose rows need more than the base weights (LoRA)

    @classmethod
    def build(cls, model: nn.Module) -> "DecodeStack | None":
        """For a Llama-family model (full attention, no q/k norm) on CPU whose every linear can
        join, else None."""
        ext = decode_stack_kernels()
        dtype = model.norm.weight.dtype
        if (ext is None or model.norm.weight.device.type != "cpu" or type(model) is not LlamaForCausalLM
                or model.cfg.sliding_window is not None or model.layers[0].self_attn.q_norm is not None):
            return None
        eps = model.layers[0].input_layernorm.eps
        if model.rope.cos.dtype != torch.float32 or any(
                norm.eps != eps for l in model.layers for norm in (l.input_layernorm, l.post_attention_layernorm)):
            return None
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_stack_linear(m, ext, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(lin is None for lin in linears):
                return None
            layers.append(ext.Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *linears))
        attn = model.layers[0].self_attn
        stack = ext.DecoderStack(layers, eps, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                                 model.rope.cos, model.rope.sin)
        return cls(stack, dtype)

    def applies(self, x: torch.Tensor, kv_caches: list[KVCache],
                metas: list[AttentionMetadata]) -> bool:
        """A pure-decode step (no prefill chunk) with rows the stack's kernels take, no autograd,
        a float K/V cache in the model's dtype, one KV group."""
        meta = metas[0]
        return (not self.suspended and not meta.prefills and all(m is meta for m in metas) and meta.num_decode_tokens == x.shape[0] <= self.max_rows
                and not torch.is_grad_enabled() and kv_caches[0].k.dtype == self.dtype and kv_caches[0].k_scale is None)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor:
        return self._stack.decode(x, positions, [c.k for c in kv_caches], [c.v for c in kv_caches],
                                  meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
