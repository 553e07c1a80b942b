"""The worker roles and the stack's default ports: the one home for them."""
from __future__ import annotations

# "both" serves whole requests; "prefill" and "decode" are the two halves of a disaggregated one.
ROLES = ("both", "prefill", "decode")
DISAGGREGATED_ROLES = ("prefill", "decode")
# "encode" turns a request's image parts into embeddings held for the prefill worker to pull; it runs no engine.
ENCODE_ROLE = "encode"
WORKER_ROLES = ROLES + (ENCODE_ROLE,)

# The port a prefill worker's KV signal plane listens on unless told otherwise.
DEFAULT_KV_PORT = 14579
