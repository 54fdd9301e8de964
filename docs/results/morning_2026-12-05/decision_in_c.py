"""Would `throughput`'s per-token decision arithmetic gain from a compiled call, as its reads
did? ModeModel.chain_view's arithmetic (two logits over the features and the hidden-state
products, the `next` model along the chain) and the two plan_pays checks, in Python as
throughput.propose runs them, against the same arithmetic in one C call through ctypes (the
arguments as propose would pass them), warm, back to back. Run from the repository root:

    python docs/results/morning_2026-12-05/decision_in_c.py
"""

import ctypes
import random
import subprocess
import tempfile
import time
from pathlib import Path

from pipeline.acceptance.features import FEATURE_NAMES, feature_vector, logistic
from pipeline.acceptance.model import RECENT
from pipeline.decode.policies.plan_worth import plan_pays

SOURCE = r"""
#include <math.h>
static double logistic(double z) {
    if (z >= 0) return 1.0 / (1.0 + exp(-z));
    double e = exp(z);
    return e / (1.0 + e);
}
static int pays(const double *td, const double *tt, double rho, double p, const double *accs,
                long n_accs, long m, long fw, int first_free) {
    double t_d0 = td[fw], t_t0 = tt[m], gain = 0.0;
    for (long n = 1; n <= n_accs; n++) {
        p *= accs[n - 1];
        gain += rho * p;
        long more = fw + (first_free ? n - 1 : n);
        if (gain > (td[more] - t_d0) + (tt[m + n] - t_t0)) return 1;
    }
    return 0;
}
long decide(const double *wc, const double *wn, long k, long at_recent, const double *stats,
            double h_cur, double h_next, double offset, double rep, double recent, double decay,
            double rho, double p, long room, long j, const double *td, long n_td,
            const double *tt, long n_tt, double *out) {
    double zc = 0.0, zn = 0.0;
    for (long i = 0; i < k; i++) {
        double x = i == 0 ? 1.0 : (i == k - 1 ? recent : stats[i - 1]);
        zc += wc[i] * x;
        zn += wn[i] * x;
    }
    zc = h_cur + zc + offset;
    zn = h_next + zn + offset + rep;
    double wr = wn[at_recent], r = recent;
    zn -= wr * recent;
    for (long i = 0; i < room; i++) {
        out[1 + i] = logistic(zn + wr * r);
        r = decay * r + (1 - decay);
    }
    out[0] = logistic(zc);
    if (j + 1 + room >= n_td || j + 2 + room >= n_tt) return -1;
    int first = pays(td, tt, rho, p, out, room + 1, j + 1, j + 1, 1);
    int second = room > 0 && pays(td, tt, rho, p * out[0], out + 1, room, j + 2, j + 1, 0);
    return first | (second << 1);
}
"""

K = len(FEATURE_NAMES)
N = 20_000


def python_decision(wc, wn, stats, h_cur, h_next, offset, recent, decay, rho, p, room, j, td, tt):
    """chain_view's arithmetic with the products given, then propose's two plan_pays."""
    f = feature_vector(stats, recent)
    z_cur = h_cur + sum(w * x for w, x in zip(wc, f, strict=True))
    z_next = h_next + sum(w * x for w, x in zip(wn, f, strict=True))
    z_cur, z_next = z_cur + offset, z_next + offset
    w_recent = wn[RECENT]
    z_next -= w_recent * recent
    later = []
    for _ in range(room):
        later.append(logistic(z_next + w_recent * recent))
        recent = decay * recent + (1 - decay)
    a = logistic(z_cur)
    first = plan_pays(td, tt, rho, p, [a, *later], j + 1, j + 1, first_free=True)
    second = plan_pays(td, tt, rho, p * a, later, j + 2, j + 1, first_free=False)
    return a, first, second


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "d.c", Path(tmp) / "d.so"
        src.write_text(SOURCE)
        cmd = ["cc", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib), str(src)]
        subprocess.run(cmd, check=True)
        fn = ctypes.CDLL(str(lib)).decide
    ptr, long, dbl = ctypes.c_void_p, ctypes.c_long, ctypes.c_double
    fn.argtypes = [ptr, ptr, long, long, ptr, *[dbl] * 8, long, long, ptr, long, ptr, long, ptr]
    fn.restype = long
    rng = random.Random(0)
    wc, wn = [rng.gauss(0, 1) for _ in range(K)], [rng.gauss(0, 1) for _ in range(K)]
    stats = [rng.random() for _ in range(K - 2)]
    td, tt = [0.4 * i for i in range(9)], [1.5 + 0.1 * i for i in range(10)]
    c_wc, c_wn = (dbl * K)(*wc), (dbl * K)(*wn)
    c_td, c_tt, out = (dbl * len(td))(*td), (dbl * len(tt))(*tt), (dbl * 16)()
    args = dict(h_cur=0.3, h_next=-0.2, offset=0.1, recent=0.7, decay=0.8, rho=3.0, p=0.9)
    room, j = 5, 1
    names = ("h_cur", "h_next", "offset", "repeat", "recent", "decay", "rho", "p")
    scalars = [{**args, "repeat": 0.0}[name] for name in names]

    t = time.perf_counter()
    for _ in range(N):
        py = python_decision(wc, wn, stats, **args, room=room, j=j, td=td, tt=tt)
    t_py = (time.perf_counter() - t) / N * 1e6
    t = time.perf_counter()
    for _ in range(N):
        c_stats = (dbl * len(stats))(*stats)  # propose's stats are a fresh list per token
        code = fn(
            c_wc, c_wn, K, RECENT, c_stats, *scalars, room, j, c_td, len(td), c_tt, len(tt), out
        )
        c = (out[0], bool(code & 1), bool(code & 2))
    t_c = (time.perf_counter() - t) / N * 1e6
    assert c == py, (c, py)
    print(f"the same decision {py}: Python {t_py:.2f} us, one ctypes call {t_c:.2f} us (warm)")


if __name__ == "__main__":
    main()
