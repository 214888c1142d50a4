"""`tokenmill bench spec`: batch-1 decode speed of one target model with and without speculative
decoding, every variant in the same run.

One engine is loaded (the target, plus the draft model when a variant needs it); variants swap
the engine's SpeculativeDecoder, sharing the draft's weights and KV pool, so no variant gets a
warmer or colder model than another. Each repeat runs every variant in a rotated order over the
same chat-templated code prompts, one request at a time (greedy, `--max-tokens` each, EOS
honoured). Reported per variant: output tok/s (tokens / wall time, prefill included), the
median of the per-repeat ratios to "none", acceptance rate and mean acceptance length.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from tokenmill.bench.code_prompts import CODE_PROMPTS
from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.report import write_json
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.decoder import SpeculativeDecoder
from tokenmill.spec.proposers import NgramProposer


def _log(msg: str) -> None:
    print(f"[spec {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_spec_variants(text: str) -> list[tuple[str, str | None, int]]:
    """"none,draft:4,ngram:4" -> [(label, method or None, k)]."""
    out = []
    for item in text.split(","):
        name, _, k = item.strip().partition(":")
        if name == "none":
            out.append(("none", None, 0))
        elif name in ("draft", "ngram") and k.isdigit() and int(k) >= 1:
            out.append((f"{name}-k{k}", "draft_model" if name == "draft" else "ngram", int(k)))
        else:
            raise ValueError(f"bad variant {item!r}: none | draft:K | ngram:K")
    return out


def _decoders(engine: LLMEngine, variants, args) -> dict[str, SpeculativeDecoder | None]:
    draft = engine.spec.proposer if engine.spec is not None else None
    out: dict[str, SpeculativeDecoder | None] = {}
    for label, method, k in variants:
        if method is None:
            out[label] = None
        elif method == "ngram":
            cfg = SpeculativeConfig("ngram", k, prompt_lookup_min=args.prompt_lookup_min,
                                    prompt_lookup_max=args.prompt_lookup_max)
            out[label] = SpeculativeDecoder(cfg, NgramProposer(cfg), engine.sampler, engine.max_model_len)
        else:
            cfg = dataclasses.replace(engine.spec.config, num_speculative_tokens=k)
            out[label] = SpeculativeDecoder(cfg, draft, engine.sampler, engine.max_model_len)
    return out


def _run_prompts(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, t0 = 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    return tokens, time.perf_counter() - t0


def run_spec_bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    variants = parse_spec_variants(args.variants)
    spec_cfg = None
    if any(m == "draft_model" for _, m, _ in variants):
        spec_cfg = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 1,
                    **({"quantization": args.draft_quantization} if args.draft_quantization else {})}
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                    kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
                                    num_threads=args.threads, enable_prefix_caching=False,
                                    speculative_config=spec_cfg))
    decoders = _decoders(engine, variants, args)
    tok = engine.tokenizer
    if tok.chat_template:
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False))
                   for p in CODE_PROMPTS[:args.num_prompts]]
    else:                                                  # a base model: the task text as it is
        prompts = [engine.tokenize(p) for p in CODE_PROMPTS[:args.num_prompts]]
    labels = [v[0] for v in variants]
    engine.spec = None
    _run_prompts(engine, prompts[:1], 8)                    # warm-up
    results: dict[str, dict[str, list[float]]] = {l: {"tok_s": [], "accept": [], "mean_len": []} for l in labels}
    for rep in range(args.repeats):
        order = labels[rep % len(labels):] + labels[:rep % len(labels)]
        for label in order:
            dec = decoders[label]
            engine.spec = dec
            before = dataclasses.replace(dec.stats) if dec is not None else None
            tokens, secs = _run_prompts(engine, prompts, args.max_tokens)
            results[label]["tok_s"].append(tokens / secs)
            if dec is not None:
                drafts = dec.stats.num_drafts - before.num_drafts
                proposed = dec.stats.num_draft_tokens - before.num_draft_tokens
                accepted = dec.stats.num_accepted_tokens - before.num_accepted_tokens
                results[label]["accept"].append(accepted / proposed if proposed else 0.0)
                results[label]["mean_len"].append(1 + accepted / drafts if drafts else 1.0)
            _log(f"repeat {rep + 1} {label}: {tokens} tokens in {secs:.1f} s = {tokens / secs:.2f} tok/s")
    base = results.get("none", {}).get("tok_s")
    print(f"\n{'variant':<12} {'decode tok/s':>13} {'vs none':>8} {'accept %':>9} {'mean len':>9}")
    rows = []
    for label in labels:
        r = results[label]
        ratio = statistics.median(a / b for a, b in zip(r["tok_s"], base)) if base else None
        acc = statistics.median(r["accept"]) if r["accept"] else None
        mlen = statistics.median(r["mean_len"]) if r["mean_len"] else None
        rows.append({"variant": label, "tok_s": statistics.median(r["tok_s"]), "ratio_vs_none": ratio,
                     "acceptance_rate": acc, "mean_acceptance_length": mlen, "per_repeat": r})
        print(f"{label:<12} {rows[-1]['tok_s']:>13.2f} {'' if ratio is None else f'{ratio:.2f}x':>8} "
              f"{'-' if acc is None else f'{100 * acc:.1f}':>9} {'-' if mlen is None else f'{mlen:.2f}':>9}")
    result = {"machine": machine_info(), "args": {k: str(v) if hasattr(v, "__fspath__") else v
                                                 for k, v in vars(args).items() if k != "func"},
              "rows": rows}
    if args.output_json:
        write_json(args.output_json, result)
    return result
