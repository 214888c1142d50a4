"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch/transformers; import it only when asked for.
    if name == "LLM":
        from tokenmill.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
