"""The proxy's command line: compatible with the Neuron DI proxy, checked before anything starts."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from common.errors import TokenizerLoadError
from common.prefill_job import nats_url
from common.roles import DEFAULT_HOST, DEFAULT_KV_PORT, DEFAULT_PROXY_PORT, DISAGGREGATED_ROLES, ENCODE_ROLE
from common.tokenizer import Tokenizer
from common.tracing import add_traces_endpoint_flag
from proxy.conditional import DEFAULT_MAX_LOCAL_PREFILL_TOKENS, DEFAULT_MAX_PREFILL_QUEUE, ConditionalPolicy
from proxy.conditional_route import ConditionalConfig
from proxy.errors import ConfigError
from proxy.flows import DEFAULT_STRATEGY, STRATEGIES
from proxy import kv_route
from proxy.prefix_index import DEFAULT_BLOCK_SIZE
from proxy.upstream import Timeouts
from proxy.workers import KV_PROTOCOLS, WorkerRecord, static_worker


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything the proxy app needs; `etcd` is (host, port) for dynamic discovery.

    `kv_ports_given`: the keys of the static prefill workers whose KV port the command line names
    (the others' is what the worker reports on GET /health, else DEFAULT_KV_PORT). `conditional`:
    conditional disaggregation's settings, None when every request is disaggregated.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PROXY_PORT
    mode: str = "di"
    workers: tuple[WorkerRecord, ...] = ()
    kv_ports_given: frozenset[str] = frozenset()
    etcd: tuple[str, int] | None = None
    timeouts: Timeouts = Timeouts()
    health_interval: float = 2.0
    health_timeout: float = 2.0
    shutdown_grace: float = 5.0  # seconds streams may run on after SIGTERM before they end with an error
    strategy: str = DEFAULT_STRATEGY  # the flow of disaggregated requests to kv_protocol "neuron" workers
    conditional: ConditionalConfig | None = None
    prefill_queue: str | None = None  # nats://HOST:PORT of the global prefill queue; None: prefill legs over HTTP
    resume_streams: bool = False  # a stream whose decode worker is lost goes on on another (proxy/stream_moves.py)
    resend_lost_legs: int = 0  # times a request whose leg was lost before it answered is sent again (proxy/resend.py)
    routing: str = "round_robin"   # --routing: round_robin, least_loaded or kv
    kv_routing: kv_route.KVRoutingConfig | None = None   # --routing kv's settings (proxy/kv_route.py)
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP endpoint of trace spans (common/tracing.py); None: off

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="proxy_server.py", description="OpenAI-compatible prefill/decode proxy")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}, this host only, as every server of the "
                        "stack; 0.0.0.0 serves other hosts too)")
    p.add_argument("--port", type=int, default=DEFAULT_PROXY_PORT, help=f"HTTP port (default {DEFAULT_PROXY_PORT})")
    p.add_argument("--mode", choices=("di", "colocated"), default="di",
                   help="di: each request to a prefill and a decode worker (default); colocated: each request "
                        "to one `both` worker (--worker)")
    p.add_argument("--prefill-ip", help="static 1P1D: prefill worker host")
    p.add_argument("--prefill-port", type=int, help="static 1P1D: prefill worker HTTP port")
    p.add_argument("--prefill-kv-port", type=int,
                   help="static 1P1D: prefill signal port (default: the one the worker reports on GET /health, "
                        f"else {DEFAULT_KV_PORT}); one the worker contradicts keeps it out of rotation")
    p.add_argument("--decode-ip", help="static 1P1D: decode worker host")
    p.add_argument("--decode-port", type=int, help="static 1P1D: decode worker HTTP port")
    p.add_argument("--decode-status-port", type=int,
                   help="static 1P1D: the status port of a `vllm serve` decode worker's NeuronConnector "
                        "(`status_port` in its kv_connector_extra_config): a KV pull it fails reaches the client "
                        "as kv_transfer_error naming the prefill peer, not as vLLM's bare HTTP 500")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT[:KV_PORT]",
                   help="static xPyD prefill worker (repeat); KV_PORT as for --prefill-kv-port")
    p.add_argument("--decode", action="append", default=[], metavar="HOST:PORT[:STATUS_PORT]",
                   help="static xPyD decode worker (repeat); STATUS_PORT as for --decode-status-port")
    p.add_argument("--encode", action="append", default=[], metavar="HOST:PORT",
                   help="static encode worker (repeat): chat requests with image parts go to one first")
    p.add_argument("--kv-protocol", choices=KV_PROTOCOLS, default="neuron",
                   help="how the static prefill/decode workers are driven: neuron (our signal plane, both legs "
                        "at once; the default) or nixl (vLLM's NixlConnector: prefill first, its kv_transfer_params "
                        "to decode)")
    p.add_argument("--disaggregation-strategy", choices=STRATEGIES, default=DEFAULT_STRATEGY,
                   help="how a request's legs go to kv_protocol neuron workers: concurrent (both at once), "
                        "prefill_first (decode starts with prefill's answer) or decode_first (decode alone is "
                        "called and asks prefill for the KV itself); nixl workers always go prefill first, "
                        f"--mode colocated ignores it (default {DEFAULT_STRATEGY})")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT", help="colocated worker (repeat)")
    p.add_argument("--etcd", metavar="HOST:PORT", help="discover workers under /workers/ in etcd")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a worker (default 5)")
    p.add_argument("--read-timeout", type=float, default=600.0,
                   help="seconds allowed between two reads of a worker's answer (default 600)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between worker health checks (default 2)")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds a health check may take (default 2)")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds streams may run on after SIGTERM; then they end with an error event (default 5)")
    p.add_argument("--resume-streams", action="store_true",
                   help="a streamed answer whose decode worker dies or hands it back (drain) goes on on another "
                        "decode worker from the tokens already sent (our workers)")
    p.add_argument("--resend-lost-legs", type=int, default=0, metavar="N",
                   help="send a request again, up to N times, on other workers when a leg of it was lost (its "
                        "worker died) before any byte reached the client (default 0: only a leg that never "
                        "started goes on to the role's other workers)")
    add_traces_endpoint_flag(p)
    cond = p.add_argument_group("conditional disaggregation (di mode)")
    cond.add_argument("--conditional-disaggregation", action="store_true",
                      help="prefill a prompt on a prefill worker only when its part the decode worker has not cached "
                           "is longer than --max-local-prefill-tokens and the prefill queue is shorter than "
                           "--max-prefill-queue; else the decode worker serves the request alone (default: off)")
    cond.add_argument("--max-local-prefill-tokens", type=int, default=DEFAULT_MAX_LOCAL_PREFILL_TOKENS, metavar="N",
                      help=f"uncached prompt tokens a decode worker prefills itself (default {DEFAULT_MAX_LOCAL_PREFILL_TOKENS})")
    cond.add_argument("--max-prefill-queue", type=int, default=DEFAULT_MAX_PREFILL_QUEUE, metavar="M",
                      help="prefill legs in flight per prefill worker from which prompts stay with their decode "
                           f"workers (default {DEFAULT_MAX_PREFILL_QUEUE})")
    cond.add_argument("--tokenizer", metavar="PATH|builtin",
                      help="the served model's directory (tokenizer.json, tokenizer_config.json), or builtin for the "
                           "built-in model: the proxy counts prompt tokens with it")
    cond.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="N",
                      help=f"the decode workers' KV block size, for estimating their prefix caches (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--prefill-queue", metavar="nats://HOST:PORT",
                   help="put prefill legs on this NATS JetStream queue, which prefill workers started with the same "
                        "flag pull from when they have room, instead of sending them to a worker the proxy picks "
                        "(strategies concurrent and prefill_first; default: off)")
    kv_route.add_arguments(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    """Parses and checks the command line; ConfigError says what is wrong."""
    args = build_parser().parse_args(argv)
    _check_port("--port", args.port)
    for name in ("connect_timeout", "read_timeout", "health_interval", "health_timeout"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if args.shutdown_grace < 0:
        raise ConfigError("--shutdown-grace must be at least 0")
    workers, kv_ports_given = _static_workers(args)
    etcd = _host_port(args.etcd, "--etcd") if args.etcd else None
    if etcd and workers:
        raise ConfigError("give either static workers or --etcd, not both")
    if args.kv_protocol != "neuron" and (etcd or args.mode == "colocated"):
        raise ConfigError("--kv-protocol is for static prefill/decode workers; etcd records carry their own")
    if not etcd and not workers:
        need = "--worker" if args.mode == "colocated" else "--prefill-ip/--prefill-port/--decode-ip/--decode-port"
        raise ConfigError(f"no workers: give {need}, or --etcd HOST:PORT")
    return ProxyConfig(host=args.host, port=args.port, mode=args.mode, workers=workers,
                       kv_ports_given=kv_ports_given, etcd=etcd,
                       timeouts=Timeouts(args.connect_timeout, args.read_timeout),
                       health_interval=args.health_interval, health_timeout=args.health_timeout,
                       shutdown_grace=args.shutdown_grace,
                       strategy=args.disaggregation_strategy, conditional=_conditional(args),
                       prefill_queue=_prefill_queue(args), resume_streams=args.resume_streams,
                       resend_lost_legs=max(0, args.resend_lost_legs),
                       routing=args.routing, kv_routing=kv_route.routing_config(args, load_tokenizer),
                       otlp_traces_endpoint=args.otlp_traces_endpoint)


def _prefill_queue(args: argparse.Namespace) -> str | None:
    if args.prefill_queue is None:
        return None
    if args.mode == "colocated" or args.kv_protocol != "neuron":
        raise ConfigError("--prefill-queue is for di mode with kv_protocol neuron workers")
    try:
        return nats_url(args.prefill_queue)
    except ValueError as exc:
        raise ConfigError(f"--prefill-queue: {exc}") from exc


def _conditional(args: argparse.Namespace) -> ConditionalConfig | None:
    """Conditional disaggregation's settings (None if off); its flags without it, or it without a tokenizer,
    are a ConfigError."""
    given = [flag for flag, default in (("--tokenizer", None), ("--kv-block-size", DEFAULT_BLOCK_SIZE),
                                        ("--max-local-prefill-tokens", DEFAULT_MAX_LOCAL_PREFILL_TOKENS),
                                        ("--max-prefill-queue", DEFAULT_MAX_PREFILL_QUEUE))
             if getattr(args, flag[2:].replace("-", "_")) != default and (flag, args.routing) != ("--tokenizer", "kv")]
    if not args.conditional_disaggregation:
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --conditional-disaggregation")
        return None
    if args.mode == "colocated":
        raise ConfigError("--conditional-disaggregation is for di mode (prefill and decode workers)")
    if args.tokenizer is None:
        raise ConfigError("--conditional-disaggregation needs --tokenizer PATH|builtin to count prompt tokens")
    if args.kv_block_size < 1:
        raise ConfigError("--kv-block-size must be positive")
    if args.max_local_prefill_tokens < 0:
        raise ConfigError("--max-local-prefill-tokens must be at least 0")
    if args.max_prefill_queue < 1:
        raise ConfigError("--max-prefill-queue must be at least 1")
    policy = ConditionalPolicy(args.max_local_prefill_tokens, args.max_prefill_queue)
    return ConditionalConfig(load_tokenizer(args.tokenizer), policy, args.kv_block_size)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer --tokenizer names: "builtin", or a model directory; ConfigError if it cannot be loaded."""
    if spec == "builtin":
        return Tokenizer.builtin()
    path = Path(spec)
    try:
        model_config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        bos = model_config.get("bos_token_id") if isinstance(model_config, dict) else None
        return Tokenizer.from_dir(path, bos if isinstance(bos, int) else None)
    except (OSError, ValueError, TokenizerLoadError) as exc:
        raise ConfigError(f"--tokenizer {spec}: {exc}") from exc


