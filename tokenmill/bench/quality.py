"""`tokenmill bench quality`: what a weight or KV-cache format costs in model quality, through the engine.

Two measures per variant (a model, optionally with a quantization method and a KV-cache dtype):
- perplexity on held-out ShareGPT text (conversations >= HELD_OUT_START, never used for
  calibration), from the engine's own prompt_logprobs=0, on the same token chunks for all;
- greedy agreement with the first variant: share of prompts whose first N greedy tokens are
  identical, and the mean length of the common prefix.
"""
from __future__ import annotations

import argparse
import datetime
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.report import common_prefix, write_json
from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.sharegpt import HELD_OUT_START, Conversation, load_sharegpt
from tokenmill.sampling_params import SamplingParams

MAX_AGREE_PROMPT_TOKENS = 256


@dataclass(slots=True)
class Variant:
    label: str
    model: str
    quantization: str | None = None
    kv_cache_dtype: str | None = None


@dataclass(slots=True)
class VariantResult:
    label: str
    model: str
    quantization: str | None
    kv_cache_dtype: str | None
    weight_bytes: int | None
    ppl: float
    nll_sum: float
    predicted_tokens: int
    agreement: float | None          # None for the reference (first) variant
    mean_common_prefix: float | None
    seconds: float


def parse_variants(spec: str | None, model: str) -> list[Variant]:
    """`label=MODEL[@METHOD][:kv=KV_DTYPE]`, comma-separated; default `float=<model>`."""
    out = []
    for item in (spec or f"float={model}").split(","):
        label, sep, target = item.strip().partition("=")
        if not sep or not label or not target:
            raise ValueError(f"variant {item!r} is not label=MODEL[@METHOD][:kv=KV_DTYPE]")
        target, _, kv = target.partition(":kv=")
        name, _, method = target.partition("@")
        out.append(Variant(label, name, method or None, kv or None))
    if len({v.label for v in out}) != len(out):
        raise ValueError("variant labels must be unique")
    return out


def eval_chunks(tokenizer: Any, held_out: list[Conversation], eval_tokens: int, chunk_tokens: int,
                seed: int) -> list[list[int]]:
    """Token chunks (each <= chunk_tokens, >= 2 tokens) of whole conversations (turns joined by
    a blank line, BOS as the tokenizer adds it), in a seeded order, until they hold >=
    eval_tokens predicted tokens (every token but each chunk's first)."""
    order = list(range(len(held_out)))
    random.Random(seed).shuffle(order)
    chunks: list[list[int]] = []
    predicted = 0
    for idx in order:
        ids = list(tokenizer(held_out[idx].plain_text())["input_ids"])
        for i in range(0, len(ids), chunk_tokens):
            chunk = ids[i:i + chunk_tokens]
            if len(chunk) < 2:
                continue
            chunks.append(chunk)
            predicted += len(chunk) - 1
            if predicted >= eval_tokens:
                return chunks
    raise ValueError(f"held-out conversations hold only {predicted} tokens, fewer than {eval_tokens}")


