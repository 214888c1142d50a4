"""Tensor parallelism over torch.distributed (gloo on CPU, nccl on CUDA).

Every rank holds 1/N of every decoder layer and its slice of the paged KV cache; rank 0 also
runs the scheduler, block manager and sampler, and broadcasts each step's flat batch to the
others (`worker.py`). Inside the model the only TP-specific code is three hooks that are the
identity on one rank (`Attention.output_reduce`, `MLP.output_reduce`,
`LlamaForCausalLM.logits_gather`); `shard.py` slices the loaded weights and sets them.

- `group.py`: the process group and its three collectives (all-reduce, gather of logits,
  broadcast of the step).
- `shard.py`: which heads / MLP columns / vocabulary rows a rank owns, and the slicing.
- `worker.py`: local worker processes, the torchrun entry for ranks > 0, and the monitor that
  turns a dead worker into an unhealthy server that exits non-zero.
"""
