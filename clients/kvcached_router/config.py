"""The router's settings: a TOML file (``kvcached-router --config router.toml``).

```toml
listen = "127.0.0.1:8000"
policy = "kvcached"            # kvcached | round_robin | least_loaded | prefix_hash | longest_prefix
tokenizer = "/srv/models/llama-3-8b"   # a local Hugging Face tokenizer directory
hash_key_file = "/etc/kvcached/hash.key"  # the trust domain's key (the daemons' hash_key_file)
domain = "default"
load_factor = 1.25             # the kvcached policy's load bound: x the mean in-flight requests,
load_slack = 2                 # and never fewer than this many above the mean
storage_weight = 0.5           # a cached chunk only on a daemon's NVMe counts this much (a pool chunk 1)
provisional_ttl = 10           # s a routed request's chunks count as held before its daemon confirms them
health_interval = 1            # s between health checks of each host

[layout]                       # the engines' KV layout, as `kvcachectl stats` shows it
model = "meta-llama/Llama-3-8B@main"
num_layers = 32
num_kv_heads = 8
head_dim = 128
dtype = "bfloat16"
chunk_tokens = 128

[[hosts]]
name = "gpu-a"
url = "http://10.0.0.1:8000"              # the engine's OpenAI server
events = "tcp://10.0.0.1:5557"            # its daemon's kv_events_endpoint
replay = "tcp://10.0.0.1:5558"            # and kv_events_replay_endpoint
daemon_socket = ""                        # optional: the daemon's socket, to audit routes (Lookup)
```

``normalize_prompts = true`` (top level, off by default) normalises prompt text
(:func:`kvcached_client.text.normalize`: width, CJK punctuation, whitespace) before the router
tokenises and forwards it: more KV reuse, but the model then sees the normalised text.

The ``[semantic]`` section (off by default) turns on the response cache
(:class:`SemanticConfig`; the router README's "Semantic response cache" section).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged (a dependency there; see pyproject.toml)
    import tomli as tomllib

from kvcached.contract.keys import KVLayout
from kvcached_router.policy import POLICIES


class RouterConfigError(ValueError):
    """The router's config is wrong; the message names the setting."""


@dataclass(frozen=True)
class HostConfig:
    name: str
    url: str
    events: str = ""
    replay: str = ""
    daemon_socket: str = ""


@dataclass(frozen=True)
class SemanticConfig:
    """``[semantic]``: the response cache in front of the engines."""

    enabled: bool = False
    match: bool = True  # the semantic path (sentence embeddings); false: the exact path only
    embedder: str = "auto"  # "auto" (USE for Chinese/Japanese text, MiniLM for the rest), "use" or "minilm"
    calibration: str = ""  # `kvcached-router calibrate` output; "": the shipped one for the embedder, if any
    max_entries: int = 10_000
    max_bytes: int = 256 << 20  # responses, query texts and embeddings
    ttl: float = 3600.0  # s an answer is served after it was stored
    max_response_bytes: int = 1 << 20  # larger answers are not stored
    max_queued_lookups: int = 8  # semantic lookups waiting for the embedder; beyond, requests skip that path
    tenant_header: str = ""  # a header your gateway sets (e.g. X-Tenant); else a hash of Authorization
    cache_sampled: bool = False  # serve requests with temperature > 0 from the cache too
    default_temperature: float = 1.0  # the engine's temperature for requests that set none
    shadow_rate: float = 0.01  # fraction of semantic hits also answered by the engine, to measure false hits
    shadow_agree_similarity: float = 0.9  # cosine at which the engine's answer agrees with the cached one
    false_hit_bound: float = 0.02  # the shadow-measured false-hit rate the doctor check holds it to
    drift_threshold: float = 0.25  # PSI of the live top-1 similarity distribution vs the reference
    drift_min_samples: int = 200
    drift_window: int = 2000
    drift_reference: str = "calibration"  # the calibration's pair similarities when it has them, or "live"
    drift_reference_samples: int = 500  # a live reference: the first this many lookups

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1 or self.ttl <= 0 or self.max_response_bytes < 1:
            raise RouterConfigError("[semantic] max_entries, max_bytes, ttl and max_response_bytes must be positive")
        if self.max_queued_lookups < 0:
            raise RouterConfigError("[semantic] max_queued_lookups must be >= 0")
        if not 0 <= self.shadow_rate <= 1:
            raise RouterConfigError("[semantic] shadow_rate must be in [0, 1]")
        if self.embedder not in ("auto", "use", "minilm"):
            raise RouterConfigError('[semantic] embedder must be "auto", "use" or "minilm"')
        if self.drift_reference not in ("calibration", "live"):
            raise RouterConfigError('[semantic] drift_reference must be "calibration" or "live"')
        if self.drift_window < self.drift_min_samples:
            raise RouterConfigError("[semantic] drift_window must be >= drift_min_samples")


