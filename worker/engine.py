"""The engine: requests in, one scheduling step at a time, incremental outputs out."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from scheduler import QueueFull, Scheduler, SchedulerConfig, WillNeverFit
from transfer.layout import KVLayout
from worker.config import EngineConfig
from worker.detokenizer import IncrementalDetokenizer
from worker.errors import InvalidRequestError, QueueFullError
from worker.loader import BUILTIN_MODEL_NAME, builtin_model_path, load_config, load_model
from worker.model_runner import ModelRunner
from worker.request import Request
from worker.sampling_params import SamplingParams
from worker.tokenizer import Tokenizer

PoolAllocator = Callable[[KVLayout], torch.Tensor]


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None        # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int


def zeros_pool(layout: KVLayout) -> torch.Tensor:
    return torch.zeros(layout.shape, dtype=layout.torch_dtype)


class LLMEngine:
    """A Llama-family model behind a paged KV pool and a continuous-batching scheduler.

    Used from one thread: add_request / abort_request between calls to step().
    """

    def __init__(self, config: EngineConfig, allocate_pool: PoolAllocator | None = None) -> None:
        if config.role != "both":
            raise ValueError(f"role {config.role!r} needs the KV connector; this engine serves role 'both'")
        self.config = config
        path = Path(config.model) if config.model is not None else builtin_model_path()
        self.model_config = load_config(path)
        self.tokenizer = Tokenizer.from_dir(path, self.model_config)
        self.model_name = config.served_model_name or (BUILTIN_MODEL_NAME if config.model is None else path.name)
        self.max_model_len = self._max_model_len()
        self.kv_layout = self._kv_layout()
        self.kv_pool = _checked_pool((allocate_pool or zeros_pool)(self.kv_layout), self.kv_layout)
        model = load_model(path, self.model_config, self.kv_layout.torch_dtype).to(self.kv_pool.device)
        self.runner = ModelRunner(model, self.kv_pool, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=self.kv_layout.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting=config.max_waiting, enable_prefix_caching=config.enable_prefix_caching,
        ), eos_token_ids=self.tokenizer.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        self._generate_ids = itertools.count()

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return self.config.max_model_len or limit

    def _kv_layout(self) -> KVLayout:
        mc = self.model_config
        one_block = KVLayout(mc.num_hidden_layers, 1, self.config.block_size, mc.num_key_value_heads,
                             mc.head_dim, self.config.dtype)
        num_blocks = self.config.num_kv_blocks or self.config.kv_cache_bytes // one_block.block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes {self.config.kv_cache_bytes} is smaller than one KV block "
                             f"({one_block.block_bytes} bytes)")
        return KVLayout(mc.num_hidden_layers, num_blocks, self.config.block_size, mc.num_key_value_heads,
                        mc.head_dim, self.config.dtype)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queues a request; raises InvalidRequestError or QueueFullError instead of queueing it."""
        self._validate(request_id, prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id=request_id, token_ids=list(prompt_token_ids), max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos, block_size=self.config.block_size, params=params,
            generator=torch.Generator().manual_seed(seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
        )
        try:
            self.scheduler.add(request)
        except WillNeverFit as exc:
            raise InvalidRequestError(str(exc)) from exc
        except QueueFull as exc:
            raise QueueFullError(str(exc)) from exc
        self.requests[request_id] = request

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum model length {self.max_model_len}")

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its blocks; the next step() reports it once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.finish(request, "abort")
        self._aborted.append(RequestOutput(request_id, [], "", True, "abort", request.num_prompt_tokens,
                                           request.num_output_tokens))

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if self.scheduler.is_finished():
            return outputs
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return outputs
        token_ids = self.runner.run(seqs, is_prefill)
        self.scheduler.postprocess(seqs, token_ids)
        outputs.extend(self._output(seq, token_id) for seq, token_id in zip(seqs, token_ids))
        return outputs

    def _output(self, request: Request, token_id: int) -> RequestOutput:
        delta = request.detokenizer.step(request.output_token_ids, request.is_finished)
        if request.detokenizer.stopped:
            self.scheduler.finish(request, "stop")
        if request.is_finished:
            del self.requests[request.request_id]
        return RequestOutput(request.request_id, [token_id], delta, request.is_finished,
                             request.finish_reason, request.num_prompt_tokens, request.num_output_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._aborted)

    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           len(bm.used_block_ids), bm.num_blocks)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Runs `prompts` to completion (alongside any queued requests); output ids per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        tokens: dict[str, list[int]] = {f"generate-{next(self._generate_ids)}": [] for _ in prompts}
        unfinished = set(tokens)
        try:
            for request_id, prompt, p in zip(tokens, prompts, params_list):
                self.add_request(request_id, prompt, p)
            while unfinished:
                for out in self.step():
                    if out.request_id in unfinished:
                        tokens[out.request_id].extend(out.new_token_ids)
                        if out.finished:
                            unfinished.discard(out.request_id)
        finally:
            for request_id in unfinished:
                self.abort_request(request_id)
        return list(tokens.values())


def _checked_pool(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    # The model writes through views of the pool, so it must be exactly the agreed layout.
    if tuple(pool.shape) != layout.shape or pool.dtype != layout.torch_dtype or not pool.is_contiguous():
        raise ValueError(f"allocate_pool returned a {tuple(pool.shape)} {pool.dtype} tensor "
                         f"(contiguous={pool.is_contiguous()}); expected contiguous {layout.shape} "
                         f"{layout.torch_dtype}")
    # Masked attention multiplies unused slots by zero, which only NaN/inf garbage survives;
    # after this the pool only ever holds values the model (or a peer's model) computed.
    return pool.zero_()
