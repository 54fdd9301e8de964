"""The research endpoint with the EAGLE-3 head as its draft (`draft=models/eagle3-head`, one
sequence a step), over real HTTP: the cost-aware policies read the head's own artifacts
(its cost model and acceptance model beside it, the embedded pair's predictor and nothing
measured for another draft), and every listed policy, the default included, answers with plain
greedy decoding's text. Also, without Ray: which artifacts a pair's directory gives."""

from __future__ import annotations

import httpx
import pytest

from pipeline.decode.policies.artifacts import (
    DEFAULT_PREDICTOR,
    artifact_paths,
    artifacts_beside,
    load_pair_artifacts,
)
from pipeline.models.loading import REPO_ROOT, load_pair
from tests.serving_support import one_thread_pair, plain_greedy, serve_apps

HEAD = REPO_ROOT / "models" / "eagle3-head"
PROMPT = "def fibonacci(n):\n    "


def test_a_pair_s_artifacts_are_read_beside_its_draft():
    assert artifacts_beside(HEAD) == HEAD
    assert artifacts_beside(REPO_ROOT / "models" / "draft") is None  # the embedded pair's
    assert artifacts_beside(None) is None
    paths, notes = artifact_paths(HEAD)
    assert paths["costmodel"] == HEAD / "costmodel.json"
    assert paths["acceptance"] == HEAD / "acceptance.json"
    assert paths["policy"] == HEAD / "policy.json"
    assert paths["predictor"] == DEFAULT_PREDICTOR and "has no predictor" in notes[0]
    # The head's cost model is the head pair's: it passes the pair check the server makes,
    # which the embedded pair's (measured with another draft) does not.
    pair = load_pair(draft=HEAD, device="cpu")
    load_pair_artifacts(HEAD, "cpu").check_pair(pair)
    with pytest.raises(ValueError, match="eagle3-head"):
        load_pair_artifacts(None, "cpu").check_pair(pair)


@pytest.mark.slow
def test_the_endpoint_drafts_with_the_head():
    from jobs.cli import init_ray

    with one_thread_pair() as pair:
        ref_tokens, ref_text = plain_greedy(pair, PROMPT, 16)
    app = ("specbound-head", "/", {"draft": str(HEAD), "max_batch": 1, "num_cpus": 1})
    with serve_apps([app], lambda: init_ray(num_cpus=2)) as base:
        names = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["policies"]
        for spec in [None, *({"policy": name} for name in names)]:
            body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
            if spec is not None:
                body["speculation"] = spec
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, (spec, response.text)
            out = response.json()
            assert out["choices"][0]["text"] == ref_text, spec
            assert out["usage"]["completion_tokens"] == len(ref_tokens), spec
        assert out["speculation"]["policy"] == names[-1]
