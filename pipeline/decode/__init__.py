"""Online speculative decoding: the contract (types), the drafter, the acceptance rules, the
engine's step loop, the generation stream and per-generation statistics."""
