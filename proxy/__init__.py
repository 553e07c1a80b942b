"""OpenAI-compatible prefill/decode proxy: fan-out, stream stitching, worker discovery."""
from __future__ import annotations

from common.roles import DEFAULT_KV_PORT
from proxy.app import ProxyState, create_app
from proxy.config import ProxyConfig, build_parser, parse_args
from proxy.errors import (BadRequest, ConfigError, NoWorkers, ProxyError, UpstreamError, UpstreamProtocol,
                          UpstreamStatus, UpstreamTimeout, UpstreamUnavailable, to_http)
from proxy.requests import CHAT, COMPLETIONS, ClientRequest, Endpoint, parse_request
from proxy.sse import SSEDecoder
from proxy.stitch import StreamStitcher, merge_bodies, summed_usage
from proxy.upstream import AiohttpUpstream, Timeouts, Upstream
from proxy.workers import KV_PROTOCOLS, WorkerPool, WorkerRecord, pick

__all__ = [
    "AiohttpUpstream", "BadRequest", "CHAT", "COMPLETIONS", "ClientRequest", "ConfigError", "DEFAULT_KV_PORT",
    "Endpoint", "KV_PROTOCOLS", "NoWorkers", "ProxyConfig", "ProxyError", "ProxyState", "SSEDecoder",
    "StreamStitcher", "Timeouts", "Upstream", "UpstreamError", "UpstreamProtocol", "UpstreamStatus",
    "UpstreamTimeout", "UpstreamUnavailable", "WorkerPool", "WorkerRecord", "build_parser", "create_app",
    "merge_bodies", "parse_args", "parse_request", "pick", "summed_usage", "to_http",
]
