"""Each of the greedy and the T = 1 cost model on each set of rounds: the target's bias and
MAPE, the draft line's bias, and the measured draft time per forward. Reads costmodel_t*.json
here and the rounds.parquet of the two calibrations (argv[1], argv[2]: their out folders)."""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.cost.design_stats import heldout_summary
from pipeline.cost.model import CostModel

HERE = Path(__file__).parent


def main(rounds_dirs: list[str]) -> None:
    models = {t: CostModel.load(HERE / f"costmodel_t{t}.json") for t in (0, 1)}
    rounds = {
        t: pd.read_parquet(Path(d) / "rounds.parquet")
        for t, d in zip((0, 1), rounds_dirs, strict=True)
    }
    for mt, model in models.items():
        print(f"model T={mt}: draft a={model.draft_a:.3f} b={model.draft_b:.3f}")
        for rt, df in rounds.items():
            held = heldout_summary(model, df)
            drafted = df[df.draft_forwards > 0]
            pred = np.array([model.t_draft(int(n)) for n in drafted.draft_forwards])
            bias = (pred / drafted.t_draft_ms.to_numpy() - 1).mean() * 100
            print(
                f"  on T={rt} rounds: target bias {held['bias_pct']:+.1f}%, MAPE "
                f"{held['mape_pct']:.1f}%; draft bias {bias:+.1f}%"
            )
    for rt, df in rounds.items():
        drafted = df[df.draft_forwards > 0]
        per_forward = (drafted.t_draft_ms / drafted.draft_forwards).mean()
        print(f"T={rt} rounds: {per_forward:.3f} ms per draft forward")


if __name__ == "__main__":
    main(sys.argv[1:3])
