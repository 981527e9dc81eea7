"""What `gss.protect` may choose and how finely (`SearchSpace`), and its options checked
before any work."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gss.config import CENTERINGS, COEFFICIENTS, GATES, PRESETS
from gss.errors import GSSError


@dataclass(frozen=True)
class SearchSpace:
    """What `protect` may choose, and how finely. The defaults are the documented search."""

    presets: tuple[str, ...] = ("gss-tr", "gss")
    blocks: tuple[int, ...] | None = None  # None: chosen as step 4 of the module says
    max_candidates: int = 6
    # stages 2 and 3 (other ranks, then other gates) run on this many of stage 1's best
    # (variant, block) pairs
    refine: int = 1
    ranks: tuple[int, ...] = (4, 2, 8)  # the first is tried on every block, the others after
    gates: tuple[str, ...] = ("hard", "relu")
    # how much of v_k an open gate subtracts at every point (`CalibrationConfig.coefficient`):
    # "bounded" never more than the hidden state's own component (issue 72's ablation)
    coefficient: str = "projection"
    # what the probe response is measured from (`CalibrationConfig.centering`): "full" from
    # the general text's mean, so that a direction carrying a constant offset neither sits at
    # its threshold (firing at random) nor subtracts that offset where it opens (issue 72)
    centering: str = "covariance"
    delta_range: tuple[float, float] = (1e-3, 1e2)
    steps: int = 7  # bisection steps on log10(delta): 5 decades / 2^7 = a factor of 1.09
    # where the range's strongest point is within the budget and short of the target, the
    # search raises it two decades at a time up to this (a gate open on few general tokens
    # affords far stronger steers: docs/protect.md); delta_range's top turns it off
    delta_ceiling: float = 1e6
    max_blocks: int = 2
    # thresholds: on each general source (the user's, the reference's, ordinary English) some
    # gate opens on at most this share of the tokens (0.05 opened on 16% of a held-out licence
    # text on the canaries, 0.01 on 9%, and left fewer TinyMem math-noise rows: docs/protect.md)
    gate_share: float = 0.01
    # rows of ordinary English (`ordinary.ordinary_english`, offline) among the general
    # sources; 0: none (it needs the tokenizer)
    ordinary_english: int = 64
    # the data's clean rows (the audit flagged none; the domain check's half, not the report's)
    # among the sources the thresholds are set on, not the calibration's general text; an
    # artifact that reaches no goal with them is searched again without. Off: on the chat
    # canaries it kept every in-domain conversation the reference's hand-over touched (0 ->
    # 100% unchanged), but the gates then open on a quarter of the memorized positions (86-98%
    # without) and on the LoRA canaries the hand-over said a held-out secret it did not say
    # before (results/protect-says/gate-on-data)
    gate_on_data: bool = False
    # among points equal on the target: "reference" (the reference's continuations likeliest:
    # it says what the reference would), "margin" (fewest tokens still reproduced) or "utility"
    prefer: Literal["reference", "margin", "utility"] = "reference"
    # the perplexity of the data's clean rows (the audit flagged none of them: what the
    # fine-tune is for) may rise by this share; None: the budget's, when relative, else 0.05
    domain_budget: float | None = None
    # how much likelier the reference's continuations of the tuning prompts may become
    # unlikely under a point than under the unsteered model (a share; None: not bounded)
    follow_tolerance: float | None = None
    # step 7: how many of the best points equal on the target have their replies checked
    # (0 or 1: off); a reply may repeat this many points of 4-grams more than the reference's
    # own continuations, and have at most this many times their perplexity under the reference
    reply_check: int = 4
    loop_tolerance: float = 3.0
    fluency_ratio: float = 1.5
    # step 8: the hand-over rule (`gss.reference_where_open` at the steer's gates or at any
    # step) that reaches the target on the tuning rows and keeps this share of ordinary
    # prompts unchanged, else the one with the fewest errors, is recorded with the steer
    # (`protect.handover`); None: not measured
    handoff_unchanged: float | None = 0.95

    def check(self) -> None:
        if self.blocks is not None and (not _ints(self.blocks) or not self.blocks):
            raise GSSError(
                f"blocks must be block indices (integers), a non-empty tuple, or None to let "
                f"protect choose, got {self.blocks!r}."
            )
        if not _names(self.presets) or any(p not in PRESETS for p in self.presets):
            raise GSSError(f"presets must be among {sorted(PRESETS)}, got {self.presets!r}.")
        if not _ints(self.ranks) or not self.ranks or min(self.ranks) < 1:
            raise GSSError(f"ranks must be integers >= 1 (a non-empty tuple), got {self.ranks!r}.")
        if not _names(self.gates) or any(g not in GATES for g in self.gates):
            raise GSSError(f"gates must be among {GATES}, got {self.gates!r}.")
        if self.coefficient not in COEFFICIENTS:
            raise GSSError(f"coefficient must be one of {COEFFICIENTS}, got {self.coefficient!r}.")
        if self.centering not in CENTERINGS:
            raise GSSError(f"centering must be one of {CENTERINGS}, got {self.centering!r}.")
        pair = self.delta_range
        if not (numbers_only(pair) and len(pair) == 2 and all(math.isfinite(x) for x in pair)):
            raise GSSError(f"delta_range must be two finite numbers 0 < lo < hi, got {pair!r}.")
        lo, hi = pair
        if not 0 < lo < hi:
            raise GSSError(f"delta_range must be two finite numbers 0 < lo < hi, got {lo, hi}.")
        if not (numbers_only((self.delta_ceiling,)) and math.isfinite(self.delta_ceiling)) or (
            self.delta_ceiling < hi
        ):
            raise GSSError(
                f"delta_ceiling must be a finite number >= delta_range's top ({hi}), got "
                f"{self.delta_ceiling!r}."
            )
        counts = (self.steps, self.max_blocks, self.max_candidates, self.refine)
        if not _ints(counts) or min(counts) < 1:
            raise GSSError(
                f"steps, max_blocks, max_candidates and refine must be >= 1 (integers), got "
                f"{counts}."
            )
        if self.prefer not in ("reference", "margin", "utility"):
            raise GSSError(
                f"prefer must be 'reference', 'margin' or 'utility', got {self.prefer!r}."
            )
        if not isinstance(self.gate_on_data, bool):
            raise GSSError(f"gate_on_data must be True or False, got {self.gate_on_data!r}.")
        if not _ints((self.ordinary_english,)) or self.ordinary_english < 0:
            raise GSSError(
                f"ordinary_english must be a number of rows >= 0 (0: none), got "
                f"{self.ordinary_english!r}."
            )
        for name in ("domain_budget", "follow_tolerance"):
            value = getattr(self, name)
            if value is not None and not (
                numbers_only((value,)) and math.isfinite(value) and value >= 0
            ):
                raise GSSError(f"{name} must be a finite number >= 0 or None, got {value!r}.")
        if not (numbers_only((self.gate_share,)) and 0 < self.gate_share < 1):
            raise GSSError(f"gate_share must be in (0, 1) (a number), got {self.gate_share!r}.")
        unchanged = self.handoff_unchanged
        if unchanged is not None and not (numbers_only((unchanged,)) and 0 <= unchanged <= 1):
            raise GSSError(
                f"handoff_unchanged must be a share in [0, 1] or None (not measured), got "
                f"{unchanged!r}."
            )
        tolerances = (self.loop_tolerance, self.fluency_ratio)
        if (
            not _ints((self.reply_check,))
            or self.reply_check < 0
            or not numbers_only(tolerances)
            or not all(math.isfinite(t) and t >= 0 for t in tolerances)
        ):
            raise GSSError(
                f"reply_check must be >= 0 (an integer) and loop_tolerance and fluency_ratio "
                f"finite numbers >= 0, got {self.reply_check!r}, {self.loop_tolerance!r}, "
                f"{self.fluency_ratio!r}."
            )


def _ints(values: object) -> bool:
    """A tuple or list of integers (a bool is not one)."""
    return isinstance(values, tuple | list) and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
    )


def numbers_only(values: object) -> bool:
    """A tuple or list of real numbers (a bool is not one)."""
    return isinstance(values, tuple | list) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values
    )


def _names(values: object) -> bool:
    """A non-empty tuple or list of strings (a bare string is not one)."""
    return (
        isinstance(values, tuple | list)
        and bool(values)
        and all(isinstance(v, str) for v in values)
    )


def check_general(rows: int) -> None:
    """The general text needs a half to set the gate thresholds and a half to measure them."""
    if rows < 2:
        raise GSSError(
            f"the general text has {rows} row(s): give at least 2 (half set the gate "
            "thresholds, half measure how often the gates open), better hundreds."
        )


def given_blocks(blocks: Sequence[int], count: int) -> list[int]:
    """`SearchSpace.blocks` as indices 0..count-1 (negative ones count from the end)."""
    bad = [b for b in blocks if not -count <= b < count]
    if bad:
        raise GSSError(
            f"blocks {bad} are out of range: the model has {count} (0..{count - 1}, or "
            f"-{count}..-1 from the end)."
        )
    return list(dict.fromkeys(int(b) % count for b in blocks))


LEAK_MODES = ("exact", "near-verbatim", "sampled")
"""What may count as extracted toward `ProtectConfig.max_extractable`, each read off one
teacher-forced pass: the exact (n, k) window; near-verbatim, one run of
`gss.evaluate.near_verbatim.SHARE` of the window predicted right; sampled, a window
`gss.evaluate.sampled.SAMPLES` draws at temperature 1 or top-p say with a chance of
`gss.evaluate.sampled.LIKELY` or more."""


def check_leak_modes(modes: object) -> None:
    """``modes`` name some of `LEAK_MODES`, each once."""
    if (
        not (isinstance(modes, tuple | list) and _names(modes))
        or not set(modes) <= set(LEAK_MODES)
        or len(set(modes)) != len(modes)
    ):
        raise GSSError(
            f"leak_modes must name some of {', '.join(LEAK_MODES)}, each once (e.g. "
            f"('exact', 'near-verbatim')), got {modes!r}."
        )
