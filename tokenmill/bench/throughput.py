"""`tokenmill bench throughput`: offline ShareGPT throughput, batch-1 decode and prefill,
tokenmill (one engine per `--quantization` variant) vs HF transformers and llama.cpp
(`--llama-cpp label=GGUF,...`, each a llama-server child process).

All engines run one after the other, in alternating order across repeats, on the same sampled
requests with greedy decoding and exactly the requested output lengths.
"""
from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.report import (Sample, Workload, common_prefix, format_engines_table, format_table,
                                    summarize, write_json)
from tokenmill.bench.sharegpt import Request, sample_requests
from tokenmill.hub import resolve_model


class Runner(Protocol):
    name: str

    def throughput(self, requests: Sequence[Request], batch_size: int) -> float: ...
    def decode(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[int]]: ...
    def prefill(self, prompt_ids: list[int]) -> float: ...


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _machine() -> dict[str, Any]:
    import transformers
    return {**machine_info(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def _prefill_prompt(requests: Sequence[Request], n: int) -> list[int]:
    ids = [t for r in requests for t in r.prompt_token_ids]
    if len(ids) < n:
        raise ValueError(f"sampled prompts hold only {len(ids)} tokens, need {n} for the prefill test")
    return ids[:n]


def _measure(runner: Runner, requests: Sequence[Request], args: argparse.Namespace,
             decode_prompt: list[int], prefill_prompt: list[int]) -> tuple[Sample, list[int]]:
    t = runner.throughput(requests, args.hf_batch_size)
    _log(f"{runner.name}: throughput {t:.1f}s")
    d, tokens = runner.decode(decode_prompt, args.decode_tokens)
    p = runner.prefill(prefill_prompt)
    _log(f"{runner.name}: decode {d:.2f}s, prefill {p:.2f}s")
    return Sample(throughput_s=t, decode_s=d, prefill_s=p), tokens


def _warm_up(runner: Runner, requests: Sequence[Request], prefill_prompt: list[int]) -> None:
    small = [Request(r.prompt, r.prompt_token_ids, 4) for r in requests[:4]]
    runner.throughput(small, len(small))
    runner.decode(requests[0].prompt_token_ids[:32], 8)
    runner.prefill(prefill_prompt)


def run_throughput_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.bench.hf_runner import HFRunner
    from tokenmill.bench.tm_runner import TokenmillRunner

    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    model_path = resolve_model(args.model)
    runners: list[Runner] = []
    if not args.skip_hf:
        _log(f"loading HF transformers model from {model_path}")
        runners.append(HFRunner(model_path, getattr(torch, args.dtype)))
    tm = None
    for quant in args.quantization.split(","):
        name = "tokenmill" if quant == "none" else f"tokenmill-{quant}"
        _log(f"starting {name}")
        t0 = time.perf_counter()
        extra = {} if quant == "none" else {"quantization": quant, "quantize_lm_head": args.quantize_lm_head}
        runner = TokenmillRunner(args.model, args.dtype, args.max_num_seqs, args.kv_cache_memory,
                                 enable_prefix_caching=args.enable_prefix_caching, num_threads=args.threads,
                                 name=name, **extra)
        _log(f"{name} ready in {time.perf_counter() - t0:.1f}s")
        runners.append(runner)
        tm = tm or runner
    for i, (label, gguf) in enumerate(_llama_cpp_variants(args.llama_cpp)):
        from tokenmill.bench.llamacpp_runner import LlamaCppRunner
        _log(f"starting llama-server {label} on {gguf}")
        runners.append(LlamaCppRunner(f"llama.cpp-{label}", gguf, args.threads, args.llama_cpp_parallel,
                                      args.max_prompt_tokens + args.max_output_tokens, args.llama_cpp_port + i))

    requests = sample_requests(tm.llm.get_tokenizer(), args.num_prompts, args.max_prompt_tokens,
                               args.max_output_tokens, seed=args.seed)
    decode_prompt = requests[0].prompt_token_ids[:32]
    prefill_prompt = _prefill_prompt(requests, args.prefill_tokens)
    w = Workload(len(requests), sum(len(r.prompt_token_ids) for r in requests),
                 sum(r.output_len for r in requests), args.decode_tokens, len(prefill_prompt))
    _log(f"{w.num_requests} requests, {w.prompt_tokens} prompt + {w.output_tokens} output tokens")

    for runner in runners:
        _warm_up(runner, requests, prefill_prompt)
    samples: dict[str, list[Sample]] = {r.name: [] for r in runners}
    decoded: dict[str, list[int]] = {}
    doc: dict[str, Any] = {}
    for rep in range(args.repeats):
        for runner in runners if rep % 2 == 0 else runners[::-1]:
            _log(f"repeat {rep + 1}/{args.repeats}: {runner.name}")
            sample, decoded[runner.name] = _measure(runner, requests, args, decode_prompt, prefill_prompt)
            samples[runner.name].append(sample)
        doc = _document(args, w, requests, samples, decoded, rep + 1)
        if args.output_json:  # after every repeat, so a killed run still leaves its data
            write_json(Path(args.output_json), doc)
    for runner in runners:
        if hasattr(runner, "close"):
            runner.close()
    print(f"\nShareGPT offline throughput: {args.model} {args.dtype}, {w.num_requests} prompts, "
          f"HF static batch {args.hf_batch_size}, median of {args.repeats}, {args.threads} threads\n")
    print(doc["table"], flush=True)
    if len(runners) > 2 or args.llama_cpp:
        print("\n" + doc["engines_table"], flush=True)
    if args.output_json:
        _log(f"wrote {args.output_json}")
    return doc


def _document(args: argparse.Namespace, w: Workload, requests: Sequence[Request],
              samples: dict[str, list[Sample]], decoded: dict[str, list[int]], done: int) -> dict[str, Any]:
    summary = summarize(samples, w)
    hf_batches = [requests[i:i + args.hf_batch_size] for i in range(0, len(requests), args.hf_batch_size)]
    return {
        "benchmark": "throughput",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "repeats_done": done,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": _machine(),
        "workload": asdict(w),
        "hf_generated_tokens_incl_padding": sum(len(b) * max(r.output_len for r in b) for b in hf_batches),
        "batch1_greedy_common_prefix": (common_prefix(decoded["hf"], decoded["tokenmill"])
                                        if "hf" in decoded and "tokenmill" in decoded else None),
        **summary,
        "table": format_table(summary, w),
        "engines_table": format_engines_table(summary, w, _anchor(args)),
    }


def _llama_cpp_variants(spec: str | None) -> list[tuple[str, Path]]:
    """`label=GGUF,...` -> [(label, path)]; the files must exist."""
    out = []
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        label, sep, path = item.strip().partition("=")
        if not sep or not label or not Path(path).is_file():
            raise ValueError(f"--llama-cpp wants label=GGUF_FILE, got {item!r}")
        out.append((label, Path(path)))
    return out


def _anchor(args: argparse.Namespace) -> str | None:
    first = _llama_cpp_variants(args.llama_cpp)[:1]
    return f"llama.cpp-{first[0][0]}" if first else (None if args.skip_hf else "hf")
