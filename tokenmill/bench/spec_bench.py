"""`tokenmill bench spec`: batch-1 decode speed of one target model with and without speculative
decoding, every variant in the same run.

One engine is loaded (the target, plus the draft model when a variant needs it); variants swap
the engine's SpeculativeDecoder, sharing the draft's weights and KV pool, so no variant gets a
warmer or colder model than another. Each repeat runs every variant in a rotated order over the
same chat-templated code prompts, one request at a time (greedy, `--max-tokens` each, EOS
honoured). Reported per variant: output tok/s (tokens / wall time, prefill included), the
median of the per-repeat ratios to "none", acceptance rate and mean acceptance length.

`--concurrency 1,2,4,8,16` repeats that for c streams in a closed loop (a new request enters as
one finishes; max(num_prompts, c) requests per point), which draws the throughput-vs-
concurrency curve; a variant like `draft:4/b4` sets `disable_by_batch_size` 4, and the "off %"
column is the share of decode steps in which no sequence drafted (switched off by that limit, or
by adaptive k where the measured round costs at that batch say drafts do not pay).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from tokenmill.bench.code_prompts import CODE_PROMPTS, PROSE_PROMPTS
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


@dataclasses.dataclass(frozen=True, slots=True)
class SpecVariant:
    label: str
    method: str | None         # None = no speculation; "llama.cpp" = the llama-server anchor
    k: int = 0                 # drafts per round (the most, when adaptive); llama.cpp: --spec-draft-n-max, 0 = no draft
    adaptive: bool = False
    disable_by_batch_size: int | None = None    # no drafts in a step with more running sequences


def parse_spec_variants(text: str) -> list[SpecVariant]:
    """"none,draft:4,draft:auto:6,ngram:4,llama.cpp,llama.cpp:4" -> variants; auto = adaptive k up
    to K; llama.cpp:K = llama-server with the draft GGUF (-md, --spec-draft-n-max K). A draft or
    n-gram variant may end in /bN: speculation off in steps with more than N running sequences."""
    out = []
    for item in text.split(","):
        item, _, limit = item.strip().partition("/b")
        parts = item.split(":")
        adaptive = len(parts) == 3 and parts[1] == "auto"
        k = parts[-1]
        if limit and not (parts[0] in ("draft", "ngram") and limit.isdigit() and int(limit) >= 1):
            raise ValueError(f"bad variant {item}/b{limit!r}: /bN needs a draft or ngram variant and N >= 1")
        if parts == ["none"]:
            out.append(SpecVariant("none", None))
        elif parts == ["llama.cpp"]:
            out.append(SpecVariant("llama.cpp", "llama.cpp"))
        elif parts[0] == "llama.cpp" and len(parts) == 2 and k.isdigit() and int(k) >= 1:
            out.append(SpecVariant(f"llama.cpp-draft{k}", "llama.cpp", int(k)))
        elif parts[0] in ("draft", "ngram") and (len(parts) == 2 or adaptive) and k.isdigit() and int(k) >= 1:
            label = f"{parts[0]}-{'auto' if adaptive else 'k'}{k}" + (f"-b{limit}" if limit else "")
            out.append(SpecVariant(label, "draft_model" if parts[0] == "draft" else "ngram", int(k), adaptive,
                                   int(limit) if limit else None))
        else:
            raise ValueError(f"bad variant {item!r}: none | draft:K | draft:auto:K | ngram:K | ngram:auto:K | "
                             f"llama.cpp | llama.cpp:K, draft/ngram optionally /bN")
    return out


def _decoders(engine: LLMEngine, variants: list[SpecVariant], args) -> dict[str, SpeculativeDecoder | None]:
    out: dict[str, SpeculativeDecoder | None] = {}
    for v in variants:
        if v.method in (None, "llama.cpp"):
            out[v.label] = None
        elif v.method == "ngram":
            cfg = SpeculativeConfig("ngram", v.k, prompt_lookup_min=args.prompt_lookup_min,
                                    prompt_lookup_max=args.prompt_lookup_max, adaptive_k=v.adaptive,
                                    disable_by_batch_size=v.disable_by_batch_size)
            out[v.label] = SpeculativeDecoder(cfg, NgramProposer(cfg), engine.sampler, engine.max_model_len)
        else:           # every draft variant shares the engine's draft model and its KV pool
            cfg = dataclasses.replace(engine.spec.config, num_speculative_tokens=v.k, adaptive_k=v.adaptive,
                                      disable_by_batch_size=v.disable_by_batch_size)
            out[v.label] = SpeculativeDecoder(cfg, engine.spec.proposer, engine.sampler, engine.max_model_len,
                                              draft_cost=engine.spec.draft_cost)
        costs = out[v.label].calibrate(engine.runner, engine.block_manager) if out[v.label] else None
        if costs:
            _log(f"{v.label}: round cost by k (in plain steps) " + " ".join(f"{c:.2f}" for c in costs) +
                 f"; drafts pay up to {out[v.label].max_paying_batch()} decoding sequences")
    return out


class LlamaServerSpec:
    """llama-server on the target's GGUF (and the draft's for -md), one slot, driven with the same
    token ids, greedy, EOS honoured, no prompt cache; timed by wall clock like the engine."""

    def __init__(self, args, k: int, port: int) -> None:
        from tokenmill.bench.anchors import ManagedServer, llama_server_spec
        from tokenmill.hub import resolve_model
        spec = llama_server_spec(args.llama_server, resolve_model(args.model), port, 1, args.max_model_len,
                                 args.threads)
        if k:
            spec.cmd += ["-md", str(resolve_model(args.draft)), "--spec-draft-n-max", str(k)]
        self.server = ManagedServer(spec).__enter__()
        import httpx
        self.client = httpx.Client(base_url=spec.base_url, timeout=None, trust_env=False)
        self.drafted = self.accepted = 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        tokens, t0 = 0, time.perf_counter()
        for prompt in prompts:
            r = self.client.post("/completion", json={"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                                                      "top_k": 1, "cache_prompt": False, "stream": False})
            r.raise_for_status()
            body = r.json()
            tokens += body.get("tokens_predicted", 0)
            timings = body.get("timings", {})
            self.drafted += timings.get("draft_n", 0)
            self.accepted += timings.get("draft_n_accepted", 0)
        return tokens, time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def _run_prompts(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
                 concurrency: int = 1) -> tuple[int, float]:
    """Closed loop: `concurrency` requests in flight, the next prompt enters as one finishes."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, in_flight, t0 = 0, 0, time.perf_counter()
    waiting = list(enumerate(prompts))
    while waiting or engine.has_unfinished_requests():
        while waiting and in_flight < concurrency:
            i, prompt = waiting.pop(0)
            engine.add_request(f"p{i}", prompt, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                in_flight -= 1
    return tokens, time.perf_counter() - t0


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_spec_bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    variants = parse_spec_variants(args.variants)
    spec_cfg = None
    if any(v.method == "draft_model" for v in variants):
        spec_cfg = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 1,
                    **({"quantization": args.draft_quantization} if args.draft_quantization else {}),
                    **({"quantize_lm_head": True} if args.draft_quantize_lm_head else {})}
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                    kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
                                    quantize_lm_head=args.quantize_lm_head, num_threads=args.threads,
                                    enable_prefix_caching=False, speculative_config=spec_cfg,
                                    max_num_seqs=max(args.concurrency)))     # every stream runs at once
    decoders = _decoders(engine, variants, args)
    tok = engine.tokenizer
    texts = CODE_PROMPTS[:args.num_prompts]
    if args.prompt_set == "mixed":      # alternate code and prose
        half = (args.num_prompts + 1) // 2
        texts = [t for pair in zip(CODE_PROMPTS[:half], PROSE_PROMPTS[:half]) for t in pair][:args.num_prompts]
    if tok.chat_template:
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)) for p in texts]
    else:                                                  # a base model: the task text as it is
        prompts = [engine.tokenize(p) for p in texts]
    labels = [v.label for v in variants]
    anchors = {v.label: LlamaServerSpec(args, v.k, args.port + i) for i, v in enumerate(variants)
               if v.method == "llama.cpp"}
    for anchor in anchors.values():
        anchor.run(prompts[:1], 8)                          # warm-up
    for dec in {id(d): d for d in decoders.values()}.values():   # warm-up: every variant, so none pays
        engine.spec = dec                                   # a first use (the draft's) in its first repeat
        _run_prompts(engine, prompts[:1], 8)
    keys = [(c, l) for c in args.concurrency for l in labels if c == 1 or l not in anchors]   # llama.cpp: 1 slot
    results = {key: {"tok_s": [], "accept": [], "mean_len": [], "off": []} for key in keys}
    for c in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(max(len(prompts), c))]
        point = [l for cc, l in keys if cc == c]
        for rep in range(args.repeats):
            for label in point[rep % len(point):] + point[:rep % len(point)]:
                r = results[(c, label)]
                if label in anchors:
                    anchor = anchors[label]
                    drafted, accepted = anchor.drafted, anchor.accepted
                    tokens, secs = anchor.run(batch, args.max_tokens)
                    if anchor.drafted > drafted:
                        r["accept"].append((anchor.accepted - accepted) / (anchor.drafted - drafted))
                else:
                    dec = decoders[label]
                    engine.spec = dec
                    before = dataclasses.replace(dec.stats) if dec is not None else None
                    tokens, secs = _run_prompts(engine, batch, args.max_tokens, c)
                    if dec is not None:
                        st = dec.stats
                        drafts = st.num_drafts - before.num_drafts
                        proposed = st.num_draft_tokens - before.num_draft_tokens
                        accepted = st.num_accepted_tokens - before.num_accepted_tokens
                        steps = st.num_decode_steps - before.num_decode_steps
                        r["accept"].append(accepted / proposed if proposed else 0.0)
                        r["mean_len"].append(1 + accepted / drafts if drafts else 1.0)
                        drafting = st.num_draft_steps - before.num_draft_steps
                        r["off"].append(1 - drafting / steps if steps else 0.0)
                r["tok_s"].append(tokens / secs)
                _log(f"{c} stream(s), repeat {rep + 1} {label}: {tokens} tokens in {secs:.1f} s = "
                     f"{tokens / secs:.2f} tok/s")
    for anchor in anchors.values():
        anchor.close()
    print(f"\n{'streams':>7} {'variant':<16} {'tok/s':>9} {'vs none':>8} {'accept %':>9} {'mean len':>9} {'off %':>6}")
    rows = []
    for c, label in keys:
        r = results[(c, label)]
        base = results.get((c, "none"), {}).get("tok_s")
        ratio = statistics.median(a / b for a, b in zip(r["tok_s"], base)) if base else None
        acc, mlen, off = _median(r["accept"]), _median(r["mean_len"]), _median(r["off"])
        rows.append({"concurrency": c, "variant": label, "tok_s": statistics.median(r["tok_s"]),
                     "ratio_vs_none": ratio, "acceptance_rate": acc, "mean_acceptance_length": mlen,
                     "spec_off_share": off, "per_repeat": r})
        print(f"{c:>7} {label:<16} {rows[-1]['tok_s']:>9.2f} {'' if ratio is None else f'{ratio:.2f}x':>8} "
              f"{'-' if acc is None else f'{100 * acc:.1f}':>9} {'-' if mlen is None else f'{mlen:.2f}':>9} "
              f"{'-' if off is None else f'{100 * off:.0f}':>6}")
    result = {"machine": machine_info(), "args": {k: str(v) if hasattr(v, "__fspath__") else v
                                                 for k, v in vars(args).items() if k != "func"},
              "rows": rows}
    if args.output_json:
        write_json(args.output_json, result)
    return result
