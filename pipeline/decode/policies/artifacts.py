"""What the cost-aware policies read, saved beside the models: the expert predictor
(``predictor/``, from jobs.train_predictor), the cost model (``costmodel.json``, from
jobs.calibrate) and the oracle's boundary slope lambda (``policy.json``, from jobs.oracle).

The committed copies under models/ were produced on a 2-core x86_64 CPU (float32, eager
experts) with the embedded models; on other hardware calibrate and rerun the oracle, then point
``--costmodel`` / ``--policy`` (or this module's loader) at the new files, since the cost model
is per device. ``PolicyArtifacts.check_pair`` refuses a pair the cost model was not measured on
(device, dtype, experts implementation, checkpoints) unless told to go on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from pipeline.acceptance.features import FEATURE_NAMES
from pipeline.acceptance.model import AcceptanceModel
from pipeline.cost.model import CostModel
from pipeline.cost.provenance import pair_provenance
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import REPO_ROOT, ModelPair
from pipeline.predictor.model import ExpertPredictor, LearnedExpertPredictor

log = logging.getLogger(__name__)

MODELS_DIR = REPO_ROOT / "models"
DEFAULT_PREDICTOR = MODELS_DIR / "predictor"
DEFAULT_COSTMODEL = MODELS_DIR / "costmodel.json"
DEFAULT_POLICY = MODELS_DIR / "policy.json"
DEFAULT_ACCEPTANCE = MODELS_DIR / "acceptance.json"


def artifact_paths(
    directory: Path, predictor: Path = DEFAULT_PREDICTOR, policy: Path = DEFAULT_POLICY
) -> tuple[dict[str, Path], list[str]]:
    """The artifacts of another pair saved in ``directory`` (the 2-layer draft's, the EAGLE-3
    head's): its cost model and acceptance model, and its expert predictor and oracle lambda
    where it has them; a pair without those (they come from an extraction) keeps
    ``predictor`` / ``policy``, each said in the notes returned. Keyword arguments of
    load_artifacts."""
    paths = {
        "costmodel": directory / "costmodel.json",
        "acceptance": directory / "acceptance.json",
        "predictor": predictor,
        "policy": policy,
    }
    notes = []
    for key, name in (("predictor", "predictor"), ("policy", "policy.json")):
        if (directory / name).exists():
            paths[key] = directory / name
        else:
            notes.append(
                f"{directory} has no {name}: using {paths[key]} (ecospec, ecospec-global, "
                "marginal and cascade read it)"
            )
    return paths, notes


def artifacts_beside(draft: str | Path | None) -> Path | None:
    """The draft's own directory when it holds a cost model (a pair with its artifacts beside
    its draft: models/draft-2layer, models/eagle3-head), else None (the embedded pair's)."""
    if draft is None or not (Path(draft) / "costmodel.json").is_file():
        return None
    return Path(draft)


@dataclass(frozen=True)
class PolicyArtifacts:
    predictor: ExpertPredictor
    cost: CostModel
    lam: float  # ms of expected cost per token of expected progress
    # The draft's acceptance learned offline (jobs.train_acceptance); None: not trained.
    acceptance: AcceptanceModel | None = None

    def for_sampling(self, sampling: SamplingConfig) -> PolicyArtifacts:
        """These artifacts with the cost model's prices for the mode ``sampling`` decodes in
        (CostModel.for_sampling): what a policy for such a generation is built from."""
        cost = self.cost.for_sampling(sampling.temperature, sampling.top_p)
        return self if cost is self.cost else replace(self, cost=cost)

    def check_target(self, num_moe_layers: int, num_experts: int) -> None:
        """A predictor trained for another target would price the wrong experts."""
        p = self.predictor
        if isinstance(p, LearnedExpertPredictor) and (
            p.model.layers != num_moe_layers or p.model.num_experts != num_experts
        ):
            raise ValueError(
                f"the expert predictor predicts {p.model.layers} MoE layers x "
                f"{p.model.num_experts} experts, but the target has {num_moe_layers} x "
                f"{num_experts}: train one for this target with python -m jobs.train_predictor"
            )

    def check_pair(self, pair: ModelPair, allow_mismatch: bool = False) -> list[str]:
        """Before decoding with ``pair``: the predictor fits its target (always enforced) and
        the cost model was measured on its device, dtype, experts implementation and
        checkpoints (CostModel.check_measured_on: a CostModelMismatchError listing every
        difference, or with ``allow_mismatch`` a logged warning; the differences returned)."""
        self.check_target(pair.spec.num_moe_layers, pair.spec.num_experts)
        self.check_acceptance(pair, allow_mismatch)
        return self.cost.check_measured_on(pair_provenance(pair), allow_mismatch)

    def check_acceptance(self, pair: ModelPair, allow_mismatch: bool = False) -> None:
        """An acceptance model learned on another draft or target predicts the wrong rates:
        a ValueError, or with ``allow_mismatch`` a logged warning."""
        if self.acceptance is None:
            return
        hidden = pair.draft.config.hidden_size
        for name, mode in self.acceptance.modes.items():
            widths = {len(mode.current) - len(FEATURE_NAMES), len(mode.head) - 1} - {0, -1}
            if widths - {hidden}:
                raise ValueError(
                    f"the acceptance model's {name} part reads a hidden state of "
                    f"{sorted(widths)} dimensions, the draft's has {hidden}: train "
                    "one for this pair with python -m jobs.train_acceptance"
                )
        trained = self.acceptance.meta.get("pair", {})
        here = pair_provenance(pair)
        for role in ("target", "draft"):
            key = f"{role}_fingerprint"
            if trained.get(key) and here.get(key) and trained[key] != here[key]:
                problem = (
                    f"the acceptance model was learned with {role} {trained.get(f'{role}_model')}"
                    f" ({trained[key]}), not {here.get(f'{role}_model')} ({here[key]}): train "
                    "one for this pair with python -m jobs.train_acceptance"
                )
                if not allow_mismatch:
                    raise ValueError(problem)
                log.warning("%s (allowed)", problem)


def read_lambda(path: Path) -> float:
    try:
        lam = json.loads(Path(path).read_text())["lambda_ms_per_token"]
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"no oracle policy at {path}; run python -m jobs.oracle and pass its policy.json"
        ) from exc
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not an oracle policy.json (no lambda_ms_per_token)") from exc
    if lam is None or lam <= 0:
        raise ValueError(
            f"{path}: lambda must be > 0, got {lam} (the oracle's delta space "
            "found no usable boundary; recalibrate)"
        )
    return float(lam)


@lru_cache(maxsize=8)
def load_artifacts(
    predictor: Path = DEFAULT_PREDICTOR,
    costmodel: Path = DEFAULT_COSTMODEL,
    policy: Path = DEFAULT_POLICY,
    device: str = "cpu",
    acceptance: Path | None = DEFAULT_ACCEPTANCE,
) -> PolicyArtifacts:
    """Loaded once per process and set of paths (servers build a policy per request). A
    missing acceptance model is left None (the policies that need it say so when built)."""
    accept = None
    if acceptance is not None and Path(acceptance).exists():
        accept = AcceptanceModel.load(Path(acceptance))
    return PolicyArtifacts(
        LearnedExpertPredictor.load(predictor, device),
        CostModel.load(costmodel),
        read_lambda(policy),
        accept,
    )


def load_pair_artifacts(directory: str | Path | None, device: str = "cpu") -> PolicyArtifacts:
    """A pair's artifacts from ``directory`` (artifact_paths; its notes logged), or the
    embedded pair's under models/ when None."""
    if directory is None:
        return load_artifacts(device=device)
    paths, notes = artifact_paths(Path(directory))
    for note in notes:
        log.warning(note)
    return load_artifacts(**paths, device=device)