def _static_workers(args: argparse.Namespace) -> tuple[tuple[WorkerRecord, ...], frozenset[str]]:
    """The command line's workers, and the keys of the prefill workers whose KV port it names."""
    one_p_one_d = [args.prefill_ip, args.prefill_port, args.decode_ip, args.decode_port]
    di_given = any(v is not None for v in one_p_one_d) or args.prefill or args.decode
    if args.mode == "colocated":
        if di_given or args.encode:
            raise ConfigError("--mode colocated takes --worker, not prefill/decode/encode workers")
        return tuple(static_worker("both", *_host_port(w, "--worker")) for w in args.worker), frozenset()
    encode = tuple(static_worker(ENCODE_ROLE, *_host_port(w, "--encode")) for w in args.encode)
    if args.worker:
        raise ConfigError("--worker is for --mode colocated; use --prefill/--decode in di mode")
    workers: list[WorkerRecord] = []
    kv_ports_given: set[str] = set()
    protocol = args.kv_protocol
    if any(v is not None for v in one_p_one_d):
        if any(v is None for v in one_p_one_d):
            raise ConfigError("static 1P1D needs all of --prefill-ip --prefill-port --decode-ip --decode-port")
        if args.prefill_kv_port is not None:
            _check_port("--prefill-kv-port", args.prefill_kv_port)
        workers.append(_prefill(args.prefill_ip, args.prefill_port, "--prefill-port", protocol,
                                args.prefill_kv_port, kv_ports_given))
        workers.append(_decode(args.decode_ip, args.decode_port, "--decode-port", protocol, args.decode_status_port))
    for spec in args.prefill:
        host, port, *kv = _split(spec, "--prefill", 3)
        workers.append(_prefill(host, _port(port, "--prefill"), "--prefill", protocol,
                                _port(kv[0], "--prefill") if kv else None, kv_ports_given))
    for spec in args.decode:
        host, port, *status = _split(spec, "--decode", 3)
        workers.append(_decode(host, _port(port, "--decode"), "--decode", protocol,
                               _port(status[0], "--decode") if status else None))
    if workers and {w.role for w in workers} != set(DISAGGREGATED_ROLES):
        raise ConfigError("di mode needs at least one prefill and one decode worker")
    if encode and not workers:
        raise ConfigError("--encode workers serve the prefill/decode workers of the command line: give those "
                          "too (with --etcd, encode workers register there)")
    workers.extend(encode)
    if len({w.key for w in workers}) != len(workers):
        raise ConfigError("the same worker is given twice")
    return tuple(workers), frozenset(kv_ports_given)


