"""Multi-LoRA on the real SmolLM2 with the committed demo adapter (`tokenmill lora-train`):
it does what it was trained for, equals its own merge into the weights, and mixes with another
adapter and the base in one batch."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.lora.adapter import load_adapter
from tokenmill.lora.peft_format import random_adapter

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[1] / "adapters" / "smollm2-135m-uppercase"
# held out: the adapter was trained on ShareGPT first turns, not on these
QUESTIONS = ["What is the capital of France?", "Give me two tips for sleeping better.",
             "Explain what a binary search does."]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct", dtype="float32", max_model_len=512, kv_cache_memory=64 << 20,
               enable_lora=True, max_loras=2, enable_prefix_caching=False)   # K/V always from this batch


def chat_prompts(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                             add_generation_prompt=True, return_dict=False))}
            for q in QUESTIONS]


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def test_demo_adapter_answers_in_uppercase(llm):
    demo = LoRARequest("upper", 1, str(DEMO))
    loras = [demo, None] * len(QUESTIONS)
    prompts = [p for p in chat_prompts(llm) for _ in range(2)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False, lora_request=loras)
    adapted, base = [o.outputs[0].text for o in outs[0::2]], [o.outputs[0].text for o in outs[1::2]]
    assert all(upper_share(t) > 0.9 for t in adapted), adapted
    assert all(upper_share(t) < 0.3 for t in base), base


@torch.no_grad()
def merge_into_weights(llm: LLM, adapter_path: Path) -> None:
    """W += scaling * B A on each adapted slice of the fused base projections, in place."""
    lora = llm.engine.lora
    adapter = load_adapter("m", adapter_path, llm.engine.model_config, lora.max_lora_rank)
    for name, layer in lora.layers.items():
        row = 0
        for size, w in zip(layer.slice_sizes, adapter.slices(name)):
            if w is not None:
                layer.base.weight[row:row + size] += w.scaling * (w.b @ w.a)
            row += size


def test_adapter_equals_merged_weights_and_mixes_like_alone(llm, tmp_path):
    prompts = chat_prompts(llm)
    other = LoRARequest("rnd", 2, str(random_adapter(tmp_path / "rnd", llm.engine.model_config, 16, seed=7)))
    demo = LoRARequest("upper", 1, str(DEMO))
    loras = [demo, other, None]
    mixed = llm.generate(prompts * 3, GREEDY, use_tqdm=False, lora_request=[r for r in loras for _ in prompts])
    mixed = [o.outputs[0].token_ids for o in mixed]
    alone = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
             for r in loras for p in prompts]
    assert mixed == alone
    merge_into_weights(llm, DEMO)              # the base is now base + demo adapter
    merged = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert merged == mixed[:len(prompts)]
