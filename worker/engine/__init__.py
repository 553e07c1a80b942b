"""LLMEngine: requests in, one schedule / run / postprocess step at a time, outputs out.

Disaggregated serving lives in the role chosen at construction (roles.py: role "both",
prefill_side.py, decode_side.py); every live request lives in one RequestTable.
"""
