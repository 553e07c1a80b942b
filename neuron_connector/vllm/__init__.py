"""NeuronConnector: our signal plane and transfer engine inside `vllm serve`, as a vLLM v1 KV connector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "NeuronConnector",
        "kv_connector_module_path": "neuron_connector.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kv_port": 14579, "kv_transport": "auto"}}'

kv_role `kv_producer` is a prefill worker, `kv_consumer` a decode worker; the extra config
keys are the fields of `NeuronConnectorConfig`. Only the connector class imports vLLM.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from neuron_connector.vllm.config import NeuronConnectorConfig

if TYPE_CHECKING:
    from neuron_connector.vllm.connector import NeuronConnector


def __getattr__(name: str) -> Any:
    if name != "NeuronConnector":
        raise AttributeError(f"module 'neuron_connector.vllm' has no attribute {name!r}")
    return importlib.import_module("neuron_connector.vllm.connector").NeuronConnector


__all__ = ["NeuronConnector", "NeuronConnectorConfig"]
