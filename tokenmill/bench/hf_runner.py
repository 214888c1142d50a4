"""Baseline: HF transformers `generate` with static, left-padded batches."""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from tokenmill.bench.sharegpt import Request


class HFRunner:
    """Greedy generation with `AutoModelForCausalLM.generate`; every call returns wall seconds."""

    name = "hf"

    def __init__(self, model_path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw: dict[str, Any] = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
        root = model_path.parent if model_path.suffix == ".gguf" else model_path
        self.tokenizer = AutoTokenizer.from_pretrained(root, **kw)
        # From a GGUF, transformers keeps the weights packed and dequantizes them in fp32 inside
        # every matmul unless asked for fp32; load dense fp32 and cast, so HF runs real `dtype`
        # GEMMs on the same dequantized weights tokenmill uses.
        self.model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, **kw).eval().to(dtype)
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else int(self.tokenizer.eos_token_id or 0)
        # ignore_eos like tokenmill: EOS may be generated but never stops a row. (min_new_tokens
        # would instead mask the EOS logit and change the greedy continuation.)
        self.model.generation_config.eos_token_id = None

    def _generate(self, batch: Sequence[list[int]], new_tokens: int) -> tuple[torch.Tensor, float]:
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):  # left padding
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        start = time.perf_counter()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      do_sample=False, temperature=None,
                                      top_p=None, top_k=None, pad_token_id=self.pad_id)
        return out[:, width:], time.perf_counter() - start

    def throughput(self, requests: Sequence[Request], batch_size: int) -> float:
        """Static batches in the given order; each batch runs to its longest requested output."""
        total = 0.0
        for i in range(0, len(requests), batch_size):
            chunk = requests[i:i + batch_size]
            new = max(r.output_len for r in chunk)
            out, secs = self._generate([r.prompt_token_ids for r in chunk], new)
            assert out.shape[1] == new, f"HF generated {out.shape[1]} tokens, asked for {new}"
            total += secs
        return total

    def decode(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        out, secs = self._generate([prompt_ids], new_tokens)
        return secs, out[0].tolist()

    def prefill(self, prompt_ids: list[int]) -> float:
        return self._generate([prompt_ids], 1)[1]
