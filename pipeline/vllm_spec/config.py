"""The proposer's settings and the artifacts it reads, checked before any engine starts.

vLLM builds a ``custom_class`` proposer from its own config alone, so our settings travel in
the environment: ``SPECBOUND_PROPOSER`` holds a JSON object (the fields below; every one has
a default), read in vLLM's worker process. ``check`` loads and checks everything the proposer
will load, so a bad artifact is refused with its reason in the process that asked for the
engine, before vLLM spawns anything (vLLM's own report of a proposer that fails to build is
a RuntimeError deep in its engine start).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.acceptance.features import FEATURE_NAMES
from pipeline.acceptance.model import AcceptanceModel
from pipeline.cost.batch import BatchCost
from pipeline.cost.provenance import checkpoint_fingerprint
from pipeline.vllm_spec import step_cost
from pipeline.vllm_spec.env_settings import fields_from_env

ENV = "SPECBOUND_PROPOSER"
CLASS_PATH = "pipeline.vllm_spec.proposer.CostAwareProposer"
ROOT = Path(__file__).resolve().parents[2]
DESIGNS = ("policy", "fixed", "random")  # random and fixed: calibration and like-for-like peers


@dataclass(frozen=True)
class ProposerConfig:
    draft: str = "models/draft"  # our draft checkpoint (relative paths: the repository's)
    acceptance: str | None = None  # default: acceptance.json beside the draft, else models/
    costmodel: str | None = None  # default: vllm_costmodel.json beside the draft, else models/
    temperature: float = 0.0  # the decoding mode acceptance is priced in (vLLM passes none)
    probe_every: int = 8  # plain steps in a row before a row drafts one token anyway
    adapt: float = 0.2  # online logit correction of the acceptance model per judged token
    design: str = "policy"  # policy: ours; fixed: always K; random: k ~ U{0..K} (calibration)
    record: str | None = None  # JSONL of step records (calibration)
    seed: int = 0
    allow_mismatch: bool = False  # accept artifacts measured or learned on another setup

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ValueError(f"design {self.design!r}: one of {', '.join(DESIGNS)}")
        if not 1 <= self.probe_every <= 64:
            raise ValueError(f"probe_every {self.probe_every}: between 1 and 64")
        if not 0.0 <= self.adapt <= 1.0:
            raise ValueError(f"adapt {self.adapt}: between 0 and 1")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature}: must be >= 0")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ProposerConfig:
        return cls(**fields_from_env(cls, ENV, environ))

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    def path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else ROOT / p

    def artifact(self, name: str, value: str | None) -> Path:
        if value is not None:
            return self.path(value)
        beside = self.path(self.draft) / name
        return beside if beside.exists() else ROOT / "models" / name

    @property
    def needs_model(self) -> bool:
        return self.design == "policy"


@dataclass
class Artifacts:
    config: ProposerConfig
    draft: Path
    acceptance: AcceptanceModel | None
    cost: BatchCost | None
    warnings: list[str]


def check(
    config: ProposerConfig,
    target: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    vllm_version: str | None = None,
) -> Artifacts:
    """Everything the proposer loads for ``target``, checked: the draft exists and shares the
    target's vocabulary, the acceptance model was learned on this pair and reads this draft's
    hidden width, the step cost model was measured on this setup. A FileNotFoundError or
    ValueError says which and what to do."""
    draft = config.path(config.draft)
    if not (draft / "config.json").is_file():
        raise FileNotFoundError(f'no draft checkpoint at {draft} ("draft" in ${ENV})')
    target_cfg = _read_config(Path(target))
    draft_cfg = _read_config(draft)
    if target_cfg.get("vocab_size") != draft_cfg.get("vocab_size"):
        raise ValueError(
            f"the draft {draft} has vocabulary {draft_cfg.get('vocab_size')}, the target "
            f"{target} {target_cfg.get('vocab_size')}: a draft must share its target's tokenizer"
        )
    warnings: list[str] = []
    acceptance = cost = None
    if config.needs_model:
        acceptance = _acceptance(config, Path(target), draft, draft_cfg, warnings)
        here = step_cost.engine_provenance(target, draft, dtype, device, vllm_version or "")
        skip = () if vllm_version else ("vllm_version",)  # the project's env has no vLLM
        path = config.artifact("vllm_costmodel.json", config.costmodel)
        cost, differ = step_cost.load(path, here, config.allow_mismatch, skip)
        warnings += differ
    return Artifacts(config, draft, acceptance, cost, warnings)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no checkpoint at {path} (no config.json)") from exc


def _acceptance(
    config: ProposerConfig,
    target: Path,
    draft: Path,
    draft_cfg: dict[str, Any],
    warnings: list[str],
) -> AcceptanceModel:
    path = config.artifact("acceptance.json", config.acceptance)
    if not path.is_file():
        raise FileNotFoundError(
            f"no acceptance model at {path}: train one for this pair with "
            "python -m jobs.train_acceptance"
        )
    model = AcceptanceModel.load(path)
    hidden = draft_cfg.get("hidden_size")
    for name, mode in model.modes.items():
        width = len(mode.current) - len(FEATURE_NAMES)
        if width not in (0, hidden):
            raise ValueError(
                f"the acceptance model {path} ({name}) reads a hidden state of "
                f"{width} dimensions, the draft {draft} has {hidden}: train one "
                "for this pair with python -m jobs.train_acceptance"
            )
    trained = model.meta.get("pair", {})
    for role, ckpt in (("target", target), ("draft", draft)):
        want, have = trained.get(f"{role}_fingerprint"), checkpoint_fingerprint(ckpt)
        if want and have and want != have:
            problem = (
                f"the acceptance model {path} was learned with {role} "
                f"{trained.get(f'{role}_model')} ({want}), not {ckpt} ({have}): train "
                "one for this pair with python -m jobs.train_acceptance"
            )
            if not config.allow_mismatch:
                raise ValueError(problem)
            warnings.append(problem)
    return model
