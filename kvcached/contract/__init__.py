"""The shared contract: what the daemon, the clients, the engine connectors and the router agree on.

Keys and hashing (``keys``), tier ids (``locations``), the domain errors and their kinds
(``errors``), KV tensors <-> chunk payloads (``kv``), the NVMe record format (``record``), the
remote-tier value format (``remote_format``), KV event messages (``events``), the pool handle and
a client's mapping of the pool (``pool``, ``poolmap``), protobuf conversion (``proto``, over the
generated ``kvcached.v1``), the LMDB transaction gate (``lmdbgate``) where the daemon's
socket is (``socket_path``) and the metric buckets the daemon and the router share (``buckets``).

Rule (``tests/test_layers.py``): modules here import nothing of kvcached outside this package
but the generated ``kvcached.v1``; ``kvcached_client``, the connectors and ``kvcached_router``
import nothing of kvcached outside it either. So a client never loads the daemon's engine, its
settings or its tiers, and a change to the wire or a format is a change here.
"""