@dataclass(frozen=True)
class RouterConfig:
    hosts: tuple[HostConfig, ...]
    layout: KVLayout
    hash_key_file: str
    tokenizer: str
    domain: str = "default"
    listen: str = "127.0.0.1:8000"
    policy: str = "kvcached"
    load_factor: float = 1.25
    load_slack: int = 2
    storage_weight: float = 0.5  # a chunk only on the daemon's NVMe, against 1 for one in its pool
    prefix_hash_chunks: int = 2
    provisional_ttl: float = 10.0
    health_interval: float = 1.0
    request_timeout: float = 600.0
    audit: bool = False  # ask every daemon (Lookup) at routing time whether the route was the best
    # (a request then waits for the chosen daemon's answer, ~1 ms, at most 0.5 s, before it is forwarded)
    normalize_prompts: bool = False  # normalise prompt text before tokenising and forwarding
    semantic: SemanticConfig = SemanticConfig()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.hosts:
            raise RouterConfigError("the router needs at least one [[hosts]] entry")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise RouterConfigError("every host needs its own name")
        if self.policy not in POLICIES:
            raise RouterConfigError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.load_factor < 1:
            raise RouterConfigError("load_factor must be >= 1")
        if not 0 <= self.storage_weight <= 1:
            raise RouterConfigError("storage_weight must be in [0, 1]")
        if self.audit and not all(h.daemon_socket for h in self.hosts):
            raise RouterConfigError("audit needs every host's daemon_socket")


def load_config(path: str, **overrides: Any) -> RouterConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise RouterConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise RouterConfigError(f"{path}: {e}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> RouterConfig:
    raw = dict(raw)
    try:
        hosts = tuple(HostConfig(**h) for h in raw.pop("hosts", []))
        layout = KVLayout.from_dict(raw.pop("layout"))
        semantic = _semantic_config(raw.pop("semantic", {}))
    except KeyError as e:
        raise RouterConfigError(f"missing setting {e}") from None
    except (TypeError, ValueError) as e:
        raise RouterConfigError(str(e)) from None
    for name in ("hash_key_file", "tokenizer"):
        if name not in raw:
            raise RouterConfigError(f"missing setting {name}")
    known = set(RouterConfig.__dataclass_fields__) - {"hosts", "layout", "extra", "semantic"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RouterConfigError(f"unknown setting(s) {', '.join(unknown)}")
    try:
        return RouterConfig(hosts=hosts, layout=layout, semantic=semantic, **raw)
    except TypeError as e:
        raise RouterConfigError(str(e)) from None


def _semantic_config(raw: Any) -> SemanticConfig:
    if not isinstance(raw, dict):
        raise RouterConfigError("[semantic] must be a table")
    unknown = sorted(set(raw) - set(SemanticConfig.__dataclass_fields__))
    if unknown:
        raise RouterConfigError(f"unknown [semantic] setting(s) {', '.join(unknown)}")
    return SemanticConfig(**raw)
