"""Per-projection output error of a 4-bit checkpoint vs plain RTN at the same group size, on the
float model's own inputs for one held-out ShareGPT conversation: tells a broken layer apart from
an end-to-end effect.

    .venv/bin/python benchmarks/quant_layer_error.py --checkpoint /work/qckpt/smollm2-gptq-g128
"""
from __future__ import annotations

import argparse
import collections

import torch

from tokenmill.bench.machine import machine_header
from tokenmill.bench.sharegpt import HELD_OUT_START, load_sharegpt
from tokenmill.llm import LLM
from tokenmill.quant.group import rtn_quantize
from tokenmill.sampling_params import SamplingParams

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="the float model")
    p.add_argument("--checkpoint", required=True, help="quantized checkpoint directory of the same model")
    p.add_argument("--group-size", type=int, default=128, help="RTN group size to compare with")
    p.add_argument("--conversation", type=int, default=7, help="held-out conversation index")
    p.add_argument("--skip-rows", type=int, default=4, help="leading tokens reported apart (attention sinks)")
    args = p.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    print(machine_header())
    kw = dict(dtype="float32", max_model_len=1024, kv_cache_memory=1 << 26, enable_prefix_caching=False)
    float_llm, quant_llm = LLM(model=args.model, **kw), LLM(model=args.checkpoint, **kw)
    fm, qm = float_llm.engine.runner.model, quant_llm.engine.runner.model
    inputs: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(fm.layers):
        for name in PROJECTIONS:
            def hook(_m, a, key=(i, name)):
                inputs[key] = a[0].detach().clone()
            hooks.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    text = " ".join(t for _, t in load_sharegpt()[HELD_OUT_START + args.conversation].turns)
    float_llm.generate(text[:3000], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    for h in hooks:
        h.remove()
    sums: collections.Counter = collections.Counter()
    worse = 0
    print(f"{'layer':>5} {'projection':>20} {'rtn':>8} {'ckpt':>8}")
    for (i, name), x in sorted(inputs.items()):
        w = fm.layers[i].get_submodule(name).weight.float()
        w_rtn = rtn_quantize(w, 4, args.group_size).dequantize()
        q = qm.layers[i].get_submodule(name)
        e_rtn, e_q = rel(x @ w_rtn.T, x @ w.T), rel(q(x), x @ w.T)
        worse += e_q > e_rtn
        print(f"{i:>5} {name:>20} {e_rtn:8.4f} {e_q:8.4f}")
        for part, rows in (("first", slice(0, args.skip_rows)), ("rest", slice(args.skip_rows, None))):
            xs = x[rows]
            sums[part, "rtn"] += rel(xs @ w_rtn.T, xs @ w.T)
            sums[part, "ckpt"] += rel(q(xs), xs @ w.T)
    n = len(inputs)
    print(f"{x.shape[0]} tokens; checkpoint worse than RTN in {worse} of {n} projections")
    for part in ("first", "rest"):
        print(f"mean relative output error, {part} rows: rtn {sums[part, 'rtn'] / n:.4f}  "
              f"checkpoint {sums[part, 'ckpt'] / n:.4f}")


if __name__ == "__main__":
    main()
