"""Does an EAGLE-3 head fit a target? The check vLLM does not make.

A head reads the target's hidden states at three layers (``eagle_aux_hidden_state_layer_ids``,
or vLLM's default for the target: the residual streams entering layers 2, L // 2 and L - 3) and
predicts over the target's vocabulary. vLLM checks neither the feature width nor the verifier,
so a mismatched head fails at the first draft with a shape error, or drafts nonsense;
``bind_to_target`` refuses it before any weight is read, naming every problem.
"""

from __future__ import annotations

from pipeline.models.eagle3 import Eagle3Config


class VerifierMismatchError(ValueError):
    """The head was trained for another target: its features or vocabulary do not fit."""



def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice for a target that names none: the residual streams entering layers 2,
    L/2 and L-3, de-duplicated (a shallow target gives fewer than three)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def _target_architectures(target_config) -> tuple[str, ...]:
    return tuple(getattr(target_config, "architectures", None) or ())


def bind_to_target(cfg: Eagle3Config, target_config) -> Eagle3Config:
    """``cfg`` with its tapped layers resolved for ``target_config``; VerifierMismatchError
    when the head cannot read this target (feature width, vocabulary, layers, architecture)."""
    hidden = target_config.hidden_size
    layers = target_config.num_hidden_layers
    problems = []
    if cfg.target_hidden_size != hidden:
        problems.append(
            f"it reads target hidden states of width {cfg.target_hidden_size}, "
            f"the target's are {hidden}"
        )
    if cfg.vocab_size != target_config.vocab_size:
        problems.append(
            f"its vocabulary has {cfg.vocab_size} ids, the target's {target_config.vocab_size}"
        )
    ids = cfg.aux_layer_ids or default_aux_layer_ids(layers)
    if len(ids) != 3:
        problems.append(
            f"vLLM's default layers for a {layers}-layer target are {list(ids)}, not three: "
            "the head's config must name eagle_aux_hidden_state_layer_ids"
        )
    # Id L is the last layer's output before the final norm (vLLM's convention).
    if not all(0 <= i <= layers for i in ids):
        problems.append(f"it taps layers {list(ids)}, the target has {layers}")
    archs = _target_architectures(target_config)
    if cfg.verifier_architectures and archs and not set(cfg.verifier_architectures) & set(archs):
        problems.append(
            f"its verifier is a {'/'.join(cfg.verifier_architectures)}, "
            f"the target a {'/'.join(archs)}"
        )
    if problems:
        trained = f" (trained for {cfg.verifier_name})" if cfg.verifier_name else ""
        raise VerifierMismatchError(
            f"the EAGLE-3 head{trained} does not fit this target: " + "; ".join(problems)
        )
    return Eagle3Config(**{**cfg.__dict__, "aux_layer_ids": tuple(ids)})
