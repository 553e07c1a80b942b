"""neuron-di: prefill/decode disaggregated inference for LLM serving."""
from setuptools import Extension, find_packages, setup

setup(
    name="neuron-di",
    version="0.1.0",
    description="Prefill/decode disaggregated LLM inference: proxy, KV connector, transfer engine, reference worker.",
    python_requires=">=3.11,<3.12",  # what CI runs (common/request_body.py needs 3.11: asyncio.timeout)
    packages=find_packages(include=["common*", "proxy*", "neuron_connector*", "transfer*", "scheduler*", "worker*",
                                    "stack*", "benchmarks*", "faults*", "planner*"]),
    package_data={"worker": ["model/assets/**/*", "py.typed"]},
    include_package_data=True,
    # Native hot loops, each optional: without a C compiler the same results come from a
    # slower Python/torch path (the shm transport's copy loop, the decode attention).
    ext_modules=[Extension("transfer._memcopy", ["transfer/_memcopy.c", "transfer/_crc32c.c", "transfer/_crc32c_fold.c"],
                           depends=["transfer/_crc32c.h", "transfer/_crc32c_fold.h"], optional=True),
                 Extension("worker.model.layers._paged_decode", ["worker/model/layers/_paged_decode.c"], optional=True),
                 Extension("worker.model.layers._prefill_native", ["worker/model/layers/_prefill_native.c"],
                           depends=["worker/model/layers/_avx512.h", "worker/model/layers/_amx.h",
                                    "worker/model/layers/_prefill_amx.h"],
                           extra_compile_args=["-O3"], optional=True),
                 Extension("worker.model.layers._decode_linear", ["worker/model/layers/_decode_linear.c"],
                           depends=["worker/model/layers/_avx512.h", "worker/model/layers/_amx.h"],
                           extra_compile_args=["-O3"], optional=True),
                 # No contraction: a product rounded before a sum (the rotary embedding) must not become an FMA.
                 Extension("worker.model.layers._pointwise", ["worker/model/layers/_pointwise.c"],
                           depends=["worker/model/layers/_avx512.h"], extra_compile_args=["-O3", "-ffp-contract=off"],
                           optional=True)],
    install_requires=[
        # Pinned exactly: a range admitting newer releases pulls CUDA builds.
        "torch==2.13.0",
        "numpy>=1.26,<3",
        "quart>=0.19,<0.24",
        "hypercorn>=0.17,<0.19",
        "httpx>=0.27,<0.29",
        "aiohttp>=3.9,<4",
        "sniffio>=1.3,<2",
        "pyzmq>=26,<28",
        "aetcd>=1.0,<2",
        "safetensors>=0.4,<0.9",
        "tokenizers>=0.20,<0.24",
        "jinja2>=3.1,<4",
        "prometheus-client>=0.20,<0.27",
        "tqdm>=4.66,<5",
        "openai>=1.40,<4",
        "llguidance>=1.0,<2",   # structured output (JSON schema, regex, choice): a Rust wheel, no dependencies
        "crc32c>=2.4,<3",       # KV integrity: the reference CRC-32C, and the sum where transfer._memcopy is not built
        "nats-py>=2.16,<3",     # the prefill queue (a NATS JetStream work queue)
        "msgpack>=1.1,<2",      # KV cache events, in vLLM's wire format
        "opentelemetry-api>=1.45,<2",
        "opentelemetry-sdk>=1.45,<2",
        "opentelemetry-exporter-otlp-proto-http>=1.45,<2",   # traces, with --otlp-traces-endpoint
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-timeout>=2.3,<3",
            "hypothesis>=6.100,<7",
            "transformers>=4.45,<6",
            # lm-evaluation-harness's local-completions model, against the proxy (tests/vllm/test_lm_eval.py).
            "lm-eval[api]>=0.4.13,<0.5",
            "kubernetes>=31,<38",
            "kubernetes-validate>=1.30,<2",
            # The docs site, built with --strict by tests/test_docs.py.
            "mkdocs>=1.6,<2",
            "pyyaml>=6,<7",   # the alert rules and their unit tests, read by tests/deploy/
            "matplotlib>=3.8,<4",   # the benchmarks' plots (tests/benchmarks/)
        ],
        # The planner's kubernetes connector (python -m planner --connector kubernetes)
        "kubernetes": ["kubernetes>=31,<38"],
        "nixl": ["nixl>=0.5,<2"],
        "bench": ["matplotlib>=3.8,<4", "transformers>=4.45,<6"],
    },
)
