"""Extraction (DESIGN sections 3-4): per-sequence rows, junk tails, keyed randomness, the Ray
Data job and the routing profile."""
