"""The scheduler's seat count and step token budget: device defaults, explicit values, bad values."""
import argparse

import pytest
import torch

from tokenmill.config import SCHEDULER_DEFAULTS, EngineConfig
from tokenmill.engine_args import add_engine_args, engine_config_from_args

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_defaults_per_device():
    cfg = EngineConfig()
    assert cfg.resolve_max_num_seqs(CPU) == SCHEDULER_DEFAULTS["cpu"][0]
    assert cfg.resolve_max_num_seqs(GPU) == SCHEDULER_DEFAULTS["gpu"][0]
    assert cfg.resolve_max_num_batched_tokens(CPU, 1024) == SCHEDULER_DEFAULTS["cpu"][1]
    assert cfg.resolve_max_num_batched_tokens(GPU, 1024) == SCHEDULER_DEFAULTS["gpu"][1]
    # without chunked prefill a whole prompt must fit one step
    assert EngineConfig(enable_chunked_prefill=False).resolve_max_num_batched_tokens(CPU, 4096) == 4096


def test_explicit_values_win_and_bad_ones_are_refused():
    assert EngineConfig(max_num_seqs=3).resolve_max_num_seqs(CPU) == 3
    assert EngineConfig(max_num_batched_tokens=64).resolve_max_num_batched_tokens(CPU, 1024) == 64
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(max_num_seqs=0).resolve_max_num_seqs(CPU)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=-5).resolve_max_num_batched_tokens(CPU, 1024)


def test_flags_parse_as_integers():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--max-num-seqs", "8", "--max-num-batched-tokens", "128"]))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (8, 128)
    assert engine_config_from_args(p.parse_args([])).max_num_seqs is None
    with pytest.raises(SystemExit):
        p.parse_args(["--max-num-seqs", "many"])


def test_idle_budget_widens_only_the_device_default():
    assert EngineConfig().resolve_max_idle_batched_tokens(CPU, 1024) == SCHEDULER_DEFAULTS["cpu"][2]
    # a step budget the user chose caps idle steps too, unless the idle budget is given as well
    assert EngineConfig(max_num_batched_tokens=64).resolve_max_idle_batched_tokens(CPU, 1024) == 64
    cfg = EngineConfig(max_num_batched_tokens=64, max_idle_batched_tokens=512)
    assert cfg.resolve_max_idle_batched_tokens(CPU, 1024) == 512
    # without chunked prefill the step budget already holds a whole prompt
    assert EngineConfig(enable_chunked_prefill=False).resolve_max_idle_batched_tokens(CPU, 4096) == 4096
    with pytest.raises(ValueError, match="max_idle_batched_tokens=32 is below the step budget"):
        EngineConfig(max_num_batched_tokens=64, max_idle_batched_tokens=32).resolve_max_idle_batched_tokens(CPU, 1024)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--max-idle-batched-tokens", "999"])).max_idle_batched_tokens == 999
