"""`python -m worker`: one worker serving the OpenAI API, run by hypercorn until SIGTERM or SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import secrets
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from common.kv_events import KVEventsConfig, KVEventsError
from common.kv_secret import SECRET_FILE_ENV, KVSecretError, resolve_secret, secret_id
from common.listen import hypercorn_bind, listen_socket
from common.tracing import Tracing, add_traces_endpoint_flag
from common.roles import (DEFAULT_HOST, DEFAULT_HTTP_PORTS, DEFAULT_KV_PORT, DISAGGREGATED_ROLES, ENCODE_ROLE,
                          WORKER_ROLES)
from worker.config import (CHUNKED_BY_DEFAULT, DEFAULT_CHUNKED_BUDGET, DEFAULT_DECODE_PAUSE_TOKENS,
                           DEFAULT_SHORT_PROMPT_TOKENS, DEFAULT_UNCHUNKED_BUDGET, DEFAULT_WRITE_BACK, WRITE_BACK_MODES,
                           EngineConfig)
from worker.dtype import AUTO, BF16_CPU_FLAGS
from worker.mock import flags as mock_flags
from worker.model.model_config import ModelConfig
from worker.multimodal import flags as embeds_flags
from worker.server import prefill_queue_flags
from worker.server.drain import DEFAULT_TIMEOUT_S as DEFAULT_DRAIN_TIMEOUT_S
from worker.server.kv_events_publisher import KVEventsPublisher

if TYPE_CHECKING:
    from worker.multimodal.media import MediaPolicy

logger = logging.getLogger("worker")
TRANSPORTS = ("auto", "shm", "tcp", "nixl", "neuron")
LAST_ANSWERS_S = 5.0  # after the drain: time for the engine to stop and the ended requests to answer


def _integer_from(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


_positive = _integer_from(1)
_non_negative = _integer_from(0)


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line, one argument group per concern, so the KV-transfer flags get a group of their own."""
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    server = parser.add_argument_group("server")
    server.add_argument("--role", choices=WORKER_ROLES, default="both",
                        help="both: prefill and decode here (default); prefill/decode: one side of disaggregated "
                             "serving; encode: loads image parts and keeps their embeddings for prefill workers "
                             "to pull")
    server.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default {DEFAULT_HOST}, this host only, as every server of the "
                             "stack; 0.0.0.0 serves other hosts too)")
    server.add_argument("--advertise-host", default=None,
                        help="address others reach this worker at, registered in etcd and shown in GET /health "
                             "(default: --host; give one when --host is 0.0.0.0)")
    server.add_argument("--port", type=_port, default=None,
                        help="HTTP port (default by role: " + ", ".join(f"{port} for {role}" for role, port in
                                                                         DEFAULT_HTTP_PORTS.items()) + ")")
    server.add_argument("--threads", type=_positive, default=None,
                        help="torch intra-op threads (default: torch's own, one per core)")
    server.add_argument("--drain-timeout", "--shutdown-grace", dest="drain_timeout", type=float,
                        default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="seconds a drain (SIGTERM or POST /drain) may take: the worker leaves etcd, refuses "
                             "new requests (503), finishes those running and, on prefill, serves the KV not yet "
                             "pulled; then it exits, ending what is left with an error "
                             f"(default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    server.add_argument("--drain-hands-back-streams", action="store_true",
                        help="a drain ends each running stream after its tokens so far, for the proxy (with "
                             "--resume-streams) to go on with on another worker, instead of finishing it here")
    server.add_argument("--hand-back-kv-port", type=int, default=None, metavar="PORT",
                        help="decode (or prefill, for when it changes role to decode): the signal-plane port (0: a "
                             "free one) where, with --drain-hands-back-streams, a handed-back stream's KV waits for "
                             "the next decode worker to pull over the transfer engine, instead of that worker "
                             "recomputing it, and where the answers' KV written back waits for its prefill worker "
                             "(--kv-write-back; a free port when not given)")
    add_traces_endpoint_flag(server)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    engine.add_argument("--served-model-name", default=None,
                        help="model id in the API (default: from the model)")
    engine.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (default 16)")
    engine.add_argument("--num-kv-blocks", type=_positive, default=None,
                        help="KV blocks (default: as many as the cache budget holds)")
    engine.add_argument("--max-num-seqs", type=_positive, default=16, help="requests in one running batch (default 16)")
    engine.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                        help=f"tokens one step computes: with chunked prefill the decodes plus prompt chunks "
                             f"(default {DEFAULT_CHUNKED_BUDGET}, or --max-num-seqs if larger), without it whole "
                             f"prompts batched together, one alone may exceed it (default {DEFAULT_UNCHUNKED_BUDGET})")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="prefill long prompts in chunks that share each step with the running requests' "
                             "decodes, so streams never stall for a whole prefill (default: on for roles "
                             f"{' and '.join(CHUNKED_BY_DEFAULT)}, off for prefill)")
    engine.add_argument("--short-prompt-tokens", type=_non_negative, default=None,
                        help="with chunked prefill, prompts of at most this many tokens run in steps of their "
                             "own, ahead of the running requests' decodes, so a wave of them stalls the "
                             "streams once, not once per prompt; longer prompts share steps with the decodes "
                             f"(default {DEFAULT_SHORT_PROMPT_TOKENS} for role both, 0 (off) for decode)")
    engine.add_argument("--decode-pause-tokens", type=_positive, default=DEFAULT_DECODE_PAUSE_TOKENS,
                        help="the prompt tokens short prompts may run while the running requests wait for "
                             f"their next token; then one step decodes them (default {DEFAULT_DECODE_PAUSE_TOKENS})")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of prompt prefixes computed before (default: on)")
    engine.add_argument("--max-waiting", type=_positive, default=256, help="queued requests before 503s (default 256)")
    engine.add_argument("--max-model-len", type=_positive, default=None, help="context length (default: the model's)")
    engine.add_argument("--dtype", choices=(AUTO, "float32", "bfloat16"), default="float32",
                        help="what weights, activations and the KV cache are held in (norms, softmax and sampling "
                             f"run in float32 whatever it is); {AUTO}: bfloat16 where the CPU has "
                             f"{' or '.join(BF16_CPU_FLAGS)}, else float32. Prefill and decode workers must agree: "
                             "their KV handshake refuses a peer of another dtype (default float32)")
    engine.add_argument("--seed", type=int, default=0, help="seed for requests that bring none (default 0)")
    media = parser.add_argument_group("multimodal (chat image parts holding precomputed embeddings)")
    media.add_argument("--allowed-local-media-path", type=Path, default=None,
                       help="directory image parts may read local files from (paths and file:// urls); without it "
                            "no local file is read. Paths leaving it (.., symlinks, absolute paths) are refused")
    media.add_argument("--max-file-size-mb", type=float, default=50,
                       help="largest embeddings file, download or data: url an image part may load (default 50)")
    kv = parser.add_argument_group("KV transfer (roles prefill and decode)")
    kv.add_argument("--kv-transport", choices=TRANSPORTS, default="auto", help="KV block transport (default auto)")
    kv.add_argument("--kv-host", default="127.0.0.1", help="address of the KV signal plane (default 127.0.0.1)")
    kv.add_argument("--kv-port", type=int, default=DEFAULT_KV_PORT,
                    help=f"prefill: port of the KV signal plane, 0 = a free one (default {DEFAULT_KV_PORT})")
    kv.add_argument("--engine-id", default=None,
                    help="this worker's id on the signal plane, unique per worker: a prefill worker refuses a decode "
                         "worker whose id another live decode worker holds (default hostname:port:random)")
    kv.add_argument("--kv-secret-file", default=None,
                    help="file (mode 600) holding the secret shared by every worker of this deployment: the signal "
                         f"plane and the tcp transport then authenticate peers (default: ${SECRET_FILE_ENV}; "
                         "neither: unauthenticated)")
    kv.add_argument("--kv-abort-timeout", type=float, default=60.0,
                    help="prefill: free KV blocks not pulled within this many seconds (default 60)")
    kv.add_argument("--kv-pull-timeout", type=float, default=30.0,
                    help="decode: fail a request whose KV has not arrived within this many seconds (default 30)")
    kv.add_argument("--kv-integrity-check", action=argparse.BooleanOptionalAction, default=True,
                    help="decode: ask the prefill worker for a CRC-32C of the KV blocks it sends and fail the "
                         "request (kv_transfer_error) when the blocks received do not match (default: on; "
                         "--no-kv-integrity-check turns it off)")
    kv.add_argument("--prefix-aware-transfer", action=argparse.BooleanOptionalAction, default=True,
                    help="decode: pull only the prompt's KV blocks this worker's prefix cache lacks, and cache the "
                         "pulled ones for the next prompt with that prefix (default: on; needs prefix caching)")
    kv.add_argument("--kv-write-back", nargs="?", const="all", default=None, choices=WRITE_BACK_MODES,
                    metavar="{" + ",".join(WRITE_BACK_MODES) + "}",
                    help="a decode worker offers the KV of finished answers back to the prefill worker that served "
                         "their prompt, which pulls it into its prefix cache, so a chat's next turn sent there "
                         "computes only the new message. chats: the answers to chats whose messages hold an answer "
                         "already (a conversation under way); all (the flag alone): every answer; off: none, and a "
                         f"prefill worker takes none (default: {DEFAULT_WRITE_BACK})")
    kv.add_argument("--kv-events-config", default=None, metavar="JSON",
                    help="publish KV cache events as vLLM does, e.g. '{\"enable_kv_cache_events\":true,"
                         "\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}' (default: off)")
    kv.add_argument("--etcd", default=None, help="host:port of etcd to register this worker in (optional)")
    kv.add_argument("--etcd-ttl", type=_positive, default=10, help="registration lease TTL in seconds (default 10)")
    embeds_flags.add_arguments(parser)
    mock_flags.add_arguments(parser)
    prefill_queue_flags.add_arguments(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """Parses and validates everything up front; a bad value exits with status 2 and a clear message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kv_write_back is not None and args.role not in DISAGGREGATED_ROLES:
        parser.error("--kv-write-back is for prefill and decode workers")
    args.kv_write_back = args.kv_write_back or DEFAULT_WRITE_BACK
    hands_back = args.drain_hands_back_streams or args.kv_write_back != "off"   # streams, or answers' KV
    if args.hand_back_kv_port is not None and not (hands_back and args.role in DISAGGREGATED_ROLES
                                                   and 0 <= args.hand_back_kv_port <= 65535):
        parser.error("--hand-back-kv-port is a TCP port or 0, for a decode worker (or a prefill worker that may "
                     "change role to decode) with --drain-hands-back-streams or write-back")
    if not 0 <= args.kv_port <= 65535:
        parser.error(f"--kv-port must be a TCP port or 0, got {args.kv_port}")
    if args.kv_abort_timeout <= 0 or args.kv_pull_timeout <= 0:
        parser.error("--kv-abort-timeout and --kv-pull-timeout must be positive")
    if not args.max_file_size_mb > 0:
        parser.error(f"--max-file-size-mb must be positive, got {args.max_file_size_mb:g}")
    if args.allowed_local_media_path is not None and not args.allowed_local_media_path.is_dir():
        parser.error(f"--allowed-local-media-path {args.allowed_local_media_path} is not a directory")
    if args.drain_timeout < 0:
        parser.error(f"--drain-timeout must be at least 0, got {args.drain_timeout:g}")
    if args.model is not None:   # read before torch loads: a wrong path fails in a moment, naming the flag
        try:
            ModelConfig.from_dir(args.model)
        except ValueError as exc:
            parser.error(f"--model {args.model}: {exc}")
    embeds_flags.check(parser, args)
    prefill_queue_flags.check(parser, args)
    if args.port is None:
        args.port = DEFAULT_HTTP_PORTS[args.role]
    args.cost_model = mock_flags.cost_model(parser, args)
    try:
        args.kv_secret = resolve_secret(args.kv_secret_file)
    except KVSecretError as exc:
        parser.error(str(exc))
    args.engine_id = args.engine_id or default_engine_id(args.port)
    try:
        args.kv_events = KVEventsConfig.parse(args.kv_events_config) if args.kv_events_config else None
    except KVEventsError as exc:
        parser.error(str(exc))
    try:
        config = EngineConfig(model=args.model, served_model_name=args.served_model_name,
                              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                              max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              enable_chunked_prefill=args.enable_chunked_prefill,
                              short_prompt_tokens=args.short_prompt_tokens,
                              decode_pause_tokens=args.decode_pause_tokens,
                              enable_prefix_caching=args.enable_prefix_caching,
                              prefix_aware_transfer=args.prefix_aware_transfer,
                              max_model_len=args.max_model_len, seed=args.seed, dtype=args.dtype,
                              role="both" if args.role == ENCODE_ROLE else args.role)  # encode: no engine runs
    except ValueError as exc:
        parser.error(str(exc))
    return args, config


def hypercorn_config(host: str, port: int) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.startup_timeout = 600  # loading a real model can take minutes
    # Hypercorn stops only once the drain is over: connections are cut after the requests it ended
    # have sent their errors.
    config.graceful_timeout = LAST_ANSWERS_S
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # into our logging setup, printed once
    return config


async def run_server(args: argparse.Namespace, engine_config: EngineConfig) -> bool:
    """Serves until a drain (SIGTERM, SIGINT or POST /drain, see worker/server/drain.py) is over; then
    hypercorn stops and the engine thread is joined. True if a second signal cut the drain short.

    The HTTP port is bound first and the engine started before hypercorn runs, so a port in use or
    a failed start (model, KV port) ends the worker with one line saying why."""
    listener = listen_socket(args.host, args.port)
    server = hypercorn_config(args.host, args.port)
    server.bind = [hypercorn_bind(listener)]
    if args.role == ENCODE_ROLE:
        from worker.encode.serve import run_encode_server
        await run_encode_server(args, engine_config, server, media_policy(args))
        return False
    from worker.server.app import create_app  # imports torch: only once the command line is known to be good
    from worker.server.registrar import Registrar

    events = KVEventsPublisher(args.kv_events) if args.kv_events is not None else None
    app = create_app(engine_config, engine_factory=engine_factory(args, engine_config, events=events),
                     drain_timeout=args.drain_timeout, media_policy=media_policy(args),
                     embeds_region=embeds_region(args) if args.role == "prefill" else None,
                     registrar=Registrar(lambda engine: worker_record(args, engine), args.etcd, args.etcd_ttl),
                     make_engine=lambda role, model: engine_factory(args, engine_config, role, model, events),
                     tracing=Tracing.start(args.otlp_traces_endpoint, f"neuron-di-{args.role}"))
    worker = app.extensions["neuron_di_worker"]
    if args.drain_hands_back_streams:
        from worker.server.hand_back import HandBack
        worker.drain.hand_back = HandBack(worker.async_engine if args.hand_back_kv_port is not None else None)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.drain.signal)
    logger.info("starting the engine, then serving on http://%s:%d (role %s)", args.host, args.port, args.role)
    await worker.startup()
    # What start built (torch, the model) lives as long as the worker: frozen, the collector does not scan
    # it while serving, nor walk it at exit (torch's made every stop ~0.5 s longer).
    gc.freeze()
    queue = None
    if args.prefill_queue:
        queue = prefill_queue_flags.QueueSide(worker, args)
        queue.start()
        if worker.role_flip is not None:
            worker.role_flip.role_changed = queue.follow
    try:
        await serve(app, server, shutdown_trigger=worker.drain.done.wait)
    finally:
        if queue is not None:
            await queue.stop()
        if events is not None:
            events.close()
    return worker.drain.forced


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    from worker.multimodal.media import MediaPolicy  # imports torch, as create_app does

    return MediaPolicy(args.allowed_local_media_path, args.max_file_size_mb)


def embeds_region(args: argparse.Namespace) -> Callable[[int, Any], Any]:
    """Makes a prefill worker's region of embedding rows (worker/multimodal/rows.py) once the model is known."""
    def make(hidden_size: int, dtype: Any) -> Any:
        from worker.multimodal.rows import RowRegion, rows_in

        return RowRegion(args.kv_transport, args.kv_host, hidden_size, dtype,
                         rows_in(args.embeds_region_mb, hidden_size, dtype), args.kv_secret)
    return make


def engine_factory(args: argparse.Namespace, engine_config: EngineConfig, role: str | None = None,
                   model: Any = None, events: KVEventsPublisher | None = None) -> Callable[[], Any]:
    """Builds the engine (with its KV connector for roles prefill and decode) on the engine thread: of `role`
    (default: the command line's) on `model` (default: loaded from the command line's, or the simulated one),
    its KV cache events published by `events`."""
    from dataclasses import replace

    from worker.engine.llm_engine import LLMEngine
    from worker.engine.kv_connector import KVConnector, KVConnectorConfig

    def published(engine: LLMEngine) -> LLMEngine:
        if events is not None:
            events.attach(engine)
        return engine

    def build() -> LLMEngine:
        config = engine_config if role is None else replace(engine_config, role=role)
        loaded = model
        if args.cost_model is not None:
            from worker.mock.model import MockModel
            loaded = loaded or MockModel.load(config.model, args.cost_model)
            config = loaded.with_real_capacity(config)
        if config.role == "both":
            return published(LLMEngine(config, model=loaded))
        connector = KVConnector(KVConnectorConfig(
            role=config.role, transport=args.kv_transport, kv_host=args.kv_host, kv_port=args.kv_port,
            engine_id=args.engine_id, abort_timeout=args.kv_abort_timeout,
            pull_timeout=args.kv_pull_timeout, secret=args.kv_secret, integrity_check=args.kv_integrity_check,
            hand_back_port=args.hand_back_kv_port if config.role == "decode" else None,
            write_back=args.kv_write_back))
        try:
            return published(LLMEngine(config, kv_connector=connector, model=loaded))
        except BaseException:
            connector.close()
            raise
    return build


def default_engine_id(port: int) -> str:
    """Unique per process and host, readable: `hostname:port:` and a random suffix (workers on
    different hosts often share `--host 0.0.0.0 --port 8200`)."""
    return f"{socket.gethostname()}:{port}:{secrets.token_hex(4)}"


def worker_record(args: argparse.Namespace, engine: Any) -> Any:
    """The record of this worker running `engine`: its GET /health answer shows it, and with --etcd it is
    registered in etcd (revoked when a drain or a change of role starts, or at exit)."""
    from common.worker_record import OUR_SERVER, WorkerRecord

    kv_port = engine.kv_connector.kv_port if engine.kv_connector is not None else 0
    return WorkerRecord(role=engine.config.role, host=args.advertise_host or args.host, http_port=args.port,
                        kv_host=args.kv_host, kv_port=kv_port, engine_id=args.engine_id,
                        transfer={"backend": args.kv_transport}, model=engine.model_name,
                        kv_secret_id=secret_id(args.kv_secret) if engine.kv_connector is not None else "",
                        dtype=engine.config.dtype, server=OUR_SERVER,
                        kv_events=args.kv_events.connect_endpoint(args.advertise_host or args.host)
                        if args.kv_events is not None else "")


def main(argv: Sequence[str] | None = None) -> int:
    args, engine_config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        forced = asyncio.run(run_server(args, engine_config))
    except Exception as exc:  # startup failures (bad model path, port in use) end with a message, not a trace
        logger.error("worker failed: %s", exc)
        return 1
    return 1 if forced else 0


if __name__ == "__main__":
    sys.exit(main())
