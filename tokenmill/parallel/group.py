"""The tensor-parallel process group and the collectives the model and runner need."""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A worker waits in `broadcast_step` for as long as the server idles, so collectives must not
# time out; a dead peer is found by the worker monitor (worker.py) and by closed sockets instead.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(slots=True)
class TensorParallel:
    rank: int
    world_size: int
    # seconds this rank spent inside all-reduce / gather (waiting for slower ranks included)
    collective_s: float = 0.0
    broadcast_s: float = 0.0      # in `broadcast` (pickling the step and sending it)

    @property
    def is_driver(self) -> bool:
        """Rank 0: scheduler, sampler, HTTP."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial `t` (row-parallel o_proj / down_proj, the embedding)."""
        t0 = time.perf_counter()
        dist.all_reduce(t)
        self.collective_s += time.perf_counter() - t0
        return t

    def gather_columns(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[rows, sizes[rank]] on each rank -> [rows, sum(sizes)] on every rank (vocab-parallel
        logits). all_gather needs equal shapes, so uneven slices travel padded."""
        width = max(sizes)
        if t.shape[-1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        t0 = time.perf_counter()
        dist.all_gather(parts, t.contiguous())
        self.collective_s += time.perf_counter() - t0
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (a step's inputs; None = stop)."""
        box = [obj]
        t0 = time.perf_counter()
        dist.broadcast_object_list(box, src=0)
        self.broadcast_s += time.perf_counter() - t0
        return box[0]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, world_size: int, device: torch.device,
                         init_method: str | None = None) -> TensorParallel:
    """Join (or create) the default process group. `init_method` None: torchrun's env://
    (MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE)."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method=init_method or "env://", rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    if dist.get_world_size() != world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    return TensorParallel(dist.get_rank(), world_size)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was launched by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
