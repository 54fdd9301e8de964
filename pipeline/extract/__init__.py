"""Extraction (docs/contract.md): per-sequence rows, junk tails, keyed randomness, the Ray
Data job and the routing profile."""
