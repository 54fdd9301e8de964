"""Benchmark harnesses that span stages: every policy online, the oracle's bound on the text
a policy generated, and the two junk-tail modes compared."""
