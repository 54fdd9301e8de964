"""cluster.yaml is a valid Ray cluster launcher config with a CPU head and a GPU worker type."""

from __future__ import annotations

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pipeline.models.loading import REPO_ROOT


def test_cluster_yaml_validates_against_rays_schema():
    config = yaml.safe_load((REPO_ROOT / "cluster.yaml").read_text())
    # What `ray up` does: fill in the defaults, then validate against ray-schema.json
    # (jsonschema.ValidationError on a bad field).
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    gpu = [t for name, t in types.items() if t["resources"].get("GPU", 0) >= 1]
    assert gpu and gpu[0]["max_workers"] > gpu[0]["min_workers"]  # autoscaling
    assert any("pip install" in c and "-e ." in c for c in config["setup_commands"])
