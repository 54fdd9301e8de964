"""Draft policies behind one interface (base), each registered once with its knobs (registry)."""
