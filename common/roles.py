"""The worker roles and the stack's default ports: the one home for them."""
from __future__ import annotations

# "both" serves whole requests; "prefill" and "decode" are the two halves of a disaggregated one.
ROLES = ("both", "prefill", "decode")
DISAGGREGATED_ROLES = ("prefill", "decode")
# "encode" turns a request's image parts into embeddings held for the prefill worker to pull; it runs no engine.
ENCODE_ROLE = "encode"
WORKER_ROLES = ROLES + (ENCODE_ROLE,)

# Every server of the stack listens on this host only unless its --host says otherwise.
DEFAULT_HOST = "127.0.0.1"
# The HTTP ports the proxy and each worker role listen on unless told otherwise (`both` as `vllm serve`).
DEFAULT_PROXY_PORT = 8000
DEFAULT_HTTP_PORTS = {"both": 8000, "prefill": 8100, "decode": 8200, ENCODE_ROLE: 8300}
# The port a prefill worker's KV signal plane listens on unless told otherwise.
DEFAULT_KV_PORT = 14579
