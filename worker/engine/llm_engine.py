"""The engine: requests in, one scheduling step at a time, incremental outputs out."""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from scheduler import QueueFull, Scheduler, SchedulerConfig, WillNeverFit
from common.handoff import LegParams
from common.stream_resume import Resumed
from transfer.layout import KVLayout
from worker.config import EngineConfig
from worker.engine.decode_side import DecodeSide
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.kv_connector import KVConnector
from worker.engine.kv_write_back import WriteBackCounts
from worker.engine.prefill_side import PrefillSide
from worker.engine.request import Request, RequestOutput
from worker.engine.request_table import RequestTable
from worker.engine.resumed import check_resumed, take_resumed
from worker.engine.roles import EngineParts, EngineRole
from worker.engine.step_counters import StepCounters
from worker.errors import InvalidRequestError, QueueFullError, invalid
from worker.model.grammar import GrammarCompiler
from worker.model.loaded import CheckpointModel, LoadedModel
from worker.model.logprobs import TokenLogprobs
from worker.multimodal.embeds import ImageEmbeds, check_spans
from worker.sampling_params import MAX_LOGPROBS, SamplingParams

PoolAllocator = Callable[[KVLayout], torch.Tensor]
ROLE_SIDES: dict[str, type[EngineRole]] = {"both": EngineRole, "prefill": PrefillSide, "decode": DecodeSide}


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    num_transferring: int = 0   # prefill: finished, blocks held until pulled; decode: pulling
    counters: StepCounters = field(default_factory=StepCounters)   # a copy of the engine's running totals
    write_back: WriteBackCounts | None = None   # with --kv-write-back: a copy of its running totals


def zeros_pool(layout: KVLayout) -> torch.Tensor:
    return torch.zeros(layout.shape, dtype=layout.torch_dtype)


