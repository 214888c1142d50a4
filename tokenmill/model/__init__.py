"""Model code: loaders, layers, attention and the decoder architectures."""
from __future__ import annotations

from torch import nn


def causal_lm_class(architecture: str) -> type[nn.Module]:
    """The model class of a ModelConfig.architecture."""
    from tokenmill.model.gemma3 import Gemma3ForCausalLM
    from tokenmill.model.llama import LlamaForCausalLM
    classes = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM}
    if architecture not in classes:
        raise ValueError(f"no model class for architecture {architecture!r}")
    return classes[architecture]
