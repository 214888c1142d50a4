"""Decode step time under each OpenMP wait policy, on a quiet machine and next to busy neighbours.

libgomp (the OpenMP runtime of torch's CPU wheels) reads OMP_WAIT_POLICY once, when it loads:
ACTIVE spins between parallel regions (fast when the cores are ours, ruinous when a neighbour
needs them), PASSIVE sleeps at once, unset spins for a while (GOMP_SPINCOUNT, 300k by default)
then sleeps. Each configuration runs
in a fresh process (the policy cannot change inside one) timing engine steps at batch 1 and
batch 16 (SmolLM2, steady decode); `--hogs N` starts N busy-looping processes alongside, the
shared-machine case.

    .venv/bin/python benchmarks/thread_policy.py --hogs 0,1,2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from tokenmill.bench.machine import machine_header

POLICIES = "unset,ACTIVE,PASSIVE"   # or spin:N = GOMP_SPINCOUNT=N (libgomp's spin length before sleeping)

CHILD = r"""
import json, statistics, sys, time, torch
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams
model, quant, batches, steps = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4])
out = {}
for b in batches:
    extra = {} if quant == "none" else {"quantization": quant}
    llm = LLM(model=model, dtype="bfloat16", num_threads=2, max_num_seqs=b, enable_prefix_caching=False, **extra)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    for i in range(b):
        eng.add_request(str(i), [(i * 31 + j) % 40000 + 100 for j in range(128)], params)
    while eng.scheduler.waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    for _ in range(4):
        eng.step()
    walls = []
    for _ in range(steps):
        t = time.perf_counter(); eng.step(); walls.append((time.perf_counter() - t) * 1e3)
    out[b] = statistics.median(walls)
    del llm, eng
print(json.dumps(out))
"""


def _hog() -> None:
    while True:
        pass


def run(policy: str, hogs: int, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin:")
    elif policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    procs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(hogs)]
    for p in procs:
        p.start()
    try:
        res = subprocess.run([sys.executable, "-c", CHILD, args.model, args.quantization, args.batch_sizes,
                              str(args.steps)], env=env, capture_output=True, text=True, check=True)
    finally:
        for p in procs:
            p.terminate()
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="rtn4")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--hogs", default="0,1,2", help="busy neighbour processes per configuration")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policies", default=POLICIES, help="comma list: unset, ACTIVE, PASSIVE, spin:N")
    args = p.parse_args()
    print(machine_header())
    batches = args.batch_sizes.split(",")
    print(f"{'hogs':>4} {'policy':>8} " + " ".join(f"{'B=' + b + ' ms':>10}" for b in batches))
    for hogs in (int(h) for h in args.hogs.split(",")):
        for policy in args.policies.split(","):
            reps = [run(policy, hogs, args) for _ in range(args.repeats)]
            med = {b: statistics.median(r[b] for r in reps) for b in batches}
            print(f"{hogs:>4} {policy:>8} " + " ".join(f"{med[b]:10.2f}" for b in batches), flush=True)
        time.sleep(1)
    print(f"median step ms over {args.repeats} fresh processes x {args.steps} steps; quantization {args.quantization}")


if __name__ == "__main__":
    main()
