"""Figures of the calibration: T_T against U per K with the fitted lines (the paper's
Figure 1), and T_D against the draft forwards with the draft line."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: jobs run on cluster workers without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from pipeline.cost.model import CostModel  # noqa: E402


def plot_target_vs_experts(rounds: pd.DataFrame, model: CostModel, path: Path) -> Path:
    ks = sorted(rounds["k"].unique())
    cols = min(4, len(ks))
    rows = int(np.ceil(len(ks) / cols))
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharey=True
    )
    median_ctx = float(rounds["ctx_len"].median())
    for ax, k in zip(axes.flat, ks, strict=False):
        sub = rounds[rounds["k"] == k]
        m = int(k) + 1
        ax.scatter(sub["u_bar"], sub["t_target_ms"], s=4, alpha=0.35)
        u = np.linspace(sub["u_bar"].min(), sub["u_bar"].max(), 20)
        ax.plot(u, [model.t_target(m, x, median_ctx) for x in u], color="crimson")
        ax.set_title(f"K={k}: a={model.alpha[m]:.3f}, b0={model.beta0[m]:.2f}", fontsize=8)
        ax.set_xlabel("U (unique experts / layer)", fontsize=8)
    for ax in axes.flat[len(ks) :]:
        ax.axis("off")
    axes[0, 0].set_ylabel("T_T (ms)")
    fig.suptitle(f"Verification time vs unique experts (line at median L = {median_ctx:.0f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_draft_vs_k(rounds: pd.DataFrame, model: CostModel, path: Path) -> Path:
    """T_D against the draft forwards n the round ran (fixed chains: n = K; looks: K + 1)."""
    drafted = rounds[rounds["draft_forwards"] > 0]
    look = drafted["draft_forwards"] != drafted["k"]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for sel, label in ((~look, "fixed chain of K"), (look, "K tokens + one look")):
        if sel.any():
            ax.scatter(
                drafted.loc[sel, "draft_forwards"],
                drafted.loc[sel, "t_draft_ms"],
                s=4,
                alpha=0.3,
                label=label,
            )
    top = int(drafted["draft_forwards"].max()) if len(drafted) else 1
    ns = np.arange(1, top + 1)
    ax.plot(
        ns,
        [model.t_draft(int(n)) for n in ns],
        color="crimson",
        label=f"T_D = {model.draft_a:.3f} n + {model.draft_b:.3f}",
    )
    ax.set_xlabel("n (draft forwards)")
    ax.set_ylabel("T_D (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
