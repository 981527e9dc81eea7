"""Named option sets for :func:`gss.calibrate`: GSS as published, and our variant.

A variant is a plain dict of keyword arguments, so every component stays switchable::

    gss.calibrate(model, ref, texts, layer=1, **gss.variant("gss-tr"))
    gss.calibrate(model, ref, texts, layer=1, **{**gss.variant("gss-tr"), "gate": "none"})
"""

from __future__ import annotations

from typing import Any

from .errors import GSSError

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
    # GSS-TR (ours, not GSS as published): a strict memorized-token cut, a target that points
    # toward the reference's distribution (e_x - p_ref at the logits: it does not vanish when
    # the model is certain) and exact per-position gradients, with the paper's gate. Measured
    # on TinyMem (docs/gss-tr.md): gated beat ungated on math noise (10.9% vs 14.8% memorized)
    # and by far on math backdoor (10.0% vs 62.9% attack success), at matched accuracy.
    "gss-tr": {
        "omega_threshold": 1.0,
        "target": "toward-reference",
        "gradient": "per-position",
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
