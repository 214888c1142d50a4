"""HF transformers fp32 greedy reference for the real-model parity tests."""
from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(gguf_path: Path, prompts: list[str], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation) of every prompt, by transformers loading the same GGUF
    in fp32 and decoding token by token with its own KV cache."""
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from tokenmill.model.loader import fast_gguf_reader_class, load_tokenizer
    # the same transformers tokenizer built from the GGUF, cached by tokenmill (building it takes
    # ~1 min for Gemma 3's 262k vocabulary)
    tok = load_tokenizer(gguf_path)
    # the same parse, 3x faster (transformers reads the GGUF twice)
    with mock.patch("gguf.GGUFReader", fast_gguf_reader_class()):
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt)["input_ids"]
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            new = []
            for _ in range(new_tokens):
                nxt = int(out.logits[0, -1].argmax())
                new.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
            refs.append((ids, new))
    return refs
