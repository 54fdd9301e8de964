"""Extraction (DESIGN sections 3-4): per-sequence rows, junk tails, keyed randomness, the Ray
Data job, the routing profile and the benchmark of the two tail modes."""
