"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""
import os

# libgomp (torch's OpenMP) reads its spin policy once, when torch loads, so it is set here,
# before any torch import. Its default spins 300k rounds between parallel regions: fastest on
# idle cores, 1.9x slower at batch 16 next to two busy neighbours (benchmarks/thread_policy.py);
# PASSIVE is 1.6x slower at batch 1 on idle cores. 50k spins kept the idle-machine speed and cut
# the busy-machine loss. An explicit OMP_WAIT_POLICY / GOMP_SPINCOUNT from the user wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "50000")

from tokenmill.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch/transformers; import it only when asked for.
    if name == "LLM":
        from tokenmill.llm import LLM
        return LLM
    if name == "LoRARequest":
        from tokenmill.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
