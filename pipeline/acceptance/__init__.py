"""Acceptance, learned offline: how likely the target is to accept the draft's next token,
from what the draft has already computed (traces -> model -> the `throughput` policy)."""
