"""Context labels and the clustered bootstrap of the oracle's choices per class."""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipeline.oracle.context_analysis import class_table, label_tokens, new_experts


def test_labels_follow_the_rules():
    pieces = [
        "def",
        " load",
        "(",
        "path",
        "):",
        "\n    ",
        '"""',
        "Read",
        " the",
        " file",
        ".",
        " Then",
        '"""',
        "\n    ",
        "#",
        " note",
        "\n",
        "x",
        " = ",
        "日本",
    ]
    labels = label_tokens(pieces)
    assert labels[:5] == [
        "identifier",
        "identifier",
        "code structure",
        "identifier",
        "code structure",
    ]
    assert labels[5] == "indentation/formatting"
    assert labels[6] == "code-prose transition"
    assert labels[7:10] == ["prose word"] * 3
    assert labels[10] == "sentence boundary" and labels[11] == "sentence boundary"
    assert labels[12] == "code-prose transition"
    assert labels[14] == "code-prose transition" and labels[15] == "prose word"
    assert labels[17] == "identifier" and labels[18] == "code structure"
    assert labels[19] == "script change"


def test_class_table_shares_and_intervals():
    rng = np.random.default_rng(0)
    rows = []
    for seq in range(20):
        for i in range(30):
            label = ("identifier", "code structure", "prose word")[i % 3]
            k = {"identifier": 1, "prose word": 0}.get(label, int(rng.integers(4, 8)))
            rows.append({"seq_id": f"s{seq}", "label": label, "k_star": k})
    table = class_table(pd.DataFrame(rows), reps=200).set_index("class")
    assert table.loc["identifier", "share_k1"] == 1.0
    assert table.loc["code structure", "share_k4"] == 1.0
    assert table.loc["code structure", "share_k1"] == 0.0
    assert table.loc["identifier", "k1_lo"] <= 1.0 <= table.loc["identifier", "k1_hi"]
    # k* = 0 (a plain step) is its own share, not counted as k* = 1.
    assert table.loc["prose word", "share_k0"] == 1.0
    assert table.loc["prose word", "share_k1"] == table.loc["identifier", "share_k0"] == 0.0


def test_new_experts_counts_fresh_experts_per_layer():
    routing = np.array([[[0, 1], [2, 3]], [[1, 4], [2, 3]], [[5, 6], [7, 2]]])
    assert new_experts(routing).tolist() == [0.0, 0.5, 1.5]
