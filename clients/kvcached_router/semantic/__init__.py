"""The semantic response cache of ``kvcached-router``: an exact path on normalised text, and a
guarded embedding match with calibrated thresholds. Layers and modules: ``README.md`` here.

Nothing is imported eagerly: the embedder pulls in torch and sentence-transformers only when a
matcher first embeds.
"""
