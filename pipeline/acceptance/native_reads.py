"""One compiled call for what a decision reads off a draft forward: the distribution's top two
probabilities and its top token, the logits' part of its entropy (z_top - p.z), and the draft
state's products with the acceptance model's two hidden-state weight vectors.

Why compiled: right after a draft forward each tensor call costs 2-6x its warm time (the
forward evicts torch's code from the caches, not the data), and the reads took five such calls
per draft token. One C call makes them in one pass over the distribution: 13.8 us a read right
after a forward against 21.9 us for the tensor calls on the 2-core CPU, 11-20 us less per draft
forward interleaved (docs/online.md, `throughput`, "Reads in one compiled call"; the
measurements in docs/results/cold_decisions_and_compiled_reads/).

The source is compiled on first use with the system's C compiler (``cc``) into a per-user cache.
Without a compiler, with ``SPECBOUND_NATIVE=0``, or for tensors that are not contiguous float32
in host memory (a GPU, another dtype), ``native_reads()`` or ``NativeReads.read`` gives None
and the caller reads with tensor calls (features.position_view), which give the same numbers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = r"""
/* p, z: the distribution and its logits [v]; h: the draft state [n]; w: weights [n, 2].
   out: top1, top2, top index, z[top] - p.z, h.w[:, 0], h.w[:, 1]. The top is the first
   maximum, as argmax gives it. */
void specbound_reads(const float *p, const float *z, long v, const float *h, const float *w,
                     long n, double *out) {
    long top = 0;
    float first = -1.0f, second = -1.0f;
    double dot = 0.0;
    for (long i = 0; i < v; i++) {
        float x = p[i];
        dot += (double)x * z[i];
        if (x > first) { second = first; first = x; top = i; }
        else if (x > second) { second = x; }
    }
    double a = 0.0, b = 0.0;
    for (long i = 0; i < n; i++) {
        a += (double)h[i] * w[2 * i];
        b += (double)h[i] * w[2 * i + 1];
    }
    out[0] = first; out[1] = second; out[2] = (double)top;
    out[3] = z[top] - dot; out[4] = a; out[5] = b;
}
"""

Reads = tuple[float, float, int, float, list[float]]  # top1, top2, top, z_top - p.z, h.w


class NativeReads:
    """The compiled reads, with an output buffer per thread (the call releases the GIL, and a
    serving replica decodes requests in several threads)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.specbound_reads
        ptr, long = ctypes.c_void_p, ctypes.c_long
        self._fn.argtypes = [ptr, ptr, long, ptr, ptr, long, ptr]
        self._fn.restype = None
        self._local = threading.local()
        self._weights: torch.Tensor | None = None

    def read(
        self, probs: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, weights: torch.Tensor
    ) -> Reads | None:
        """The reads of one position (``probs`` = softmax(``logits`` / T), 1-D; ``hidden`` 1-D;
        ``weights`` [len(hidden), 2]), or None when the tensors do not suit (the caller then
        reads with tensor calls) or the logits hold -inf (a masked vocabulary)."""
        if weights is not self._weights:  # (the model's, checked once: the same every call)
            if not _suits(weights) or weights.dim() != 2 or weights.shape[1] != 2:
                return None
            self._weights = weights
        if not (_suits(probs) and _suits(logits) and _suits(hidden)):
            return None
        v, n = probs.shape[-1], hidden.shape[-1]
        if probs.dim() != 1 or logits.shape != probs.shape or weights.shape[0] != n:
            return None
        out = getattr(self._local, "out", None)
        if out is None:
            out = self._local.out = (ctypes.c_double * 6)()
        self._fn(
            probs.data_ptr(),
            logits.data_ptr(),
            v,
            hidden.data_ptr(),
            weights.data_ptr(),
            n,
            ctypes.addressof(out),
        )
        top1, top2, top, z_dot, a, b = out
        if not math.isfinite(z_dot):
            return None
        return top1, top2, int(top), z_dot, [a, b]


def _suits(t: torch.Tensor) -> bool:
    """Contiguous float32 in host memory: what the compiled reads can read."""
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def _library() -> Path:
    """The compiled source, built once per source and machine into the user's cache."""
    key = hashlib.sha256((SOURCE + platform.machine()).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specbound"
    lib = cache / f"reads-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = Path(tmp) / "reads.c", Path(tmp) / "reads.so"
        src.write_text(SOURCE)
        subprocess.run(
            ["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        os.replace(out, lib)  # atomic: a process compiling beside this one loses nothing
    return lib


@functools.cache
def native_reads() -> NativeReads | None:
    """The compiled reads, or None (no compiler, SPECBOUND_NATIVE=0): read with tensor calls."""
    if os.environ.get("SPECBOUND_NATIVE", "1") == "0":
        return None
    try:
        return NativeReads(ctypes.CDLL(str(_library())))
    except (OSError, subprocess.SubprocessError) as err:
        log.info("compiled reads unavailable (%s): reading with tensor calls", err)
        return None
