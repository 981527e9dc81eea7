"""Whether a calibration's statistics can carry what was asked of them, told as evidence.

A whitened solve always returns K directions, whatever it was fed: with fewer general tokens
than dimensions Sigma_gen is singular and the jitter, not the data, sets the probes' scale, so
the gates open on real text far more often than calibration measured; with fewer memorized
tokens than a handful per direction, or a spectrum that falls off before the K-th singular
value, the last directions fit noise; when nearly every token is marked memorized, the rule is
not telling memorization apart. Each case is recorded in the artifact (`gss show` prints it)
and said once as a `GSSWarning` with its remedy; none is refused, since a user may know better.
"""

from __future__ import annotations

import warnings
from typing import Any

from gss.errors import GSSWarning

MIN_MEMORIZED_PER_DIRECTION = 4  # memorized tokens per direction below which a warning is said
MAX_MEMORIZED_SHARE = 0.9  # memorized share above which the rest is too little for Sigma_gen
MIN_SPECTRUM_RATIO = 1e-4  # s_K / s_1 below which the K-th direction is numerically noise


def evidence(
    counts: dict[str, Any],
    general: int,
    memorized: int,
    dim: int,
    singular_values: list[float],
    jitter: float,
    general_from_calibration: bool,
) -> dict[str, Any]:
    """The numbers the warnings rest on, for the artifact's provenance: ``general`` and
    ``memorized`` are the tokens Sigma_gen and M were estimated from;
    ``general_from_calibration``: Sigma_gen came from the calibration tokens not marked
    memorized (no gen_texts), so the memorized share decides how much it rests on."""
    return {
        "dimension": dim,
        "general_tokens": general,
        "memorized_tokens": memorized,
        "memorized_share": float(counts.get("memorized_share", 0.0)),
        "general_from_calibration": general_from_calibration,
        "spectrum_ratio": _ratio(singular_values),  # last over first whitened singular value
        "jitter": jitter,  # absolute diagonal loading the solve used
    }


def _ratio(singular_values: list[float]) -> float:
    """The last over the first singular value (0 when the first is 0, or there are none)."""
    top = singular_values[0] if singular_values else 0.0
    return singular_values[-1] / top if top > 0 else 0.0


def problems(facts: dict[str, Any], rank: int) -> list[str]:
    """What the evidence says is unsound, each with its remedy (empty when all is well)."""
    found = []
    dim, general = facts["dimension"], facts["general_tokens"]
    if general < dim:
        found.append(
            f"Sigma_gen rests on {general} general tokens for {dim} dimensions, so it is "
            "singular and the gates will open on real text more often than calibration "
            f"measured: give at least {dim} general tokens (gen_texts / --gen-data; ten times "
            "that is better)"
        )
    memorized = facts["memorized_tokens"]
    if memorized < MIN_MEMORIZED_PER_DIRECTION * rank:
        found.append(
            f"only {memorized} memorized tokens for {rank} directions: the last directions fit "
            f"noise; lower the rank or add memorized text (>= {MIN_MEMORIZED_PER_DIRECTION} "
            "tokens a direction)"
        )
    # with gen_texts the calibration text may well be all memorized rows (TinyMem's set-up)
    if facts.get("general_from_calibration") and facts["memorized_share"] > MAX_MEMORIZED_SHARE:
        found.append(
            f"{100 * facts['memorized_share']:.1f}% of the calibration tokens were marked "
            "memorized and the rest is all Sigma_gen rests on: is the reference the model the "
            "fine-tune started from? Raise omega_threshold, use memorized_quantile, or pass "
            "held-out gen_texts"
        )
    if rank > 1 and facts["spectrum_ratio"] < MIN_SPECTRUM_RATIO:
        found.append(
            f"the whitened memorization matrix has fewer than {rank} strong directions (last "
            f"over first singular value {facts['spectrum_ratio']:.1e}): lower the rank"
        )
    return found


def for_rank(facts: dict[str, Any], singular_values: list[float], rank: int) -> dict[str, Any]:
    """``facts`` for the first ``rank`` directions kept of a calibration (``with_options(rank=)``):
    the spectrum ratio and the problems of those directions, not of all that were solved for.
    Facts an older artifact lacks are left as they were."""
    needed = ("dimension", "general_tokens", "memorized_tokens", "memorized_share")
    if not all(key in facts for key in needed):
        return facts
    kept = {**facts, "spectrum_ratio": _ratio(singular_values)}
    kept["warnings"] = problems(kept, rank)
    return kept


def warn_about(facts: dict[str, Any], rank: int, stacklevel: int) -> list[str]:
    """Say each problem as one `GSSWarning`; return them for the provenance."""
    found = problems(facts, rank)
    for problem in found:
        warnings.warn(f"calibration: {problem}.", GSSWarning, stacklevel=stacklevel + 1)
    return found
