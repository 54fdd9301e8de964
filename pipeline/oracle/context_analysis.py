"""Context analysis of the oracle's decisions (the paper's Appendix B): label every state by the
local context of the token it must predict next, then compare how often the oracle takes a plain
step (k* = 0), drafts one token (k* = 1) or many (k* >= 4) per class, with bootstrap intervals
clustered by sequence.

Labels come from the decoded text with simple, documented rules (first match wins):
  script change           the token's letters are in another Unicode script than the last letters
  code-prose transition   the token opens or closes a comment or docstring (#, triple quotes)
  indentation/formatting  whitespace only
  sentence boundary       in prose: sentence-ending punctuation, or the word after it
  prose word              in prose (comment, docstring): a word
  identifier              in code: a name
  code structure          in code: punctuation, operators, brackets, literals
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

CLASSES = (
    "script change",
    "code-prose transition",
    "indentation/formatting",
    "sentence boundary",
    "prose word",
    "identifier",
    "code structure",
)
_WORD = re.compile(r"^\s*[^\W\d]\w*$", re.UNICODE)


def _script(text: str) -> str | None:
    for ch in text:
        if ch.isalpha():
            name = unicodedata.name(ch, "")
            return name.split(" ")[0] if name else None
    return None


def label_tokens(pieces: Sequence[str]) -> list[str]:
    """One label per token piece (decoded text of each token, in order)."""
    labels: list[str] = []
    in_docstring = False
    in_comment = False
    last_script: str | None = None
    prev = ""
    for piece in pieces:
        script = _script(piece)
        toggles_doc = piece.count('"""') % 2 == 1 or piece.count("'''") % 2 == 1
        if script and last_script and script != last_script:
            label = "script change"
        elif toggles_doc or ("#" in piece and not in_docstring):
            label = "code-prose transition"
        elif not piece.strip():
            label = "indentation/formatting"
        elif in_docstring or in_comment:
            ends_sentence = piece.strip() in {".", "!", "?"} or prev.rstrip().endswith(
                (".", "!", "?")
            )
            label = "sentence boundary" if ends_sentence else "prose word"
        elif _WORD.match(piece):
            label = "identifier"
        else:
            label = "code structure"
        labels.append(label)
        if toggles_doc:
            in_docstring = not in_docstring
        if "#" in piece and not in_docstring:
            in_comment = True
        if "\n" in piece:
            in_comment = False
        if script:
            last_script = script
        prev = piece
    return labels


def _bootstrap_share(
    df: pd.DataFrame, column: str, reps: int, rng: np.random.Generator
) -> tuple[float, float, float]:
    """Share of ``column`` (bool) with a 95% interval from resampling whole sequences."""
    per_seq = df.groupby("seq_id")[column].agg(["sum", "count"])
    sums, counts = per_seq["sum"].to_numpy(float), per_seq["count"].to_numpy(float)
    share = sums.sum() / counts.sum()
    if len(per_seq) < 2:
        return share, float("nan"), float("nan")
    draws = rng.integers(0, len(per_seq), size=(reps, len(per_seq)))
    boot = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    return share, float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def class_table(states: pd.DataFrame, reps: int = 1000, seed: int = 0) -> pd.DataFrame:
    """``states`` has seq_id, label, k_star; shares of k* = 0, k* = 1 and k* >= 4 per class."""
    rng = np.random.default_rng(seed)
    rows = []
    for label in CLASSES:
        sub = states[states["label"] == label].assign(
            k0=lambda d: d["k_star"] == 0,
            k1=lambda d: d["k_star"] == 1,
            k4=lambda d: d["k_star"] >= 4,
        )
        if sub.empty:
            continue
        k0 = _bootstrap_share(sub, "k0", reps, rng)
        k1 = _bootstrap_share(sub, "k1", reps, rng)
        k4 = _bootstrap_share(sub, "k4", reps, rng)
        rows.append(
            {
                "class": label,
                "states": len(sub),
                "sequences": sub["seq_id"].nunique(),
                "share_k0": k0[0],
                "k0_lo": k0[1],
                "k0_hi": k0[2],
                "share_k1": k1[0],
                "k1_lo": k1[1],
                "k1_hi": k1[2],
                "share_k4": k4[0],
                "k4_lo": k4[1],
                "k4_hi": k4[2],
                "mean_k_star": float(sub["k_star"].mean()),
            }
        )
    return pd.DataFrame(rows)


def new_experts(routing: np.ndarray) -> np.ndarray:
    """Per position t >= 1: mean over layers of experts of x_t not used by x_{t-1}."""
    out = np.zeros(len(routing))
    for t in range(1, len(routing)):
        fresh = [
            len(set(routing[t, layer].tolist()) - set(routing[t - 1, layer].tolist()))
            for layer in range(routing.shape[1])
        ]
        out[t] = float(np.mean(fresh))
    return out


def sequence_states(
    seq_id: str,
    token_ids: np.ndarray,
    k_star: np.ndarray,
    draft_match: np.ndarray,
    routing: np.ndarray,
    decode_piece: Callable[[int], str],
) -> pd.DataFrame:
    """One row per state i: the label of x_{i+1} (the token the round must produce first), k*,
    and the new experts at x_{i+1}; flags for the first mismatch after a match."""
    pieces = [decode_piece(int(t)) for t in token_ids]
    labels = label_tokens(pieces)
    fresh = new_experts(routing)
    n = len(k_star)
    match = draft_match.astype(bool)
    first_mismatch = np.zeros(n + 1, dtype=bool)
    first_mismatch[2:] = ~match[2:] & match[1:-1]
    return pd.DataFrame(
        {
            "seq_id": seq_id,
            "i": np.arange(n),
            "label": labels[1 : n + 1],
            "k_star": k_star,
            "new_experts": fresh[1 : n + 1],
            "first_mismatch": first_mismatch[1 : n + 1],
        }
    )


def expert_novelty(states: pd.DataFrame) -> dict[str, float]:
    """Mean new experts at script changes, at first mismatches, and overall."""

    def mean(mask: pd.Series) -> float:
        return float(states.loc[mask, "new_experts"].mean()) if mask.any() else float("nan")

    return {
        "new_experts_script_change": mean(states["label"] == "script change"),
        "new_experts_first_mismatch": mean(states["first_mismatch"]),
        "new_experts_all": mean(states["new_experts"].notna()),
        "script_change_states": int((states["label"] == "script change").sum()),
        "first_mismatch_states": int(states["first_mismatch"].sum()),
    }
