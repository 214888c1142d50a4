"""Train a small LoRA adapter in-process: the demo adapter `adapters/smollm2-135m-uppercase`.

Task "uppercase": answer as the base model would, in capital letters. Data is the base model's
own greedy answers (generated here with tokenmill) to first user turns of ShareGPT's
calibration slice, upper-cased; the adapter learns the style, not new facts. The loop is ours:
LoRA modules (A random, B zero, as PEFT initialises them) over transformers' implementation of
the same model, AdamW on A and B only, loss on answer tokens. Output is PEFT's format.

    tokenmill lora-train --out adapters/smollm2-135m-uppercase
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from tokenmill.bench.sharegpt import CALIBRATION_END, load_sharegpt
from tokenmill.lora.peft_format import save_adapter

log = logging.getLogger("tokenmill")


@dataclass
class TrainConfig:
    model: str = "smollm2-135m-instruct"
    out: str = "adapters/smollm2-135m-uppercase"
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-3
    num_examples: int = 240
    max_prompt_tokens: int = 40
    max_answer_tokens: int = 40
    seed: int = 0


class TrainableLoRA(nn.Module):
    """base(x) + scaling * B(A(x)) with the base frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.empty(rank, base.in_features))
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T @ self.b.T) * self.scaling


def uppercase_examples(cfg: TrainConfig) -> list[tuple[list[int], list[int]]]:
    """(chat prompt ids, upper-cased answer ids + end of turn) from the base model's answers."""
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams
    llm = LLM(cfg.model, max_model_len=512)
    tok = llm.get_tokenizer()
    questions = []
    for conv in load_sharegpt(limit=CALIBRATION_END):
        if conv.turns and conv.turns[0][0] == "human":
            text = conv.turns[0][1].strip()
            if text and len(tok(text)["input_ids"]) <= cfg.max_prompt_tokens:
                questions.append(text)
        if len(questions) == cfg.num_examples:
            break
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                    SamplingParams(max_tokens=cfg.max_answer_tokens, temperature=0), use_tqdm=False)
    end_of_turn = llm.engine.eos_token_ids[0]
    examples = []
    for out in outs:
        answer = out.outputs[0].text.strip().upper()
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        if answer and out.outputs[0].finish_reason == "stop":
            ids = ids + [end_of_turn]          # complete answers teach where to stop
        if ids:
            examples.append((list(out.prompt_token_ids), ids))
    return examples


def load_hf_model(model: str) -> nn.Module:
    """transformers' implementation of the same GGUF, in fp32."""
    from transformers import AutoModelForCausalLM

    from tokenmill.hub import resolve_model
    from tokenmill.model.loader import fast_gguf_reader_class
    path = resolve_model(model)
    with mock.patch("gguf.GGUFReader", fast_gguf_reader_class()):
        if path.suffix == ".gguf":
            return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def add_lora(model: nn.Module, cfg: TrainConfig) -> dict[str, TrainableLoRA]:
    model.requires_grad_(False)
    wrapped = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in cfg.targets and ".layers." in name:
            parent, _, child = name.rpartition(".")
            lora = TrainableLoRA(module, cfg.rank, cfg.alpha)
            setattr(model.get_submodule(parent), child, lora)
            wrapped[name] = lora
    return wrapped


def batch_tensors(examples: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, a) in enumerate(examples):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train(cfg: TrainConfig) -> Path:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    t0 = time.perf_counter()
    examples = uppercase_examples(cfg)
    log.info("%d examples from the base model's answers in %.0fs", len(examples), time.perf_counter() - t0)
    model = load_hf_model(cfg.model)
    loras = add_lora(model, cfg)
    params = [p for m in loras.values() for p in (m.a, m.b)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    pad = model.config.pad_token_id or 0
    order: list[int] = []
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch = [examples[order.pop()] for _ in range(cfg.batch_size)]
        loss = model(**batch_tensors(batch, pad)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == cfg.steps - 1:
            log.info("step %d/%d loss %.4f (%.0fs)", step + 1, cfg.steps, loss.item(), time.perf_counter() - t0)
    # bf16 storage keeps the committed demo adapter small (tokenmill computes in the model dtype)
    weights = {name: (m.a, m.b) for name, m in loras.items()}
    out = save_adapter(cfg.out, weights, cfg.rank, cfg.alpha, base_model=cfg.model, dtype=torch.bfloat16)
    log.info("adapter (%d parameters) saved to %s", sum(a.numel() + b.numel() for a, b in weights.values()), out)
    return out
