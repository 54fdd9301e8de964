"""What a cost model was measured on, and what it is used with: device, dtype, experts
implementation and the two checkpoints (docs/contract.md: a cost model is refused elsewhere
unless overridden). CostModel.check_measured_on compares two such dicts.

Checkpoints are identified by a fingerprint, not their path (paths differ between clones and
machines): a hash of config.json (less the keys a re-save rewrites) and of the weight files'
names and sizes. It tells architectures and checkpoints of other shapes apart; two trainings of
one architecture share it, which is what timing cares about.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pipeline.models.loading import ModelPair

# Written by save_pretrained itself, so they change when the same weights are re-saved.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def checkpoint_dir(name_or_path: str | Path) -> Path | None:
    """The local directory of a checkpoint: the path itself, or a hub id's snapshot in the
    local Hugging Face cache (what from_pretrained loaded); None when there is none."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    text = str(name_or_path)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(text, "config.json")
        if isinstance(found, str):
            return Path(found).parent
    return None


def checkpoint_fingerprint(name_or_path: str | Path) -> str | None:
    """``sha256:<16 hex>`` of the checkpoint's config.json (parsed, volatile keys dropped) and
    its weight files' names and sizes; None when no local checkpoint is found (an in-memory
    model, a path that does not exist here)."""
    directory = checkpoint_dir(name_or_path)
    if directory is None:
        return None
    config = json.loads((directory / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    if "torch_dtype" in config:  # newer transformers write the same field as "dtype"
        config["dtype"] = config.pop("torch_dtype")
    weights = sorted(
        (p.name, p.stat().st_size)
        for p in directory.iterdir()
        if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)
    )
    blob = json.dumps({"config": config, "weights": weights}, sort_keys=True)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def provenance_of(
    device: torch.device | str,
    dtype: torch.dtype | str,
    experts_implementation: str,
    target: str | Path,
    draft: str | Path,
) -> dict[str, Any]:
    """The provenance fields of a setup (the keys costmodel.json records)."""
    device = torch.device(device)
    return {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(dtype).replace("torch.", ""),
        "experts_implementation": experts_implementation,
        "target_model": str(target),
        "target_fingerprint": checkpoint_fingerprint(target),
        "draft_model": str(draft),
        "draft_fingerprint": checkpoint_fingerprint(draft),
    }


def pair_provenance(pair: ModelPair) -> dict[str, Any]:
    """What a loaded pair runs on. A pair built in memory (no checkpoint on disk) has
    fingerprints None: unknown, which matches no cost model."""
    return provenance_of(
        pair.device, pair.dtype, pair.experts_implementation, pair.target_path, pair.draft_path
    )


def manifest_provenance(manifest: dict[str, Any]) -> dict[str, Any]:
    """What an extraction (its manifest.json) ran on, as far as the manifest says: no device,
    no dtype when it was "auto" (it depended on the device). Fields left out are not compared.
    A fingerprint comes from the manifest when it records one, else from the checkpoint path if
    that exists here; when neither does, the checkpoint cannot be compared and is left out."""
    out: dict[str, Any] = {"experts_implementation": manifest.get("experts_implementation")}
    if manifest.get("dtype") not in (None, "auto"):
        out["dtype"] = str(manifest["dtype"]).replace("torch.", "")
    for role in ("target", "draft"):
        path = manifest.get(role)
        out[f"{role}_model"] = path
        fingerprint = manifest.get(f"{role}_fingerprint") or (
            checkpoint_fingerprint(path) if path else None
        )
        if fingerprint:
            out[f"{role}_fingerprint"] = fingerprint
    if out["experts_implementation"] is None:
        del out["experts_implementation"]
    return out
