"""Named option sets for :func:`gss.calibrate`: GSS as published, and our variant.

A variant is a plain dict of keyword arguments, so every component stays switchable::

    gss.calibrate(model, ref, texts, layer=1, **gss.variant("gss-tr"))
    gss.calibrate(model, ref, texts, layer=1, **{**gss.variant("gss-tr"), "gate": "none"})
"""

from __future__ import annotations

from typing import Any

from gss.errors import GSSError

VARIANTS: dict[str, dict[str, Any]] = {
    # The paper: omega > 0, log-likelihood gradient (one summed backward), hard gate at the
    # 95th percentile, projection coefficient. These are calibrate()'s defaults.
    "gss": {
        "omega_threshold": 0.0,
        "target": "loglik",
        "gradient": "summed",
        "gate": "hard",
        "threshold_percentile": 95.0,
        "coefficient": "projection",
    },
    # GSS-TR (ours, not GSS as published): the paper's calibration and gate with one change,
    # a target that points toward the reference's distribution (e_x - p_ref at the logits; the
    # log-likelihood gradient vanishes on tokens the model already predicts with p ~ 1, which
    # dominate the memorized set). Measured on TinyMem (docs/gss-tr.md), this change alone did
    # as well as adding a strict omega > 1 nat cut and exact per-position gradients (math
    # noise 11.3% vs 10.9% memorized, math backdoor 7.9% vs 10.0%, lang backdoor 0% for both)
    # at GSS's calibration cost, where per-position cost 16-40x. Both stay switchable:
    # ``{**gss.variant("gss-tr"), "omega_threshold": 1.0, "gradient": "per-position"}``.
    "gss-tr": {
        "omega_threshold": 0.0,
        "target": "toward-reference",
        "gradient": "summed",
        "gate": "hard",
        "threshold_percentile": 95.0,
        "coefficient": "projection",
    },
}


def variant(name: str) -> dict[str, Any]:
    """A copy of the keyword arguments of the named variant (``"gss"`` or ``"gss-tr"``)."""
    if name not in VARIANTS:
        raise GSSError(f"unknown variant {name!r}; known: {sorted(VARIANTS)}.")
    return dict(VARIANTS[name])
