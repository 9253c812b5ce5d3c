"""kvcached for SGLang: a HiCache storage backend (see docs/sglang.md).

``KvcachedStorage`` needs SGLang installed and is imported on first use, so that
:mod:`kvcached_client.sglang.pages` (keys, layout, page views) works without SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvcachedStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvcachedStorage":
        from kvcached_client.sglang.backend import KvcachedStorage

        return KvcachedStorage
    raise AttributeError(name)
