"""Loading a MoE target and its draft, one adapter per MoE family, routing capture, KV-cache
helpers, tree attention masks and timing of model calls."""
