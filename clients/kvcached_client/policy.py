"""Per-request cache policies (DESIGN.md section 5).

* ``no-store``: the request's KV is never stored.
* ``no-cache``: the request is never served from the cache (it may still store).
* requests that declare more than ``bypass_generation_tokens`` (default 8192) expected output
  tokens are not stored: a long generation is degraded to plain compute.

The load balancer sets ``X-Cache-Control: no-store`` (or ``no-cache``); :meth:`CachePolicy.from_headers`
turns that header into a policy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

BYPASS_GENERATION_TOKENS = 8192


@dataclass(frozen=True)
class CachePolicy:
    no_store: bool = False
    no_cache: bool = False
    expected_output_tokens: int = 0
    bypass_generation_tokens: int = BYPASS_GENERATION_TOKENS

    @property
    def read(self) -> bool:
        return not self.no_cache

    def should_store(self, prompt_tokens: int) -> bool:
        return not self.no_store and self.expected_output_tokens <= self.bypass_generation_tokens

    def with_expected_output(self, tokens: int) -> "CachePolicy":
        return dataclasses.replace(self, expected_output_tokens=max(self.expected_output_tokens, tokens))

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], **kw: int) -> "CachePolicy":
        """``X-Cache-Control: no-store, no-cache`` (case-insensitive, comma separated)."""
        value = ""
        for k, v in headers.items():
            if k.lower() == "x-cache-control":
                value = v
        directives = {d.strip().lower() for d in value.split(",") if d.strip()}
        return cls(no_store="no-store" in directives, no_cache="no-cache" in directives, **kw)