def perplexity(llm: Any, chunks: list[list[int]]) -> tuple[float, float, int]:
    """(PPL, total NLL, predicted tokens) from the engine's prompt logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    lps = [e.logprob for o in outs for e in o.prompt_logprobs[1:]]
    nll = -math.fsum(lps)
    return math.exp(nll / len(lps)), nll, len(lps)


def agreement_prompts(tokenizer: Any, held_out: list[Conversation], n: int, seed: int) -> list[list[int]]:
    """First user turns with the chat template applied (the plain text for a base model without
    one, e.g. Gemma 3 270M); prompts over 256 tokens are skipped (cutting one would drop the
    generation prompt at its end)."""
    order = list(range(len(held_out)))
    random.Random(seed + 1).shuffle(order)
    out: list[list[int]] = []
    for idx in order:
        turns = held_out[idx].turns
        if not turns or turns[0][0] != "human" or not turns[0][1].strip():
            continue
        if getattr(tokenizer, "chat_template", None):
            ids = list(tokenizer.apply_chat_template([{"role": "user", "content": turns[0][1]}], tokenize=True,
                                                     add_generation_prompt=True, return_dict=False))
        else:
            ids = list(tokenizer(turns[0][1])["input_ids"])
        if len(ids) <= MAX_AGREE_PROMPT_TOKENS:
            out.append(ids)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} of {n} held-out prompts fit {MAX_AGREE_PROMPT_TOKENS} tokens")


def greedy(llm: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def greedy_agreement(ref: list[list[int]], other: list[list[int]], num_tokens: int) -> tuple[float, float]:
    """(share of prompts whose first num_tokens tokens are identical, mean common prefix)."""
    prefixes = [min(common_prefix(a, b), num_tokens) for a, b in zip(ref, other, strict=True)]
    return sum(p == num_tokens for p in prefixes) / len(prefixes), sum(prefixes) / len(prefixes)


def _llm(v: Variant, args: argparse.Namespace, max_model_len: int) -> Any:
    from tokenmill.llm import LLM
    extra = {"quantization": v.quantization} if v.quantization else {}   # only when asked: older configs lack it
    if v.kv_cache_dtype:
        extra["kv_cache_dtype"] = v.kv_cache_dtype
    if args.max_num_batched_tokens:
        extra.update(max_num_batched_tokens=args.max_num_batched_tokens,
                     max_idle_batched_tokens=args.max_num_batched_tokens)
    return LLM(model=v.model, dtype=args.dtype, max_model_len=max_model_len, num_threads=args.threads,
               enable_prefix_caching=False, **extra)


def format_table(results: list[VariantResult]) -> str:
    base = results[0].ppl
    lines = [f"{'variant':<14} {'weights MB':>10} {'PPL':>9} {'dPPL %':>7} {'agree %':>8} {'prefix':>7} {'s':>7}",
             "-" * 68]
    for r in results:
        wb = f"{r.weight_bytes / 1e6:.1f}" if r.weight_bytes else "-"
        d = "-" if r is results[0] else f"{100 * (r.ppl / base - 1):+.2f}"
        ag = "-" if r.agreement is None else f"{100 * r.agreement:.1f}"
        cp = "-" if r.mean_common_prefix is None else f"{r.mean_common_prefix:.1f}"
        lines.append(f"{r.label:<14} {wb:>10} {r.ppl:>9.3f} {d:>7} {ag:>8} {cp:>7} {r.seconds:>7.1f}")
    return "\n".join(lines)


def run_quality_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.hub import resolve_model
    from tokenmill.model.loader import load_tokenizer

    torch.set_num_threads(args.threads)
    variants = parse_variants(args.variants, args.model)
    machine = machine_info()
    print(machine_header(), flush=True)
    tok = load_tokenizer(resolve_model(variants[0].model))
    held_out = load_sharegpt()[HELD_OUT_START:]
    chunks = eval_chunks(tok, held_out, args.eval_tokens, args.chunk_tokens, args.seed)
    prompts = agreement_prompts(tok, held_out, args.agree_prompts, args.seed)
    max_len = max(args.chunk_tokens + 1, MAX_AGREE_PROMPT_TOKENS + args.agree_tokens)
    results: list[VariantResult] = []
    ref_tokens: list[list[int]] = []
    for v in variants:
        t0 = time.perf_counter()
        llm = _llm(v, args, max_len)
        ppl, nll, n = perplexity(llm, chunks)
        tokens = greedy(llm, prompts, args.agree_tokens)
        agree = prefix = None
        if results:
            agree, prefix = greedy_agreement(ref_tokens, tokens, args.agree_tokens)
        else:
            ref_tokens = tokens
        results.append(VariantResult(v.label, v.model, v.quantization, v.kv_cache_dtype,
                                     getattr(llm.engine.runner, "weight_bytes", None),
                                     ppl, nll, n, agree, prefix, time.perf_counter() - t0))
        print(f"[quality {time.strftime('%H:%M:%S')}] {v.label}: PPL {ppl:.3f} over {n} tokens, "
              f"agreement {agree}, mean common prefix {prefix}", flush=True)
        del llm
        doc = _write(args, machine, len(chunks), results)    # after every variant: long runs keep what they measured
    print(f"\nheld-out ShareGPT quality: {len(chunks)} chunks, {results[0].predicted_tokens} predicted tokens; "
          f"greedy agreement on {len(prompts)} prompts x {args.agree_tokens} tokens, {args.dtype}\n")
    print(doc["table"], flush=True)
    print(f"wrote {_output_path(args)}")
    return doc


def _output_path(args: argparse.Namespace) -> Path:
    return Path(args.output_json or f"benchmarks/results/quality_{Path(args.model).stem}.json")


def _write(args: argparse.Namespace, machine: dict, num_chunks: int, results: list[VariantResult]) -> dict:
    doc = {"benchmark": "quality", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "config": {k: v for k, v in vars(args).items() if k != "func"}, "machine": machine,
           "held_out_start": HELD_OUT_START, "num_chunks": num_chunks,
           "results": [asdict(r) for r in results], "table": format_table(results)}
    write_json(_output_path(args), doc)
    return doc
