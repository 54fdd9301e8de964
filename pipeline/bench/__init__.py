"""Benchmark harnesses that span stages: every policy online, and the oracle's bound on the
text a policy generated."""
