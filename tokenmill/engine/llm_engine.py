"""The synchronous engine core: add_request / step / abort_request.

One `step()` = schedule -> one forward pass over the flat batch -> sample -> detokenize ->
stop checks -> free the blocks of whatever finished. Callers (the offline `LLM`, the async
server loop) drive it.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.engine.detokenizer import OutputText
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler
from tokenmill.hub import resolve_model
from tokenmill.lora.manager import parse_lora_modules
from tokenmill.lora.request import LoRARequest
from tokenmill.model.loader import load_tokenizer
from tokenmill.parallel.launch import start_tensor_parallel
from tokenmill.parallel.worker import exit_on_worker_death
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence, TokenLogprobs
from tokenmill.spec.build import build_speculative_decoder

log = logging.getLogger("tokenmill")


@dataclass(slots=True)
class Request:
    """A client request: n parallel sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[OutputText]
    arrival_time: float
    emitted_tokens: list[int] = field(default_factory=list)   # per seq, tokens already reported
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)      # (tensor parallelism divides the cores itself)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        t0 = time.perf_counter()
        self.failure: str | None = None      # set when a tensor-parallel worker died
        self.tp, self.workers = start_tensor_parallel(config, self.device, self._worker_died)
        path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(path if config.tokenizer is None else resolve_model(config.tokenizer))
        try:
            self.runner = ModelRunner.from_config(config, self.device, self.dtype, self.tp)
        except BaseException:
            self.tp = None                  # no goodbye broadcast: the workers may never get that far
            self.close(worker_timeout_s=0)
            raise
        self.max_model_len = self.runner.max_model_len
        model_cfg = self.model_config = self.runner.model_cfg
        self.runner.check_holds_max_model_len()
        self.lora = self.runner.lora
        if self.lora is not None:
            if config.speculative_config:
                raise ValueError("enable_lora with speculative_config is not supported: the draft has no adapters")
            for name, adapter_path in parse_lora_modules(config.lora_modules).items():
                self.lora.add(name, adapter_path)
        elif config.lora_modules or config.lora_dir:
            raise ValueError("lora_modules and lora_dir need enable_lora")
        if config.lora_dir is not None and not Path(config.lora_dir).is_dir():
            raise ValueError(f"lora_dir {config.lora_dir!r} is not a directory")
        self.max_num_seqs = config.resolve_max_num_seqs(self.device)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.device, self.max_model_len)
        self.block_manager = self.runner.make_block_manager(config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy,
                                   config.resolve_max_idle_batched_tokens(self.device, self.max_model_len),
                                   max_loras=config.max_loras if self.lora is not None else None)
        self.eos_token_ids = self._eos_ids()
        self.sampler = Sampler(model_cfg.vocab_size, eos_token_ids=self.eos_token_ids, seed=config.seed)
        self.spec = build_speculative_decoder(config, self.sampler, model_cfg, self.device, self.dtype,
                                              self.max_model_len, self.runner.kv_cache_bytes, self.runner.weight_bytes)
        costs = self.spec.calibrate(self.runner, self.block_manager) if self.spec is not None else None
        if costs:
            log.info("speculative decoding, adaptive k: a round with k = 0..%d drafts costs %s plain steps "
                     "(measured); drafts pay up to %d decoding sequences", len(costs) - 1,
                     " ".join(f"{c:.2f}" for c in costs), self.spec.max_paying_batch())
        self.requests: dict[str, Request] = {}
        self._seq_to_request: dict[int, Request] = {}
        log.info("model %s (%s) on %s %s: loaded in %.1fs; KV cache of %d-token blocks: %s", config.model,
                 model_cfg.architecture, self.device, str(self.dtype).removeprefix("torch."),
                 time.perf_counter() - t0, config.block_size, self.runner.describe_kv_cache())

    def _worker_died(self, message: str) -> None:
        self.failure = message
        exit_on_worker_death(message)

    def close(self, worker_timeout_s: float = 10.0) -> None:
        """Stop the tensor-parallel workers (a no-op on one rank). The engine is unusable after."""
        if self.workers is not None:
            self.workers.expect_exit()   # before they are told to stop: a clean exit is not a death
        if self.tp is not None and self.failure is None:
            self.tp.broadcast(None)
            self.tp = None
        if self.workers is not None:
            self.workers.stop(worker_timeout_s)
            self.workers = None
        if self.config.tensor_parallel_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _eos_ids(self) -> list[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Queue a request (on `lora_request`'s adapter when given). Raises ValueError for a
        prompt or adapter the engine cannot serve."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model's maximum context length is "
                             f"{self.max_model_len} tokens and at least 1 must be left for output")
        adapter = None
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
            adapter = self.lora.acquire(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seq = Sequence(f"{request_id}-{i}", ids, params, arrival_time=arrival, priority=priority,
                           cache_salt=cache_salt, lora=adapter)
            if params.seed is not None and i:
                seq.generator = torch.Generator().manual_seed(params.seed + i)
            seqs.append(seq)
        req = Request(request_id, text, ids, params, seqs,
                      [OutputText(self.tokenizer, ids, params) for _ in seqs], arrival, [0] * len(seqs))
        self.requests[request_id] = req
        for seq in seqs:
            self._seq_to_request[seq.seq_id] = req
            self.scheduler.add(seq)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
            self._seq_to_request.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.scheduler.max_num_batched_tokens)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        logits = self.runner.execute(sched.scheduled)
        sampling: list[Sequence] = []
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens:      # its end (and any drafts) ran: it samples
                sampling.append(seq)
            if not seq.spec_token_ids:   # a verifying sequence is hashed once rolled back to its accepted tokens
                self.block_manager.cache_full_blocks(seq)
        touched: dict[str, Request] = {}
        for seq, (tokens, logprobs) in zip(sampling, self._sample(logits, sampling)):
            req = self._seq_to_request[seq.seq_id]
            verified = bool(seq.spec_token_ids)
            if verified:
                # keep the K/V of the accepted drafts only; the last emitted token has none yet
                seq.num_computed_tokens -= len(seq.spec_token_ids) - (len(tokens) - 1)
                seq.spec_token_ids = []
            for token, lp in zip(tokens, logprobs):
                seq.append_token(token)
                if lp is not None:
                    seq.logprobs.append(lp)
                self._check_stop(req, seq)
                if seq.is_finished:
                    break
            if verified and not seq.is_finished:
                self.block_manager.trim(seq)
                self.block_manager.cache_full_blocks(seq)
            touched[req.request_id] = req
        return [self._make_output(req) for req in touched.values()]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Per sampling sequence, the tokens to emit and their logprobs: one sampled token, or,
        for a sequence verifying k drafts (1 + k logit rows), the accepted drafts plus one."""
        starts = list(itertools.accumulate((1 + len(s.spec_token_ids) for s in seqs), initial=0))
        plain = [i for i, s in enumerate(seqs) if not s.spec_token_ids]
        verifying = [i for i, s in enumerate(seqs) if s.spec_token_ids]
        results: list[tuple[list[int], list[TokenLogprobs | None]]] = [([], [])] * len(seqs)
        if plain:
            rows = logits if not verifying else logits[torch.tensor([starts[i] for i in plain], device=logits.device)]
            out = self.sampler(rows, [seqs[i] for i in plain])
            for j, i in enumerate(plain):
                results[i] = ([out.token_ids[j]], [out.logprobs[j]])
        if verifying:
            idx = [r for i in verifying for r in range(starts[i], starts[i + 1])]
            rows = logits if not plain else logits[torch.tensor(idx, device=logits.device)]
            for i, res in zip(verifying, self.spec.verify(rows, [seqs[i] for i in verifying])):
                results[i] = res
        return results

    def _check_stop(self, req: Request, seq: Sequence) -> None:
        p = seq.params
        token = seq.token_ids[-1]
        text = req.texts[req.seqs.index(seq)]
        stop_str = text.append(token)
        reason: str | None = None
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason, seq.stop_reason = "stop", None
            elif token in p.stop_token_ids:
                reason, seq.stop_reason = "stop", token
            elif stop_str is not None:
                reason, seq.stop_reason = "stop", stop_str
        if reason is None and (seq.num_output_tokens >= (p.max_tokens or self.max_model_len)
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.forget(seq)

    def _make_output(self, req: Request) -> RequestOutput:
        outs = []
        for i, (seq, text) in enumerate(zip(req.seqs, req.texts)):
            new_tokens = seq.num_output_tokens - req.emitted_tokens[i]
            req.emitted_tokens[i] = seq.num_output_tokens
            outs.append(CompletionOutput(
                index=i, text=text.text, token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                delta_text=text.take_delta(seq.is_finished), num_delta_tokens=new_tokens))
        finished = req.finished
        first = req.seqs[0]
        if finished:
            req.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            for seq in req.seqs:
                self._seq_to_request.pop(seq.seq_id, None)
        metrics = RequestMetrics(req.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 first.last_token_time, req.finished_time, first.num_cached_tokens,
                                 sum(s.num_preemptions for s in req.seqs))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, metrics,
                             first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs)
