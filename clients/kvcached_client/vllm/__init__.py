"""kvcached for vLLM: ``KvcachedConnector``, a KV connector (vLLM's v1 connector API).

Load it with ``kv_connector="KvcachedConnector", kv_connector_module_path="kvcached_client.vllm"``
(README, "Use with vLLM"). The connector is imported lazily, so the light modules here
(``middleware``, ``config``) do not import vLLM.
"""

from typing import Any

__all__ = ["KvcachedConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvcachedConnector":
        from kvcached_client.vllm.connector import KvcachedConnector

        return KvcachedConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
