"""kvcached: a per-host KV-cache reuse daemon for LLM serving."""

__version__ = "0.1.0"