def _worker(role: str, host: str, port: int, flag: str, kv_protocol: str,
            kv_port: int = DEFAULT_KV_PORT) -> WorkerRecord:
    _check_port(flag, port)
    return static_worker(role, host, port, kv_port, kv_protocol)


def _decode(host: str, port: int, flag: str, kv_protocol: str, status_port: int | None) -> WorkerRecord:
    if status_port is not None:
        _check_port(flag if flag == "--decode" else "--decode-status-port", status_port)
    _check_port(flag, port)
    return static_worker("decode", host, port, kv_protocol=kv_protocol, status_port=status_port or 0)


def _prefill(host: str, port: int, flag: str, kv_protocol: str, kv_port: int | None,
             kv_ports_given: set[str]) -> WorkerRecord:
    """A static prefill worker; its key joins `kv_ports_given` if the command line names its KV port."""
    worker = _worker("prefill", host, port, flag, kv_protocol, DEFAULT_KV_PORT if kv_port is None else kv_port)
    if kv_port is not None:
        kv_ports_given.add(worker.key)
    return worker


def _split(spec: str, flag: str, max_parts: int) -> list[str]:
    parts = spec.split(":")
    if not 2 <= len(parts) <= max_parts or not parts[0]:
        tail = {"--prefill": "[:KV_PORT]", "--decode": "[:STATUS_PORT]"}.get(flag, "") if max_parts == 3 else ""
        raise ConfigError(f"{flag} {spec!r}: expected HOST:PORT{tail}")
    return parts


def _host_port(spec: str, flag: str) -> tuple[str, int]:
    host, port = _split(spec, flag, 2)
    return host, _port(port, flag)


def _port(text: str, flag: str) -> int:
    try:
        port = int(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: port {text!r} is not a number") from exc
    _check_port(flag, port)
    return port


def _check_port(flag: str, port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError(f"{flag}: port {port} is out of range 1-65535")
