"""An EAGLE-3 head's acceptance traces follow the chains it drafts: each row's distribution is
the one the engine's head drafter drafts that chain token from (after the chain's earlier
tokens), labels follow the verification rule, `next` pairs stay inside a chain and recent
acceptance moves once per chain; the traces round-trip through their file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.acceptance.features import FEATURE_NAMES, distribution_stats
from pipeline.acceptance.head_chains import head_chain_rows
from pipeline.acceptance.traces import AcceptanceTrace, UnionCounts, load_traces, save_traces
from pipeline.acceptance.training import design
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.draft_pass import draft_pass
from pipeline.models.eagle3 import HeadCache
from pipeline.models.loading import ModelPair
from tests.tinymodels import VOCAB, cpu_pair, tiny_head, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
W = len(FEATURE_NAMES)


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    target = tiny_model("qwen3_moe", seed=31)
    return cpu_pair(target, tiny_head(target, seed=32))


@torch.no_grad()
def test_chain_rows_are_the_distributions_the_engine_drafts_from(pair):
    sampling = SamplingConfig(1.0)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (5,), generator=gen).tolist()
    text = torch.randint(1, VOCAB, (9,), generator=gen).tolist()
    full = torch.tensor([ids + text])
    start, n = len(ids) - 1, len(text)
    p = sampling.probs(pair.target(full).logits[0, start : start + n])
    cache = HeadCache()
    logits, states = draft_pass(pair, full, head_cache=cache)
    q = sampling.probs(logits[0, start : start + n])
    depth = 4
    stats, labels, hidden, depths = head_chain_rows(
        pair.draft, cache, states[0], ids, text, p, q, sampling, depth
    )
    assert len(cache) == len(ids) + n - 1  # returned to the reference
    expected_depths = [d for i in range(n) for d in range(1, min(depth, n - i) + 1)]
    assert depths.tolist() == expected_depths
    engine = SpeculativeEngine(pair)
    row = 0
    for i in range(n):
        session = engine.start(ids + text[:i], make_policy("fixed", k=1), sampling, seed=0)
        drafter = session.drafter
        drafter.start_step()
        probs = drafter.begin(session.committed)
        for d in range(1, min(depth, n - i) + 1):
            if d > 1:
                probs = drafter.extend(text[i + d - 2])  # the chain's earlier token, accepted
            np.testing.assert_allclose(
                stats[row, :4], distribution_stats(probs).numpy(), rtol=1e-4, atol=1e-6
            )
            expected = torch.minimum(p[i + d - 1], probs).sum().item()
            assert labels[row] == pytest.approx(expected, rel=1e-4, abs=1e-6), (i, d)
            np.testing.assert_allclose(
                hidden[row], drafter.hidden[-1].numpy(), rtol=1e-4, atol=1e-4
            )
            row += 1
        drafter.end()
    assert row == len(labels)


def test_next_pairs_stay_inside_a_chain_and_recent_moves_per_chain():
    stats = np.zeros((5, W - 2))
    labels = np.array([1.0, 1.0, 0.0, 0.0, 1.0])
    trace = AcceptanceTrace("p", 0.0, stats, labels, depth=np.array([1, 2, 3, 1, 1]))
    x, y, w = design([trace], decay=0.5, prior=0.6, shift=0)
    # recent before each chain from the chains' first rows (0.6, 0.8, 0.4), inside a chain
    # moved towards 1 per earlier token, as the policy does while drafting.
    assert x[:, -1] == pytest.approx([0.6, 0.8, 0.9, 0.8, 0.4])
    x, y, w = design([trace], decay=0.5, prior=0.6, shift=1)
    assert y.tolist() == [1.0, 0.0, 0.0, 1.0]
    # (depth 1 -> 2) accepted, (2 -> 3) accepted, (3 -> next chain) and (chain -> chain): out.
    assert w.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_chain_traces_round_trip_through_their_file(tmp_path):
    chains = AcceptanceTrace(
        "h",
        0.0,
        np.zeros((3, W - 2)),
        np.array([1.0, 0.0, 1.0]),
        np.ones((3, 2)),
        np.array([1, 2, 1]),
        tokens=np.array([7, 8]),  # the text: one token per chain (what repeats are read on)
    )
    plain = AcceptanceTrace(
        "d", 0.0, np.zeros((2, W - 2)), np.array([1.0, 1.0]), np.ones((2, 2)), tokens=np.ones(2)
    )
    path = tmp_path / "t.npz"
    save_traces(path, [chains, plain], UnionCounts(np.array([4.0]), np.array([1.0])), {})
    back, _, _ = load_traces(path)
    assert back[0].depth.tolist() == [1, 2, 1] and back[1].depth is None
    assert back[0].tokens.tolist() == [7, 8]
    # Slices of one array read once (each NpzFile access decompresses a whole new copy: 96
    # prompts x 3 temperatures of a head's chains held 288 copies and ran out of memory).
    assert back[0].hidden.base is back[1].hidden.base is not None
