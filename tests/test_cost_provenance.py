"""A cost model says what it was measured on and refuses other setups unless told to go on:
checkpoint fingerprints, the check, its override, old files, the
committed model against the embedded pair, and the m coverage checked at load."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.cost.model import CostModel, CostModelMismatchError
from pipeline.cost.provenance import (
    checkpoint_fingerprint,
    manifest_provenance,
    pair_provenance,
    provenance_of,
)
from pipeline.decode.policies.artifacts import DEFAULT_COSTMODEL, load_artifacts
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, ModelPair, load_pair
from tests.conftest import tiny_draft
from tests.tinymodels import VOCAB, tiny_model


def measured_on(target: Path, draft: Path, **over) -> CostModel:
    """A small cost model as jobs.calibrate would record it for (target, draft) on this CPU."""
    meta = {**provenance_of("cpu", torch.float32, "eager", target, draft), **over}
    return CostModel(
        {m: 4.0 for m in range(1, 6)}, {m: 0.1 for m in range(1, 6)}, 0.001, 0.5, 0.1, meta
    )


def test_fingerprint_names_the_checkpoint_not_its_path(checkpoints, tmp_path):
    fp = checkpoint_fingerprint(checkpoints.target)
    assert fp and fp.startswith("sha256:")
    assert fp != checkpoint_fingerprint(checkpoints.draft)
    clone = shutil.copytree(checkpoints.target, tmp_path / "elsewhere" / "target")
    assert checkpoint_fingerprint(clone) == fp  # another clone, another path: the same model
    config = json.loads((clone / "config.json").read_text())
    config.update(transformers_version="0.0.1", _name_or_path="/somewhere/else")
    (clone / "config.json").write_text(json.dumps(config, indent=4))
    assert checkpoint_fingerprint(clone) == fp  # a re-save rewrites these, not the model
    config["num_experts_per_tok"] = config["num_experts_per_tok"] + 1
    (clone / "config.json").write_text(json.dumps(config))
    assert checkpoint_fingerprint(clone) != fp
    grown = shutil.copytree(checkpoints.target, tmp_path / "grown")
    with (grown / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 8)
    assert checkpoint_fingerprint(grown) != fp  # other weights' sizes
    assert checkpoint_fingerprint(tmp_path / "nothing-here") is None


def test_same_setup_passes(checkpoints):
    model = measured_on(checkpoints.target, checkpoints.draft)
    saved = load_pair(checkpoints.target, checkpoints.draft, "cpu", "float32")
    assert model.check_measured_on(pair_provenance(saved)) == []


def test_other_setup_is_refused_naming_every_difference_and_the_way_on(checkpoints, caplog):
    model = measured_on(DEFAULT_TARGET, DEFAULT_DRAFT)
    model.source = "models/costmodel.json"
    used = provenance_of("cpu", torch.bfloat16, "grouped_mm", checkpoints.target, checkpoints.draft)
    used.update(device="cuda:0", device_name="NVIDIA H200")  # as a GPU machine would say
    with pytest.raises(CostModelMismatchError) as err:
        model.check_measured_on(used)
    text = str(err.value)
    assert isinstance(err.value, ValueError) and "models/costmodel.json" in text
    assert "dtype: measured on float32, used with bfloat16" in text
    assert "device: measured on cpu, used with cuda:0" in text
    assert "experts_implementation: measured on eager, used with grouped_mm" in text
    for role, path in (("target", checkpoints.target), ("draft", checkpoints.draft)):
        assert f"{role}_fingerprint: measured on sha256:" in text and str(path) in text
    assert "--allow-costmodel-mismatch" in text and "allow_mismatch=True" in text
    with caplog.at_level(logging.WARNING, logger="pipeline.cost.model"):
        lines = model.check_measured_on(used, allow_mismatch=True)
    assert len(lines) == 6
    assert "going on anyway" in caplog.text and "dtype: measured on float32" in caplog.text


def test_a_pair_built_in_memory_is_unknown_and_refused():
    target = tiny_model("mixtral", seed=3)
    pair = ModelPair(
        target,
        tiny_draft(VOCAB),
        None,
        moe_spec(target.config),
        torch.device("cpu"),
        torch.float32,
        "eager",
        "t",
        "d",
    )
    model = measured_on(DEFAULT_TARGET, DEFAULT_DRAFT)
    assert set(model.provenance_mismatches(pair_provenance(pair))) == {
        "target_fingerprint",
        "draft_fingerprint",
    }
    with pytest.raises(ValueError, match="unknown \\(no checkpoint on disk at t\\)"):
        model.check_measured_on(pair_provenance(pair))


def test_committed_cost_model_fits_the_embedded_pair_and_refuses_the_tiny_one(checkpoints):
    """models/costmodel.json was measured on this kind of machine (x86_64 CPU, float32, eager)
    with models/target + models/draft: the default pair passes; on another CPU only its name
    differs. Tests' tiny checkpoints are other models: refused unless allowed."""
    artifacts = load_artifacts()
    default = load_pair(device="cpu")
    diffs = artifacts.cost.provenance_mismatches(pair_provenance(default))
    assert set(diffs) <= {"device_name"}, diffs
    if not diffs:
        assert artifacts.check_pair(default) == []
    tiny = load_pair(checkpoints.target, checkpoints.draft, "cpu", "float32")
    with pytest.raises(CostModelMismatchError, match="target_fingerprint"):
        artifacts.cost.check_measured_on(pair_provenance(tiny))
    assert "draft_fingerprint" in " ".join(
        artifacts.cost.check_measured_on(pair_provenance(tiny), allow_mismatch=True)
    )


