"""The eviction policy simulator: candidate policies replayed on the traces with the engine's
rules but not its code (``eviction_candidates.py``); see README.md beside this file."""