class LLMEngine:
    """A Llama-family model behind a paged KV pool and a continuous-batching scheduler.

    Used from one thread: add_request / abort_request between calls to step(). Roles prefill
    and decode need a `kv_connector`, which also provides the KV pool; the role's hooks
    (roles.py) run before and after each step. `model` is a model loaded already (an engine of
    another role had it, or it is the simulated one); by default the config's checkpoint is loaded.
    """

    def __init__(self, config: EngineConfig, allocate_pool: PoolAllocator | None = None,
                 kv_connector: KVConnector | None = None, model: LoadedModel | None = None) -> None:
        ROLE_SIDES[config.role].check_connector(kv_connector)
        self.config = config
        self.requests = RequestTable()
        self.kv_connector = kv_connector
        if allocate_pool is None and kv_connector is not None:
            allocate_pool = kv_connector.allocate_pool
        self.model = model or CheckpointModel.load(config.model, getattr(torch, config.dtype))
        self.model_config = self.model.config
        self.tokenizer = self.model.tokenizer
        self.model_name = config.served_model_name or self.model.name
        self.max_model_len = self._max_model_len()
        self.kv_layout = self._kv_layout()
        self.kv_pool = _checked_pool((allocate_pool or zeros_pool)(self.kv_layout), self.kv_layout)
        self.runner = self.model.runner(self.kv_pool, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=self.kv_layout.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.token_budget,
            enable_chunked_prefill=config.chunked_prefill,
            short_prompt_tokens=config.short_prompts, decode_pause_tokens=config.decode_pause_tokens,
            max_waiting=config.max_waiting, enable_prefix_caching=config.enable_prefix_caching,
            prefix_aware_transfer=config.prefix_aware_transfer, role=config.role,
        ), eos_token_ids=self.tokenizer.eos_token_ids)
        parts = EngineParts(self.scheduler, self.requests, self._output, self.model_config.vocab_size)
        self.role = ROLE_SIDES[config.role](parts, kv_connector)
        self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._rng = random.Random(config.seed)
        self._generate_ids = itertools.count()
        self.counters = StepCounters()

    def _max_model_len(self) -> int:
        # Full attention equals sliding-window attention while sequences fit in the window.
        mc = self.model_config
        limit = min(mc.max_position_embeddings, mc.sliding_window or mc.max_position_embeddings)
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit {limit} "
                             f"(max_position_embeddings {mc.max_position_embeddings}, "
                             f"sliding_window {mc.sliding_window})")
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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    leg: LegParams | None = None,
                    mm: list[tuple[int, ImageEmbeds]] | None = None, resumed: Resumed = Resumed(),
                    continues_chat: bool = False) -> None:
        """Queues a request; raises InvalidRequestError or QueueFullError instead of queueing it.

        `leg` (the parsed `kv_transfer_params`: role "prefill" or "decode") makes it one leg of a
        disaggregated request; a worker of role "both" ignores it. `mm` gives prompt
        positions start .. start + n - 1 the n rows of an image's embeddings as their input. `resumed`:
        the outputs of an answer another worker began (worker/engine/resumed.py). `continues_chat`: a chat
        whose messages hold an answer already (a decode worker writing back "chats" writes back its answer).
        """
        self._validate(request_id, prompt_token_ids, params)
        may_resume = leg is None or leg.role == self.config.role == "decode"   # a decode leg pulls a moved stream's KV
        check_resumed(resumed.token_ids, params.max_tokens, self.model_config.vocab_size, not may_resume)
        spans = check_spans(mm or [], len(prompt_token_ids), self.model_config.hidden_size, self.kv_layout.torch_dtype)
        role_leg = self.role.leg(request_id, leg)
        if role_leg.pull_target is not None and params.prompt_logprobs is not None:
            raise invalid("prompt_logprobs cannot be computed by a decode leg, whose prompt KV is pulled: "
                          "the prefill worker computes them", "prompt_logprobs")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        wants_prompt_logprobs = params.prompt_logprobs is not None
        request = Request(
            request_id=request_id, token_ids=list(prompt_token_ids), max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos, block_size=self.config.block_size, params=params,
            stop_token_ids=frozenset(params.stop_token_ids), reads_prefix_cache=not wants_prompt_logprobs,
            generator=torch.Generator(device=self.kv_pool.device).manual_seed(seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens),
            remote_kv=role_leg.remote_kv, pull_target=role_leg.pull_target, continues_chat=continues_chat,
            mm=tuple(mm or ()), mm_spans=spans, prompt_logprobs=[None] if wants_prompt_logprobs else None,
            grammar=self._grammars.matcher(params.grammar, "response_format") if params.grammar else None,
        )
        take_resumed(request, resumed, self.model_config.vocab_size)
        try:
            self.scheduler.add(request)
        except WillNeverFit as exc:
            raise InvalidRequestError(str(exc)) from exc
        except QueueFull as exc:
            raise QueueFullError(str(exc)) from exc
        self.requests.add(request)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self.requests or self.role.remembers(request_id):
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
        _check_token_ids(params, vocab)

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its blocks; the next step() reports it once.

        A request that is done generating, or not here (yet), is left to the role: a prefill
        worker drops the KV it holds for a pull nobody will make, and refuses a late leg.
        """
        request = self.requests.generating(request_id)
        if request is None:
            self.role.abandon(request_id)
            return
        self.role.abort(request)
        self.requests.aborted(request)

    def step(self) -> list[RequestOutput]:
        """The role's hook, then schedule / run / postprocess, then the role's hook."""
        outputs = self.requests.take_aborted() + self.role.before_step()
        step = self.scheduler.schedule()
        if step:
            started = time.perf_counter()
            result = self.runner.run(step)
            self.counters.count(step, time.perf_counter() - started)
            for seq, first, entries in result.prompt_logprobs:
                seq.add_prompt_logprobs(first, entries)
            seqs: list[Request] = step.sampled   # type: ignore[assignment]  # it schedules only Requests
            self.scheduler.postprocess(seqs, result.token_ids)
            for seq, token_id in zip(seqs, result.token_ids):
                seq.advance(token_id)
            outputs.extend(self._output(*out) for out in zip(seqs, result.token_ids, result.logprobs))
            self.role.after_step(seqs)
        return outputs

    def wait_hint(self) -> float | None:
        """How long the driver may wait for a command before the next step: 0 = step now,
        None = nothing to do until a command (or a KV connector's wake-up) arrives."""
        if self.requests.has_unreported_aborts() or self.scheduler.has_runnable() or self.role.has_work():
            return 0.0
        return self.role.wait_hint()

    def close(self) -> None:
        """Stops the KV connector's thread (role prefill or decode); the engine is unusable after."""
        self.role.close()

    def _output(self, request: Request, token_id: int, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """The RequestOutput of `request`'s newest token; a request done and holding no blocks leaves the table."""
        # A prefill leg's text goes on on the decode worker: hand out only what a streaming
        # server would for this token, so the proxy can swap in the decode worker's copy of it.
        # (A decode leg is remote_kv only until its KV arrived, before its first output.)
        done = request.finished_generating
        stop_token = self._stop_token(request, token_id) if done else None
        text_ids = request.output_token_ids[:-1] if stop_token is not None else request.output_token_ids
        delta = request.detokenizer.step(text_ids, done and not request.remote_kv)
        eos = stop_token is not None and not request.ignore_eos and stop_token in self.tokenizer.eos_token_ids
        stop_reason = None if stop_token is None or eos else stop_token   # vLLM names stop token ids, not EOS
        if request.detokenizer.stopped:
            self.scheduler.finish(request, "stop")
            request.finish_reason = "stop"  # a stop string wins over max_tokens on the same token
            stop_reason, done = request.detokenizer.stop_string, True
        if done and request.is_finished:
            self.requests.remove(request.request_id)
        p = request.params
        first = request.num_output_tokens == 1
        return RequestOutput(request.request_id, [token_id], delta, done,
                             request.finish_reason, request.num_prompt_tokens, request.num_output_tokens,
                             stop_reason=stop_reason, logprobs=None if p.logprobs is None else [logprobs],
                             prompt_logprobs=request.prompt_logprobs if first else None)

    def _stop_token(self, request: Request, token_id: int) -> int | None:
        """`token_id` if it ended the request as EOS or a stop token id does (vLLM leaves its text out);
        an EOS id given in stop_token_ids counts as EOS unless ignore_eos."""
        if request.finish_reason != "stop" or request.detokenizer.stopped:
            return None
        eos = not request.ignore_eos and token_id in self.tokenizer.eos_token_ids
        return token_id if eos or token_id in request.stop_token_ids else None

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or blocks still held for (or by) a transfer."""
        return self.requests.has_work() or self.role.holds_kv()

    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           len(bm.used_block_ids), bm.num_blocks, len(self.scheduler.transferring),
                           replace(self.counters), self.role.write_back_counts())

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Runs `prompts` to completion on an idle engine; the output token ids of each prompt."""
        if self.has_unfinished_requests():
            raise InvalidRequestError("generate() needs an idle engine: other requests' outputs would be lost")
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
                    if out.error is not None and out.request_id in unfinished:
                        raise out.error
                    if out.request_id in unfinished:
                        tokens[out.request_id].extend(out.new_token_ids)
                        if out.finished:
                            unfinished.discard(out.request_id)
        finally:
            for request_id in unfinished:
                self.abort_request(request_id)
        return list(tokens.values())


def _check_token_ids(params: SamplingParams, vocab: int) -> None:
    """The token ids and logprob counts of `params` against the vocabulary (vLLM's limits and wording)."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias))):
        if outside := [t for t in ids if not 0 <= t < vocab]:
            raise invalid(f"token_id(s) {outside} in {name} contain out-of-vocab token ids. "
                          f"Vocabulary size: {vocab}", name)
    for name, label in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        wanted = getattr(params, name)
        if wanted is not None and (vocab if wanted == -1 else wanted) > MAX_LOGPROBS:
            raise invalid(f"Requested {label} logprobs of {vocab if wanted == -1 else wanted}, which is "
                          f"greater than max allowed: {MAX_LOGPROBS}", name)


def _checked_pool(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    # The model writes through views of the pool, so it must be exactly the agreed layout.
    if tuple(pool.shape) != layout.shape or pool.dtype != layout.torch_dtype or not pool.is_contiguous():
        raise ValueError(f"allocate_pool returned a {tuple(pool.shape)} {pool.dtype} tensor "
                         f"(contiguous={pool.is_contiguous()}); expected contiguous {layout.shape} "
                         f"{layout.torch_dtype}")
    # Masked attention multiplies unused slots by zero, which only NaN/inf garbage survives;
    # after this the pool only ever holds values the model (or a peer's model) computed.
    return pool.zero_()
