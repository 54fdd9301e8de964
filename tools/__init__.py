"""Diagnostic tools whose outputs the docs cite: each runs as ``python -m tools.NAME`` from the
repository root (``--help`` gives its options) and is smoke-tested in tests/test_tools.py.

step_parts            where each policy's time per token goes, measured, beside its prices
engine_on_device      every single-session policy lossless on a device (CUDA when present)
where_pass_time_goes  a real-shape verification pass's wall time against its kernel time
"""
