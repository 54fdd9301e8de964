"""Prices per decoding mode (costmodel.json ``modes``, docs/contract.md).

Sampling changes what a step costs beside the target's forward: at T > 0 the draft samples
each token it drafts, and after the verification forward the target's distributions are
formed at the decoding temperature and top-p and walked for acceptance. A calibration over
several modes (python -m jobs.calibrate --temperatures 0,1) fits, on each mode's own rounds,
the draft line T_D = a n + b over n draft forwards and the acceptance line T_A = a m + b over
the m positions verified; the target's forward is priced once for all modes (it does not
sample: its designed passes run no decoding at all). CostModel.for_sampling reads the mode a
generation decodes in."""

from __future__ import annotations

from typing import Any

import pandas as pd

from pipeline.cost.design_stats import heldout_summary
from pipeline.cost.design_stats import priced as priced_by
from pipeline.cost.fit import drop_interference, fit_draft
from pipeline.cost.model import CostModel
from pipeline.cost.ols import fit_linear_oos


def fit_modes(rounds: pd.DataFrame, model: CostModel, top_p: float) -> list[dict[str, Any]]:
    """Per temperature in ``rounds`` (sampled modes at ``top_p``): its draft and acceptance
    lines, and how the mode's prices (``model`` read for that mode) meet its rounds."""
    if "temperature" not in rounds.columns or rounds["t_accept_ms"].isna().all():
        return []  # rounds from before modes were recorded
    modes = []
    for temperature, df in rounds.groupby("temperature", sort=True):
        # The same rounds the file's own draft line keeps (fit_cost_model): a mode that is
        # the first one then has exactly the file's line.
        df = drop_interference(df.reset_index(drop=True))[0]
        draft = fit_draft(df)
        accept, _ = fit_linear_oos(df, "t_accept_ms", ["m"])
        entry: dict[str, Any] = {
            "temperature": float(temperature),
            "top_p": 1.0 if temperature == 0 else float(top_p),
            "draft": {"a": draft["coef"]["draft_forwards"], "b": draft["coef"]["const"]},
            "accept": {"a": accept["coef"]["m"], "b": accept["coef"]["const"]},
            "rounds": len(df),
        }
        mode_model = model.with_mode(entry)
        drafting = df[df["draft_forwards"] > 0]
        draft_pred = mode_model.draft_a * drafting["draft_forwards"] + mode_model.draft_b
        step = df["t_target_ms"] + df["t_accept_ms"]
        step_pred = priced_by(mode_model, df)
        entry["error"] = {
            # The target's forward, priced by the designed fit: held out from these rounds.
            "target_on_rounds": heldout_summary(model, df),
            # Forward plus acceptance walk, as the mode's prices give a verification.
            "verify_bias_pct": float((step_pred / step - 1).mean() * 100),
            "draft_bias_pct": float((draft_pred / drafting["t_draft_ms"] - 1).mean() * 100),
            "draft_oos_mape_pct": draft["oos_mape"],
            "accept_oos_mape_pct": accept["oos_mape"],
            "draft_ms_per_forward": float(
                drafting["t_draft_ms"].sum() / drafting["draft_forwards"].sum()
            ),
            "accept_ms_per_round": float(df["t_accept_ms"].mean()),
        }
        modes.append(entry)
    return modes


def format_modes(modes: list[dict[str, Any]]) -> str:
    """The per-mode prices and their errors, a line per mode."""
    lines = ["prices per decoding mode (draft a n + b; acceptance walk a m + b; ms):"]
    for e in modes:
        err = e["error"]
        name = "greedy" if e["temperature"] == 0 else f"T={e['temperature']:g} top-p {e['top_p']:g}"
        lines.append(
            f"  {name:18s} draft {e['draft']['a']:.3f} n + {e['draft']['b']:.3f} "
            f"({err['draft_ms_per_forward']:.3f} per forward)  accept {e['accept']['a']:.3f} m + "
            f"{e['accept']['b']:.3f}  on its {e['rounds']} rounds: target bias "
            f"{err['target_on_rounds']['bias_pct']:+.1f}% (held out), with the walk "
            f"{err['verify_bias_pct']:+.1f}%, draft {err['draft_bias_pct']:+.1f}%"
        )
    return "\n".join(lines)