def test_an_old_file_without_fingerprints_is_refused_unless_allowed(checkpoints, tmp_path):
    data = json.loads(DEFAULT_COSTMODEL.read_text())
    for key in ("target_fingerprint", "draft_fingerprint", "device_name"):
        del data[key]
    old = tmp_path / "costmodel.json"
    old.write_text(json.dumps(data))
    prov = provenance_of("cpu", torch.float32, "eager", DEFAULT_TARGET, DEFAULT_DRAFT)
    with pytest.raises(CostModelMismatchError, match="not recorded in the cost model") as err:
        CostModel.load(old, provenance=prov)
    assert str(old) in str(err.value) and "target_fingerprint" in str(err.value)
    model = CostModel.load(old, range(1, 4), "a test", provenance=prov, allow_mismatch=True)
    assert model.t_draft(2) > 0
    assert CostModel.load(old).source == str(old)  # no provenance given: nothing compared


def test_an_m_the_model_lacks_is_an_error_at_load(tmp_path):
    path = tmp_path / "costmodel.json"
    measured_on(DEFAULT_TARGET, DEFAULT_DRAFT).save(path)
    with pytest.raises(ValueError, match="m = 6, 7"):
        CostModel.load(path, range(1, 8), "the oracle at Lmax 6")


def test_manifest_provenance_compares_what_the_manifest_records(checkpoints):
    manifest = {
        "target": str(checkpoints.target),
        "draft": str(checkpoints.draft),
        "dtype": "auto",
        "experts_implementation": "eager",
        "lmax": 4,
    }
    prov = manifest_provenance(manifest)
    assert "device" not in prov and "dtype" not in prov  # "auto": depended on the device
    assert prov["target_fingerprint"] == checkpoint_fingerprint(checkpoints.target)
    assert measured_on(checkpoints.target, checkpoints.draft).check_measured_on(prov) == []
    other = measured_on(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="bfloat16")
    assert set(other.provenance_mismatches(prov)) == {"target_fingerprint", "draft_fingerprint"}
    moved = manifest_provenance(
        {**manifest, "target": "/gone/target", "draft": "/gone/draft", "dtype": "bfloat16"}
    )
    assert set(other.provenance_mismatches(moved)) == set()  # nothing left to tell them apart
    recorded = manifest_provenance(
        {**manifest, "target": "/gone/target", "target_fingerprint": "sha256:0000"}
    )
    assert "target_fingerprint" in other.provenance_mismatches(recorded)


def test_a_broken_batch_section_is_refused_at_load():
    """The batch > 1 section is checked when the file is read, not when a batch first needs
    it (an unreachable check once let a broken section load)."""
    data = json.loads(DEFAULT_COSTMODEL.read_text())
    assert CostModel.from_json(data).batch is not None
    del data["batch"]["b_union"]
    with pytest.raises(ValueError, match="not a specbound cost model.*b_union"):
        CostModel.from_json(data)
