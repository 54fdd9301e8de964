"""Figures of the oracle study: the Lmax sweep (the paper's Figure 2) and delta space
(Figure 3)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


def plot_lmax_sweep(sweep: pd.DataFrame, path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for category, sub in sweep.groupby("category"):
        style = {"linewidth": 2.5, "color": "black"} if category == "all" else {"alpha": 0.6}
        ax1.plot(sub["lmax"], sub["speedup_bound"], marker="o", label=category, **style)
    ax1.set_xlabel("Lmax")
    ax1.set_ylabel("bound S = Cost_AR / dp[0]")
    ax1.legend(fontsize=7)
    overall = sweep[sweep["category"] == "all"]
    ax2.plot(overall["lmax"], overall["mean_draft_len"], marker="o", label="mean draft length")
    ax2.plot(overall["lmax"], overall["mean_accepted"], marker="s", label="mean accepted")
    ax2.set_xlabel("Lmax")
    ax2.set_ylabel("tokens")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_delta_space(deltas: pd.DataFrame, lam: float, path: Path, max_points: int = 20000) -> Path:
    sample = deltas.sample(min(len(deltas), max_points), random_state=0) if len(deltas) else deltas
    fig, ax = plt.subplots(figsize=(5, 4))
    sc = ax.scatter(
        sample["d_accept"],
        sample["d_cost_ms"],
        s=3,
        alpha=0.4,
        c=sample["k"] - sample["k_star"],
        cmap="coolwarm",
    )
    if len(sample) and np.isfinite(lam):
        xs = np.linspace(0, max(sample["d_accept"].max(), 1e-6), 20)
        ax.plot(xs, lam * xs, color="black", linewidth=1, label=f"lambda = {lam:.3f} ms/token")
        ax.legend(fontsize=8)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.axvline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("dE[a] (tokens)")
    ax.set_ylabel("dE[Cost] (ms)")
    fig.colorbar(sc, label="k - k*")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
