"""Where one decode step's time goes, batch 1 and batch 32: the split issue #10 asks for.

Two passes over the same steady decode state (every sequence past its prompt):
1. plain timing (no profiler): wall time per engine step, cut into scheduler, runner batch
   building, model forward, lm_head, sampler and the engine's output/detokenize work by
   perf_counter wrappers around those calls (no change to the hot path itself);
2. torch.profiler over more steps: self CPU time of every aten/custom op inside the step,
   grouped into matmul kernels (decoder linears + lm_head), attention (cache write + paged
   decode kernel), and the other ops (norms, rope, SiLU, adds, index/copy). Python and dispatch
   overhead inside the forward = forward wall (pass 1) - forward op time (pass 2). When the C++
   decode stack runs the layers (the default; --enforce-eager turns it off) the profiler sees it
   as one op, `tokenmill_stack::decode`;
3. matmul replay: every linear's input of one step captured (eager layers, same values), then
   all linears and the lm_head called again in forward order, timed as one loop without the
   profiler: the matmul time of a step, against which "step / matmul" is reported.

    .venv/bin/python benchmarks/profile_decode.py --quantization none,rtn4 --batch-sizes 1,32
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tokenmill.bench.machine import machine_header
from tokenmill.llm import LLM
from tokenmill.model.decode_stack import DecodeStack
from tokenmill.sampling_params import SamplingParams

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_int_mm", "aten::_weight_int8pack_mm",
              "aten::_weight_int4pack_mm_for_cpu", "tokenmill_quant::")
ATTENTION_OPS = ("tokenmill_attention::", "aten::index_copy_", "aten::_scaled_dot_product", "aten::scaled_dot")
# Our C++ kernels are pybind functions the profiler cannot see; during the profiled pass each is
# wrapped in a record_function named <label>::<function> (module attribute, kernel getter, label).
PYBIND_KERNELS = (("tokenmill.model.attention", "paged_decode_kernels", "tokenmill_attention"),
                  ("tokenmill.model.layers", "fused_layer_kernels", "tokenmill_fused"),
                  ("tokenmill.quant.tiled", "tiled_kernels", "tokenmill_quant"),
                  ("tokenmill.quant.nf4", "nf4_kernels", "tokenmill_quant"),
                  ("tokenmill.quant.int_dot", "int_dot_kernels", "tokenmill_quant"))
REGIONS = ("schedule", "batch build", "forward", "lm_head", "sampler", "output")


def _timed(fn: Callable, bucket: list[float]) -> Callable:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            bucket.append(time.perf_counter() - t0)
    return wrapper


@contextlib.contextmanager
def _timing(targets: dict[str, tuple[Any, str]], buckets: dict[str, list[float]]):
    """Wrap each obj.attr in a timer feeding buckets[name]; put the originals back after."""
    own = {name: (obj, attr, obj.__dict__.get(attr)) for name, (obj, attr) in targets.items()}
    for name, (obj, attr) in targets.items():
        setattr(obj, attr, _timed(getattr(obj, attr), buckets[name]))
    try:
        yield
    finally:
        for obj, attr, original in own.values():
            if original is None:          # a method: drop the instance override
                obj.__dict__.pop(attr, None)
            else:                         # an instance attribute (the sampler object)
                setattr(obj, attr, original)


def _category(name: str) -> str | None:
    if name.startswith("tokenmill_stack::"):
        return "decoder stack (C++, all layers)"
    if name.startswith(ATTENTION_OPS):
        return "attention"
    if name.startswith(MATMUL_OPS):
        return "matmul"
    if name.startswith(("aten::", "tokenmill_")):
        return "other ops"
    return None          # profiler-internal / Python-level ranges


class _Labelled:
    """A compiled extension whose functions run inside record_function ranges."""

    def __init__(self, module: Any, label: str) -> None:
        self._module, self._label = module, label

    def __getattr__(self, name: str) -> Callable:
        fn = getattr(self._module, name)

        def call(*a: Any, **kw: Any) -> Any:
            with record_function(f"{self._label}::{name}"):
                return fn(*a, **kw)
        return call


@contextlib.contextmanager
def labelled_kernels():
    saved = []
    for mod_name, attr, label in PYBIND_KERNELS:
        mod = importlib.import_module(mod_name)
        getter = getattr(mod, attr)
        ext = getter()
        saved.append((mod, attr, getter))
        setattr(mod, attr, lambda ext=ext, label=label: None if ext is None else _Labelled(ext, label))
    stack_call = DecodeStack.__call__

    def labelled_stack(self, *a: Any) -> Any:
        with record_function("tokenmill_stack::decode"):
            return stack_call(self, *a)
    DecodeStack.__call__ = labelled_stack
    try:
        yield
    finally:
        DecodeStack.__call__ = stack_call
        for mod, attr, getter in saved:
            setattr(mod, attr, getter)


def matmul_replay(llm: LLM, steps: int) -> float:
    """ms of one step's linears (decoder layers + lm_head) called on their captured inputs."""
    eng, model = llm.engine, llm.engine.runner.model
    calls: list[tuple[torch.nn.Module, torch.Tensor]] = []
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")   # any weight format
    linears = [m for name, m in model.named_modules() if name.rpartition(".")[2] in projections]
    hooks = [m.register_forward_hook(lambda mod, inp, out: calls.append((mod, inp[0].clone()))) for m in linears]
    stack, model.decode_stack = model.decode_stack, None
    try:
        eng.step()
    finally:
        model.decode_stack = stack
        for h in hooks:
            h.remove()
    times = []
    with torch.inference_mode():
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            for mod, x in calls:
                mod(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def steady_decode(llm: LLM, batch: int, prompt_len: int) -> None:
    """Admit `batch` requests and step until all have finished their prompts."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    vocab = eng.runner.model_cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
        eng.add_request(f"p{i}", ids, params)
    while any(s.num_output_tokens == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(4):
        eng.step()


def profile_one(llm: LLM, steps: int) -> dict[str, float]:
    eng, runner = llm.engine, llm.engine.runner
    model = runner.model
    targets = {"schedule": (eng.scheduler, "schedule"), "execute": (runner, "execute"), "forward": (model, "forward"),
               "lm_head": (model, "compute_logits"), "sampler": (eng, "sampler")}
    buckets: dict[str, list[float]] = {r: [] for r in targets}
    walls = []
    with _timing(targets, buckets):
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in buckets.items()}
    out = {"step": statistics.median(walls) * 1e3, "schedule": med["schedule"], "forward": med["forward"],
           "lm_head": med["lm_head"], "sampler": med["sampler"],
           "batch build": med["execute"] - med["forward"] - med["lm_head"]}
    out["output"] = out["step"] - med["schedule"] - med["execute"] - med["sampler"]

    with labelled_kernels(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    cats: collections.Counter = collections.Counter()
    per_op: dict[str, float] = {}
    for ev in prof.key_averages():
        cat = _category(ev.key)
        if cat is not None:
            cats[cat] += ev.self_cpu_time_total / steps / 1e3
            per_op[ev.key] = ev.self_cpu_time_total / steps / 1e3
    out.update({f"op {k}": v for k, v in cats.items()})
    out["top"] = sorted(per_op.items(), key=lambda kv: -kv[1])[:12]
    # the lm_head's matmul, timed alone on the same rows (it is one of the matmul ops above)
    hidden = torch.randn(len(eng.scheduler.running), model.cfg.hidden_size, dtype=runner.dtype)
    with torch.inference_mode():
        t = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model.compute_logits(hidden)
            t.append(time.perf_counter() - t0)
    out["lm_head matmul"] = statistics.median(t) * 1e3
    out["matmul replay"] = matmul_replay(llm, steps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none", help="comma list of none|int8|rtn4|nf4")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="eager layers, no C++ decode stack")
    args = p.parse_args()
    print(machine_header())
    for quant in args.quantization.split(","):
        extra = {} if quant == "none" else {"quantization": quant, "quantize_lm_head": args.quantize_lm_head}
        for b in (int(x) for x in args.batch_sizes.split(",")):
            llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=max(b, 1),
                      enable_prefix_caching=False, enforce_eager=args.enforce_eager, **extra)
            steady_decode(llm, b, args.prompt_len)
            r = profile_one(llm, args.steps)
            print(f"\n{quant} batch {b}: step {r['step']:.2f} ms (median of {args.steps})")
            for k in REGIONS:
                print(f"  {k:<12} {r[k]:8.2f} ms")
            ops = {k: v for k, v in r.items() if k.startswith("op ")}
            top = r.pop("top")
            op_total = sum(ops.values())
            for k, v in sorted(ops.items()):
                print(f"  {k:<16} {v:8.2f} ms (profiled)")
            print(f"  python/dispatch outside ops {r['step'] - op_total:8.2f} ms; "
                  f"lm_head matmul alone {r['lm_head matmul']:.2f} ms")
            print(f"  matmul replay (all linears + lm_head, no profiler) {r['matmul replay']:.2f} ms; "
                  f"step / matmul = {r['step'] / r['matmul replay']:.2f}x")
            print("  top ops (ms/step): " + ", ".join(f"{k.removeprefix('aten::')} {v:.2f}" for k, v in top))
            del llm


if __name__ == "__main__":
    main()
