"""The C++ decode stack (model/decode_stack.py) against the eager layers it replaces: the same
logits bit for bit on pure-decode steps, for dense and integer-dot weights, batch 1 and batched
with contexts that span several KV blocks; the eager path wherever it cannot apply."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_models import tiny_hf_model
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant.kv_cache import KVCache
from tokenmill.model.decode_stack import DecodeStack, decode_stack_kernels
from tokenmill.quant.int_dot import int_dot_available
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def _runner(dtype: torch.dtype, quantization: str | None, arch: str = "llama", **kw) -> ModelRunner:
    hf = tiny_hf_model(arch)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    econf = EngineConfig(block_size=4, kv_cache_memory=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 4 * 96,
                         quantization=quantization, **kw)
    return ModelRunner(econf, cfg, hf.state_dict(), torch.device("cpu"), dtype, 512)


class _Counting:
    """Wraps the model's stack and counts the steps it ran."""

    def __init__(self, stack: DecodeStack) -> None:
        self.stack, self.calls = stack, 0
        self.max_rows = stack.max_rows

    def applies(self, *a):
        return self.stack.applies(*a)

    def __call__(self, *a):
        self.calls += 1
        return self.stack(*a)


CASES = [(torch.float32, None, "llama"), (torch.bfloat16, None, "qwen2"),
         (torch.bfloat16, "rtn4", "llama"), (torch.float32, "int8", "qwen2"), (torch.bfloat16, "int8", "llama")]


@pytest.mark.parametrize("dtype,quantization,arch", CASES)
def test_decode_steps_match_the_eager_layers_bit_for_bit(dtype, quantization, arch):
    if decode_stack_kernels() is None:
        pytest.fail("the decode stack did not compile on this CPU host")
    if quantization and not int_dot_available():
        pytest.skip("integer-dot kernels need AVX512-VNNI; quantized layers stay eager here")
    _check_steps_bit_for_bit(_runner(dtype, quantization, arch))


@pytest.mark.parametrize("dtype,quantization,arch", [c for c in CASES if c[1]])
def test_wide_steps_hand_rows_to_the_tiled_path_inside_the_stack(dtype, quantization, arch, monkeypatch):
    """Past the integer-dot kernel's rows (4 here) the quantized linears take the tiled path, in the
    eager layers and in the stack alike, so a 12-row step stays in the stack with the same bits."""
    from tokenmill.quant import kernels, tiled
    if decode_stack_kernels() is None or not int_dot_available() or tiled.tiled_kernels() is None:
        pytest.skip("needs the decode stack, the integer-dot and the tiled kernels")
    monkeypatch.setattr(kernels, "_OVERRIDE", 4)
    runner = _runner(dtype, quantization, arch)
    assert runner.model.decode_stack.max_rows > 12
    _check_steps_bit_for_bit(runner)


def _check_steps_bit_for_bit(runner: ModelRunner) -> None:
    model = runner.model
    assert model.decode_stack is not None
    counting = _Counting(model.decode_stack)
    bm = BlockManager(runner.num_blocks, 4)
    g = torch.Generator().manual_seed(3)
    # 12 sequences: batched steps past 8 rows take the chunked small-batch kernel (fp32) in both paths
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 6, 13, 22, 9, 2, 4, 7, 3, 11, 5, 8)]
    seqs = [Sequence(str(i), p, SamplingParams(max_tokens=32)) for i, p in enumerate(prompts)]
    for s in seqs:
        assert bm.admit(s, [], 0) and bm.grow(s, s.num_tokens)
    runner.execute([(s, s.num_tokens) for s in seqs])          # prefill: eager
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.append_token(int(torch.randint(3, 256, (1,), generator=g)))
    for step in range(7):
        batch = seqs if step % 2 else seqs[step % len(seqs):][:1]      # batched and batch-1 steps
        for s in batch:
            assert bm.grow(s, 1)
        scheduled = [(s, 1) for s in batch]
        model.decode_stack = None
        eager = runner.execute(scheduled)
        model.decode_stack = counting
        fused = runner.execute(scheduled)
        assert torch.equal(eager, fused), f"step {step}: max diff {(eager - fused).abs().max()}"
        for s, row in zip(batch, eager):
            s.num_computed_tokens += 1
            s.append_token(int(row.argmax()))
    assert counting.calls == 7


def test_mixed_steps_and_autograd_take_the_eager_layers():
    if decode_stack_kernels() is None:
        pytest.fail("the decode stack did not compile on this CPU host")
    stack = _runner(torch.float32, None).model.decode_stack
    kv = [KVCache(torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16))]
    decode = AttentionMetadata(torch.zeros(2, dtype=torch.long), 2, None, None, [])
    x = torch.zeros(2, 64)
    with torch.inference_mode():
        assert stack.applies(x, kv, [decode])
        assert not stack.applies(x, kv, [AttentionMetadata(torch.zeros(2, dtype=torch.long), 1, None, None, [object()])])
        assert not stack.applies(x, [KVCache(c.k.half(), c.v.half()) for c in kv], [decode])   # a KV cache in another dtype
        two_groups = [decode, AttentionMetadata(torch.zeros(2, dtype=torch.long), 2, None, None, [], window=8)]
        assert not stack.applies(x, kv * 2, two_groups)
    assert not stack.applies(x, kv, [decode])          # gradients on (training, calibration)


def test_enforce_eager_and_layers_that_cannot_join():
    assert _runner(torch.float32, None, enforce_eager=True).model.decode_stack is None
    # NF4 has no stack kernel: the whole model stays eager
    assert _runner(torch.bfloat16, "nf4").model.decode_stack is None
