"""EcoSpec's selection on the paper's Figure 3 example, the buffer update, and losslessness."""

from __future__ import annotations

import numpy as np

from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.ecospec import EcoSpecGlobalPolicy, EcoSpecPolicy, select_nodes
from pipeline.predictor.model import TokenExpertPredictor
from tests.test_engine import perturbed_pair


def test_figure_3_selects_t0_then_t2():
    # gamma = 2. t0 (a root child) covers {E1..E4}; t1 and t2 extend it. t1 has the higher
    # path probability (0.53) but adds three new experts; t2 (0.40) adds two: 0.53/3 = 0.177 <
    # 0.40/2 = 0.20, so the buffer-aware selection takes {t0, t2}.
    path_p = [0.9, 0.53, 0.40]
    footprints = [[{1, 2, 3, 4}], [{1, 2, 3, 4, 5, 6, 7}], [{1, 2, 3, 4, 5, 8}]]
    assert select_nodes(path_p, footprints, gamma=2, buffer=[set()]) == [0, 2]
    # Without the buffer (the global-cost ablation) t1 wins: 0.53/7 = 0.076 > 0.40/6 = 0.067.
    assert select_nodes(path_p, footprints, gamma=2, buffer=[set()], use_buffer=False) == [0, 1]


def test_buffer_update_changes_later_scores():
    # a and b are siblings with equal probability; c reuses a's experts. Once a is selected,
    # the buffer makes c (cost 0 new experts) beat b even though b is more probable.
    path_p = [0.5, 0.5, 0.3]
    footprints = [[{0, 1}], [{2, 3}], [{0, 1}]]
    order = select_nodes(path_p, footprints, gamma=3, buffer=[set()])
    assert order[0] in (0, 1)
    if order[0] == 0:
        assert order[1] == 2  # c is free after a
    # An initial buffer holding a's experts makes a and c free from the start.
    assert select_nodes(path_p, footprints, gamma=2, buffer=[{0, 1}]) == [0, 2]


def test_ecospec_policies_are_lossless_under_greedy_decoding():
    pair = perturbed_pair("mixtral", noise=0.3)
    rng = np.random.default_rng(1)
    samples = [(t, np.sort(rng.choice(8, (3, 2), replace=True), axis=1)) for t in range(256)]
    predictor = TokenExpertPredictor.fit(samples, num_experts=8, top_k=2)
    engine = SpeculativeEngine(pair)
    for policy in (EcoSpecPolicy(predictor), EcoSpecGlobalPolicy(predictor)):
        accepted = 0
        for prompt in ([5, 9, 2], [100, 3, 7, 7], [1, 2, 3, 4, 5, 6], [42, 42]):
            gen = engine.generate(prompt, policy, max_new_tokens=16, stop_at_eos=False)
            assert gen.tokens == greedy_continuation(pair.target, prompt, 16, eos_id=None)
            accepted += sum(s.accepted for s in gen.steps)
        assert accepted > 0, policy.name
