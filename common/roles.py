"""The worker roles and the stack's default ports: the one home for them."""
from __future__ import annotations

# "both" serves whole requests; "prefill" and "decode" are the two halves of a disaggregated one.
ROLES = ("both", "prefill", "decode")
DISAGGREGATED_ROLES = ("prefill", "decode")

# The port a prefill worker's KV signal plane listens on unless told otherwise.
DEFAULT_KV_PORT = 14579
