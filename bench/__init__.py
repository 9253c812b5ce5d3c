"""The benchmarks (``python bench/<name>.py``; see bench/README.md) and what they share.

``bench._common``: machine info, timing, tables, the results writer and the plot helper;
``bench.harness``: the processes and scenarios the benches drive (a kvcached daemon, Redis
servers and clusters, the crash and client-death loads, two daemons on one cluster, the router
in front of a simulated fleet). The tests import these from here; nothing in ``bench`` imports
``tests``. ``bench.studies``: one-off studies behind design choices; ``bench.sim``: the eviction
policy simulator. The regression benches are the scripts directly in ``bench/``.
"""
