"""Rank 0's side of start-up: refuse what tensor parallelism cannot do, start (or join) the
other ranks, and form the process group."""
from __future__ import annotations

from typing import Callable

import torch

from tokenmill.config import EngineConfig, UnsupportedConfig
from tokenmill.parallel.group import TensorParallel, init_tensor_parallel, torchrun_rank
from tokenmill.parallel.worker import LocalWorkers, rank_threads


def check_supported(config: EngineConfig) -> None:
    if config.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
    if config.tensor_parallel_size == 1:
        return
    if config.enable_lora:
        raise UnsupportedConfig("enable_lora with tensor_parallel_size > 1 is not supported: adapters are not sliced")
    if config.speculative_config:
        raise UnsupportedConfig("speculative_config with tensor_parallel_size > 1 is not supported: "
                                "the draft model runs on one rank only")


def start_tensor_parallel(config: EngineConfig, device: torch.device, on_worker_death: Callable[[str], None]
                          ) -> tuple[TensorParallel | None, LocalWorkers | None]:
    """(None, None) on one rank. Under torchrun this process must be rank 0 and the others were
    started by torchrun; otherwise ranks 1..N-1 are spawned here and watched."""
    check_supported(config)
    world = config.tensor_parallel_size
    if world == 1:
        return None, None
    torch.set_num_threads(rank_threads(config))
    launched = torchrun_rank()
    if launched is not None:
        rank, size = launched
        if size != world:
            raise ValueError(f"--tensor-parallel-size {world} but torchrun started {size} ranks")
        if rank != 0:
            raise RuntimeError(f"rank {rank} must run parallel.worker.run_worker, not an engine")
        return init_tensor_parallel(0, world, device), None
    workers = LocalWorkers.start(config)
    workers.watch(on_worker_death)
    return init_tensor_parallel(0, world, device, workers.init_method), workers
