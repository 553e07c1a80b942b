"""The simulated engine (`python -m worker --engine mock`): the worker as it is (HTTP API, scheduler, KV
pool, signal plane, KV transfers, etcd registration, metrics), with the forward pass replaced by a cost
model and deterministic tokens computed from the KV the pool holds.

    cost_model.py   how long a step takes: prefill tokens per second, decode step time against batch
    model.py        the simulated model (a tiny KV layout, the real tokenizer) and its step runner
    flags.py        the command line of the simulated engine (no torch)

It lets a test or benchmark run dozens of workers on a machine that could compute only a few.
"""
