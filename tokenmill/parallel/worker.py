"""Ranks > 0: the same model, this rank's slice of it, and every step rank 0 broadcasts.

Single machine: `LocalWorkers.start` spawns ranks 1..N-1 as child processes that rendezvous
with rank 0 over loopback TCP. Multi-node: torchrun starts one `tokenmill serve` per rank;
ranks > 0 call `run_worker` instead of serving HTTP (cli.py). Either way a rank that dies must
not leave rank 0 waiting in a collective forever: the monitor thread here watches local
workers, logs which one died, and ends the server process with a non-zero status.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.parallel.group import TensorParallel, init_tensor_parallel

log = logging.getLogger("tokenmill")

DEATH_GRACE_S = 2.0      # between "worker died" and exiting: /health answers 503, the log is flushed


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    device = config.resolve_device()
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def rank_threads(config: EngineConfig) -> int:
    """Threads per rank: the cores divided among the ranks (each rank computes 1/N of the step)."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def run_worker(config: EngineConfig, tp: TensorParallel) -> None:
    """Build this rank's runner, then run every step rank 0 broadcasts until it sends None."""
    from tokenmill.engine.model_runner import ModelRunner, to_device

    torch.set_num_threads(rank_threads(config))
    device = rank_device(config, tp.rank)
    runner = ModelRunner.from_config(config, device, config.resolve_dtype(device), tp)
    log.info("tensor-parallel rank %d/%d ready: %s", tp.rank, tp.world_size, runner.describe_kv_cache())
    with torch.inference_mode():
        while (step := tp.broadcast()) is not None:
            runner.forward_step(step if device.type == "cpu" else to_device(step, device))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a worker must not outlive rank 0)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def join_as_worker(config: EngineConfig, rank: int, world_size: int, init_method: str | None = None) -> None:
    """A rank > 0 from start to finish: join the group (torchrun's env:// when no init_method),
    follow rank 0's steps, leave, and end the process."""
    if world_size != config.tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} but torchrun started {world_size} ranks")
    tp = init_tensor_parallel(rank, world_size, config.resolve_device(), init_method)
    run_worker(config, tp)
    dist.destroy_process_group()
    # Skip the interpreter's C++ static destructors: with rank 0 (and torchrun's store) already
    # gone, one of torch's distributed threads is still joinable there and aborts the process
    # (SIGABRT, "terminate called without an active exception") after a clean stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker_main(config: EngineConfig, rank: int, init_method: str) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tokenmill rank {rank}: %(message)s")
    join_as_worker(config, rank, config.tensor_parallel_size, init_method)


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalWorkers:
    """Ranks 1..N-1 as child processes of rank 0, on this machine."""

    processes: list[mp.process.BaseProcess] = field(default_factory=list)
    init_method: str = ""
    _stopping: bool = False

    @classmethod
    def start(cls, config: EngineConfig) -> "LocalWorkers":
        ctx = mp.get_context("spawn")            # no fork of a process that holds threads / a model
        init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        procs = [ctx.Process(target=_worker_main, args=(config, rank, init_method), daemon=True,
                             name=f"tokenmill-tp-rank{rank}")
                 for rank in range(1, config.tensor_parallel_size)]
        for p in procs:
            p.start()
        return cls(procs, init_method)

    def watch(self, on_death: Callable[[str], None], poll_s: float = 0.5) -> None:
        """Call `on_death(message)` from a daemon thread when a worker exits unexpectedly."""
        def loop() -> None:
            while not self._stopping:
                for rank, p in enumerate(self.processes, start=1):
                    if not p.is_alive() and not self._stopping:
                        on_death(f"tensor-parallel worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}")
                        return
                time.sleep(poll_s)
        threading.Thread(target=loop, name="tokenmill-tp-monitor", daemon=True).start()

    def expect_exit(self) -> None:
        """From now on a worker that exits is stopping, not dying (the monitor stays quiet)."""
        self._stopping = True

    def stop(self, timeout_s: float = 10.0) -> None:
        self.expect_exit()
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def exit_on_worker_death(message: str) -> None:
    """The default reaction: log it, give the server a moment to answer /health with 503, exit 1
    (a collective with a dead rank may never return, so waiting for the engine is not safe)."""
    log.error("%s; the engine cannot continue, exiting", message)
    time.sleep(DEATH_GRACE_S)
    logging.shutdown()
    os._exit(1)
