"""Multi-LoRA cost: offline ShareGPT throughput with 0, 1, 4 and 8 distinct adapters (rank 8
and 16, all seven projections) spread round-robin over the requests, against the base model
alone (an engine without LoRA) and the LoRA engine serving base rows only.

One run, one machine: each variant is measured `--repeats` times in interleaved rounds (the
machine is shared and drifts), greedy with ignore_eos so every variant generates the same
number of tokens; medians and ratios to the base.

    .venv/bin/python benchmarks/lora_throughput.py --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.sharegpt import sample_requests
from tokenmill.hub import resolve_model
from tokenmill.lora.peft_format import random_adapter
from tokenmill.model.loader import read_model_config

RESULTS = Path(__file__).parent / "results" / "lora_throughput.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--adapter-counts", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--output-json", default=str(RESULTS))
    args = p.parse_args()
    print(machine_header(), flush=True)

    cfg = read_model_config(resolve_model(args.model))
    common = dict(dtype=args.dtype, max_model_len=2048, max_num_seqs=args.max_num_seqs, kv_cache_memory=2 << 30,
                  enable_prefix_caching=False)
    base = LLM(args.model, **common)
    lora = LLM(args.model, enable_lora=True, max_loras=max(args.adapter_counts), max_lora_rank=max(args.ranks),
               max_cpu_loras=max(args.adapter_counts) * len(args.ranks), **common)
    requests = sample_requests(base.get_tokenizer(), args.num_prompts, max_output_tokens=args.max_output_tokens)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    out_tokens = sum(r.output_len for r in requests)

    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = {rank: [LoRARequest(f"r{rank}-{i}", 100 * rank + i + 1,
                                   str(random_adapter(tmp / f"r{rank}-{i}", cfg, rank, seed=100 * rank + i)))
                       for i in range(max(args.adapter_counts))] for rank in args.ranks}
    variants: dict[str, tuple[LLM, list]] = {"base (no LoRA engine)": (base, [None] * len(requests)),
                                             "LoRA engine, 0 adapters": (lora, [None] * len(requests))}
    for rank in args.ranks:
        for n in args.adapter_counts:
            variants[f"rank {rank}, {n} adapter{'s' if n > 1 else ''}"] = (
                lora, [adapters[rank][i % n] for i in range(len(requests))])

    lora.generate(prompts[:8], params[:8], use_tqdm=False, lora_request=variants[list(variants)[-1]][1][:8])  # warm-up
    rounds: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.repeats):
        for key, (llm, loras) in variants.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            secs = time.perf_counter() - t0
            assert sum(len(o.outputs[0].token_ids) for o in outs) == out_tokens
            rounds[key].append(out_tokens / secs)
            print(f"round {r + 1} {key}: {out_tokens / secs:.1f} output tok/s ({secs:.1f} s)", flush=True)

    base_tps = statistics.median(rounds["base (no LoRA engine)"])
    print(f"\nShareGPT-{args.num_prompts} offline, {out_tokens} output tokens, max_num_seqs {args.max_num_seqs}, "
          f"medians of {args.repeats} interleaved rounds")
    print(f"{'variant':28s} {'output tok/s':>13s} {'vs base':>8s} {'cost':>7s}   per round")
    rows = []
    for key, values in rounds.items():
        med = statistics.median(values)
        rows.append({"variant": key, "median_tok_s": med, "rounds": values, "ratio": med / base_tps})
        print(f"{key:28s} {med:13.1f} {med / base_tps:8.3f} {1 - med / base_tps:7.1%}   "
              f"{' / '.join(f'{v:.1f}' for v in values)}")
    Path(args.output_json).write_text(json.dumps({"machine": machine_info(), "args": vars(args),
                                                  "output_tokens": out_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
