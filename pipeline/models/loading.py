"""Loading a MoE target and its draft: device and dtype choice, validation, clear errors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from pipeline.models.adapters import MoESpec, moe_spec
from pipeline.models.eagle3 import Eagle3Head
from pipeline.models.eagle3_formats import head_format, load_head, read_config
from pipeline.models.eagle3_verifier import bind_to_target

# Per-shard "Loading weights" bars flood job logs (one per model per worker).
hf_logging.disable_progress_bar()

# The embedded default models (built by jobs/train_tiny.py), found relative to the repository.
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = REPO_ROOT / "models" / "target"
DEFAULT_DRAFT = REPO_ROOT / "models" / "draft"
DEFAULT_HEAD = REPO_ROOT / "models" / "eagle3-head"  # the target's EAGLE-3 head

EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or unreadable."""


class TokenizerMismatchError(ValueError):
    """Draft and target do not share a vocabulary, so draft tokens mean nothing to the target."""


def pick_device(requested: str | None = None) -> torch.device:
    if requested and requested != "auto":
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, requested: str | None = None) -> torch.dtype:
    if requested and requested != "auto":
        dtype = getattr(torch, requested, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {requested!r} (try float32, bfloat16, float16)")
        return dtype
    # bf16 where the hardware runs it natively; fp32 on CPU, where bf16 matmuls are slow.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _check_local_checkpoint(path: Path, role: str) -> None:
    if not path.exists():
        raise CheckpointError(f"{role} checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{role} checkpoint {path} is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{role} checkpoint {path} has no config.json")
    try:
        parsed = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{role} checkpoint {path}: config.json is corrupt ({exc})") from exc
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise CheckpointError(f"{role} checkpoint {path}: config.json has no model_type")
    if not any((path / name).is_file() for name in _WEIGHT_FILES):
        raise CheckpointError(
            f"{role} checkpoint {path} has no weights (looked for {', '.join(_WEIGHT_FILES)})"
        )


def _is_local(name_or_path: str | Path) -> bool:
    text = str(name_or_path)
    # A hub id is "org/name"; anything else that looks like a path is treated as local.
    return Path(text).exists() or text.startswith((".", "/", "~")) or text.count("/") != 1


def load_config(name_or_path: str | Path, role: str = "target"):
    if _is_local(name_or_path):
        _check_local_checkpoint(Path(name_or_path).expanduser(), role)
    try:
        return AutoConfig.from_pretrained(str(name_or_path))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read the {role} config from {name_or_path}: {exc}") from exc


def load_model(
    name_or_path: str | Path,
    role: str = "target",
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    experts_implementation: str = "eager",
) -> PreTrainedModel:
    """A causal LM in eval mode on ``device``; MoE models get the requested experts kernel."""
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(
            f"experts implementation {experts_implementation!r} is not one of "
            f"{', '.join(EXPERTS_IMPLEMENTATIONS)}"
        )
    device = device or pick_device()
    dtype = dtype or pick_dtype(device)
    config = load_config(name_or_path, role)
    kwargs: dict = {"dtype": dtype}
    if device.type == "cuda":
        # Weights go straight to the GPU, shard by shard: a large checkpoint never has to fit
        # in host memory first (transformers 5 builds the model on the meta device).
        kwargs["device_map"] = str(device)
    if role == "target" or _has_experts(config):
        kwargs["experts_implementation"] = experts_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), config=config, **kwargs)
    except Exception as exc:  # corrupt weights surface as many different exception types
        raise CheckpointError(
            f"cannot load the {role} weights from {name_or_path}: {type(exc).__name__}: {exc}"
        ) from exc
    return model.to(device).eval()


def _has_experts(config) -> bool:
    return any(
        getattr(config, key, 0) for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def load_tokenizer(name_or_path: str | Path, role: str = "target") -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(name_or_path))
    except Exception as exc:
        raise CheckpointError(
            f"cannot load the {role} tokenizer from {name_or_path}: {type(exc).__name__}: {exc}"
        ) from exc


def check_same_vocabulary(
    target_tok: PreTrainedTokenizerBase,
    draft_tok: PreTrainedTokenizerBase,
    target: PreTrainedModel,
    draft: PreTrainedModel,
) -> None:
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(t_vocab.keys() - d_vocab.keys())
        only_d = len(d_vocab.keys() - t_vocab.keys())
        moved = sum(1 for k in t_vocab.keys() & d_vocab.keys() if t_vocab[k] != d_vocab[k])
        raise TokenizerMismatchError(
            f"draft and target tokenizers differ: {len(t_vocab)} vs {len(d_vocab)} tokens, "
            f"{only_t} only in the target, {only_d} only in the draft, {moved} with other ids"
        )
    t_rows = target.get_output_embeddings().weight.shape[0]
    d_rows = draft.get_output_embeddings().weight.shape[0]
    if t_rows != d_rows:
        raise TokenizerMismatchError(
            f"draft and target output layers differ in size: {d_rows} vs {t_rows} logits"
        )


@dataclass
class ModelPair:
    target: PreTrainedModel
    draft: PreTrainedModel | Eagle3Head  # a separate draft model, or an EAGLE-3 head
    tokenizer: PreTrainedTokenizerBase
    spec: MoESpec
    device: torch.device
    dtype: torch.dtype
    experts_implementation: str
    target_path: str
    draft_path: str

    @property
    def draft_is_head(self) -> bool:
        """The draft is an EAGLE-3 head (it reads the target's hidden states)."""
        return isinstance(self.draft, Eagle3Head)

    def require_draft_model(self, what: str) -> None:
        """Refuse ``what`` (a stage that runs the draft as a causal LM) for a head."""
        if self.draft_is_head:
            raise ValueError(
                f"{what} runs the draft as a separate model; the draft {self.draft_path} is "
                "an EAGLE-3 head"
            )


def load_pair(
    target: str | Path = DEFAULT_TARGET,
    draft: str | Path = DEFAULT_DRAFT,
    device: str | None = None,
    dtype: str | None = None,
    experts_implementation: str = "eager",
) -> ModelPair:
    """Load and validate a MoE target with its draft: a causal LM sharing the target's
    vocabulary, or an EAGLE-3 head (either format, pipeline.models.eagle3_formats) whose
    verifier is this target.

    Raises CheckpointError, UnsupportedArchitectureError, NoMoELayersError,
    TokenizerMismatchError or, for a head, HeadFormatError or VerifierMismatchError, with a
    message that says what is wrong and where.
    """
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    # Check the architecture before loading any weights: the errors are cheap and specific.
    target_config = load_config(target, "target")
    spec = moe_spec(target_config)
    if head_format(draft) is not None:
        # An EAGLE-3 head: checked against the target's config before any weight is read.
        bind_to_target(read_config(draft)[0], target_config)
        target_tok = load_tokenizer(target, "target")
        target_model = load_model(target, "target", dev, dt, experts_implementation)
        draft_model = load_head(draft, target_model, dev, dt)
    else:
        load_config(draft, "draft")
        target_tok = load_tokenizer(target, "target")
        draft_tok = load_tokenizer(draft, "draft")
        target_model = load_model(target, "target", dev, dt, experts_implementation)
        draft_model = load_model(draft, "draft", dev, dt, experts_implementation)
        check_same_vocabulary(target_tok, draft_tok, target_model, draft_model)
    return ModelPair(
        target=target_model,
        draft=draft_model,
        tokenizer=target_tok,
        spec=spec,
        device=dev,
        dtype=dt,
        experts_implementation=experts_implementation,
        target_path=str(target),
        draft_path=str(draft),
    )
