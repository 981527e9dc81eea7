"""What a calibration means, in one typed object: `CalibrationConfig`, its presets, its checks.

Every option that changes the artifact lives here once, with its type, default and help string;
`gss.calibrate` takes a config (or a preset's name) plus keyword overrides of its fields, the
CLI builds its flags from the fields, and the artifact saves the config beside its tensors.
How a calibration runs (batch size, progress bars, the hidden states kept in memory) does not
change what it computes and lives apart, in `RunOptions`, never saved.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

from gss.errors import GSSError

Gate = Literal["hard", "relu", "none", "discriminant"]
Coefficient = Literal["projection", "ridge", "paper-constant", "bounded"]
Centering = Literal["covariance", "full", "none"]
Target = Literal["loglik", "toward-reference"]
Gradient = Literal["summed", "per-position"]
SolveMethod = Literal["auto", "full", "truncated"]
# where `gss.reference_where_open` may hand a step over: the steer's gates, or any step
HandoffGates = Literal["steer", "none"]

GATES: tuple[str, ...] = get_args(Gate)
COEFFICIENTS: tuple[str, ...] = get_args(Coefficient)
CENTERINGS: tuple[str, ...] = get_args(Centering)
TARGETS: tuple[str, ...] = get_args(Target)
GRADIENTS: tuple[str, ...] = get_args(Gradient)
SOLVE_METHODS: tuple[str, ...] = get_args(SolveMethod)
HANDOFF_GATES: tuple[str, ...] = get_args(HandoffGates)

# General tokens' probe responses kept (a uniform sample) to set the thresholds: the 95th
# percentile of 65,536 samples has a standard error of 0.09 percentile points, and the
# sample's memory (K floats a row) stays fixed however large the corpus.
THRESHOLD_SAMPLES = 2**16


def _about(help: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's help string (the CLI's too) and, for a Literal, its allowed values."""
    return {"help": help, "choices": choices}


@dataclass(frozen=True)
class CalibrationConfig:
    """Every option of a calibration that changes the artifact it makes.

    Build one from a preset and change fields with keywords (`preset`, `replace`); an invalid
    value raises a `GSSError` naming the field and the fix when the config is made.
    """

    layer: int | None = field(
        default=None,
        metadata=_about("0-based decoder block read and steered (negative: from the end)"),
    )
    rank: int = field(default=4, metadata=_about("number of probe/steer directions K"))
    delta: float = field(
        default=1.0,
        metadata=_about("variance budget of each probe on general tokens: the strength"),
    )
    threshold_percentile: float = field(
        default=95.0,
        metadata=_about(
            "each gate opens above this percentile of |probe response| on general tokens"
        ),
    )
    gate_share: float | None = field(
        default=None,
        metadata=_about(
            "instead: one level at which the union of gates opens on this share of general tokens"
        ),
    )
    omega_threshold: float = field(
        default=0.0, metadata=_about("tokens with omega above this (nats) are memorized")
    )
    memorized_quantile: float | None = field(
        default=None, metadata=_about("instead: this top share of tokens by omega is memorized")
    )
    replies_only: bool = field(
        default=False,
        metadata=_about(
            "only the replies (assistant messages, completions) can be memorized: for a "
            "fine-tune trained on them alone"
        ),
    )
    gate: Gate = field(
        default="hard",
        metadata=_about(
            "hard: |s| > eps (main text); relu: one-sided (appendix); none: ungated; "
            "discriminant: every direction opens where one condition direction (memorized vs "
            "general tokens' discriminant) passes its threshold",
            GATES,
        ),
    )
    coefficient: Coefficient = field(
        default="projection",
        metadata=_about(
            "how much of v_k an open gate subtracts: projection, or bounded (never more than "
            "the state's own component); ridge and paper-constant are the paper's ablations, "
            "used by no preset or search (docs/method.md)",
            COEFFICIENTS,
        ),
    )
    ridge_delta: float | None = field(
        default=None,
        metadata=_about(
            "the ridge coefficient's regulariser (default: delta; a paper ablation's option)"
        ),
    )
    centering: Centering = field(
        default="covariance",
        metadata=_about("what the general-token mean is removed from (docs/method.md)", CENTERINGS),
    )
    target: Target = field(
        default="loglik",
        metadata=_about(
            "g's objective: the memorized token's log-likelihood (the paper) or a step toward "
            "the reference's prediction (GSS-TR)",
            TARGETS,
        ),
    )
    gradient: Gradient = field(
        default="summed",
        metadata=_about(
            "g: gradient of the sequence's summed target, or of each token's own", GRADIENTS
        ),
    )
    solve_method: SolveMethod = field(
        default="auto",
        metadata=_about(
            "SVD of the whitened M: auto takes the randomized one iterated to convergence when "
            "d >= 1024 and K <= d/8, else the full one",
            SOLVE_METHODS,
        ),
    )
    jitter: float = field(
        default=1e-6, metadata=_about("diagonal loading of Sigma_gen in the solve (relative)")
    )
    max_length: int | None = field(
        default=None, metadata=_about("tokens per calibration row (longer rows are cut)")
    )
    block_path: str | None = field(
        default=None,
        metadata=_about("dotted path of the decoder-block list, for models gss cannot read"),
    )
    max_threshold_samples: int = field(
        default=THRESHOLD_SAMPLES,
        metadata=_about("general-token probe responses sampled to set the thresholds"),
    )
    seed: int = field(
        default=0, metadata=_about("seed of the randomized solve and of the threshold sample")
    )

    def __post_init__(self) -> None:
        # NumPy's and torch's scalars (np.int64(2) from an arange, say) as Python's: the
        # config is saved as JSON, and checked as Python numbers
        for name, kind in _NUMERIC_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, (bool, str, int, float)):
                continue
            if kind is numbers.Integral and isinstance(value, numbers.Integral):
                object.__setattr__(self, name, int(value))
            elif kind is numbers.Real and isinstance(value, numbers.Real):
                object.__setattr__(self, name, float(value))
        check_config(self)

    def replace(self, **changes: Any) -> CalibrationConfig:
        """A copy with ``changes`` applied (checked); unknown names are refused."""
        unknown = sorted(set(changes) - set(field_names()))
        if unknown:
            raise GSSError(
                f"unknown calibration option(s) {unknown}; known: {', '.join(field_names())}."
            )
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CalibrationConfig:
        """The config saved by `to_dict`; unknown keys are refused, not dropped."""
        return cls().replace(**values)


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(CalibrationConfig))


def _finite(name: str, value: Any, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GSSError(f"{name} must be a finite number, got {value!r}: {fix}.")
    return float(value)


def _number_kind(hint: Any) -> type | None:
    """`numbers.Integral` for an int field (``int | None`` too), `numbers.Real` for a float."""
    kinds = set(get_args(hint)) or {hint}
    return numbers.Integral if int in kinds else numbers.Real if float in kinds else None


# every numeric field, and the kind of number it holds (read from the type hints)
_NUMERIC_FIELDS: dict[str, type] = {
    name: kind
    for name, hint in get_type_hints(CalibrationConfig).items()
    if (kind := _number_kind(hint)) is not None
}


def _integer(name: str, value: Any, low: int | None, fix: str) -> None:
    """Refuse a non-integer ``value`` of field ``name``, or one below ``low`` (None: any)."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        at_least = "" if low is None else f" >= {low}"
        raise GSSError(f"{name} must be an integer{at_least}, got {value!r}: {fix}.")


# options that replace another's rule: given together, one would be silently ignored
INSTEAD_OF = {"gate_share": "threshold_percentile", "memorized_quantile": "omega_threshold"}
MAX_LENGTH = 2**31 - 1  # tokens: more than any context, and what a tokenizer's integers hold
MAX_DELTA = 1e12  # the strongest delta a steer takes (gss protect's search goes to 1e6)


def check_config(c: CalibrationConfig) -> None:
    """Refuse a value no calibration can run with, naming the field and the fix."""
    for f in dataclasses.fields(c):
        choices = f.metadata.get("choices")
        value = getattr(c, f.name)
        if choices and value not in choices:
            raise GSSError(f"{f.name} must be one of {choices}, got {value!r}.")
    if c.layer is not None:
        _integer("layer", c.layer, None, "pass a block index such as 2 or -1")
    _integer("rank", c.rank, 1, "ask for at least one direction")
    if not _finite("delta", c.delta, "pass a positive strength such as 1.0") > 0:
        raise GSSError(f"delta must be > 0, got {c.delta!r}: pass a positive strength such as 1.0.")
    pct = _finite("threshold_percentile", c.threshold_percentile, "e.g. 95")
    if not 0 < pct < 100:
        raise GSSError(f"threshold_percentile must be in (0, 100), got {pct}: e.g. 95.")
    if c.gate_share is not None and not 0 < _finite("gate_share", c.gate_share, "e.g. 0.05") < 1:
        raise GSSError(f"gate_share must be in (0, 1), got {c.gate_share}: e.g. 0.05.")
    _finite("omega_threshold", c.omega_threshold, "0 is the paper's rule")
    q = c.memorized_quantile
    if q is not None and not 0 < _finite("memorized_quantile", q, "e.g. 0.05") < 1:
        raise GSSError(f"memorized_quantile must be in (0, 1), got {q}: e.g. 0.05.")
    defaults = CalibrationConfig.__dataclass_fields__
    for name, other in INSTEAD_OF.items():  # the other's value would be silently ignored
        if getattr(c, name) is not None and getattr(c, other) != defaults[other].default:
            raise GSSError(
                f"{name} replaces {other}'s rule, and both were set ({name}="
                f"{getattr(c, name)!r}, {other}={getattr(c, other)!r}): keep one."
            )
    if not _finite("delta", c.delta, "") <= MAX_DELTA:
        raise GSSError(
            f"delta must be at most {MAX_DELTA:g}, got {c.delta!r}: the probe scales with "
            "sqrt(delta), and past this the steer's values leave float range. gss protect "
            "searches up to 1e6."
        )
    rd = c.ridge_delta
    if rd is not None and not _finite("ridge_delta", rd, "or leave it None (delta)") > 0:
        raise GSSError(f"ridge_delta must be > 0, got {rd}: or leave it None (delta).")
    if not _finite("jitter", c.jitter, "e.g. 1e-6") >= 0:
        raise GSSError(f"jitter must be >= 0, got {c.jitter}: e.g. 1e-6.")
    if c.max_length is not None:
        _integer("max_length", c.max_length, 2, "or leave it None (the model's context)")
        if c.max_length > MAX_LENGTH:  # a tokenizer's integers overflow past 2^31
            raise GSSError(
                f"max_length must be at most {MAX_LENGTH} tokens, got {c.max_length}: leave it "
                "None for the model's context."
            )
    _integer("max_threshold_samples", c.max_threshold_samples, 1, "e.g. 65536")
    _integer("seed", c.seed, 0, "any non-negative integer")
    if c.seed >= 2**63:
        raise GSSError(f"seed must be below 2^63, got {c.seed}: any smaller non-negative integer.")
    if not isinstance(c.replies_only, bool):
        raise GSSError(f"replies_only must be True or False, got {c.replies_only!r}.")
    if c.block_path is not None and not isinstance(c.block_path, str):
        raise GSSError(f"block_path must be a dotted path string, got {c.block_path!r}.")


# Named configs. "gss" is the paper as published: omega > 0, log-likelihood gradient (one
# summed backward), hard gate at the 95th percentile, projection coefficient; it is also what
# CalibrationConfig() holds. "gss-tr" (ours, not GSS as published) changes one thing: a target
# that points toward the reference's distribution (e_x - p_ref at the logits; the
# log-likelihood gradient vanishes on tokens the model already predicts with p ~ 1, which
# dominate the memorized set). Measured on TinyMem (docs/gss-tr.md), this change alone did as
# well as adding a strict omega > 1 nat cut and exact per-position gradients at GSS's
# calibration cost, where per-position cost 16-40x.
PRESETS: dict[str, CalibrationConfig] = {
    "gss": CalibrationConfig(),
    "gss-tr": CalibrationConfig(target="toward-reference"),
}
# What `calibrate`, `scan_layers` and `gss calibrate` use when no config is named: the preset
# that measured best on every benchmark (TinyMem's four settings, the canaries; docs/gss-tr.md).
# "gss" stays the paper's method, by name.
DEFAULT_PRESET = "gss-tr"


def preset(name: str, **changes: Any) -> CalibrationConfig:
    """The named config (``"gss"``: the paper; ``"gss-tr"``: ours), with ``changes``."""
    if name not in PRESETS:
        raise GSSError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}.")
    return PRESETS[name].replace(**changes)


@dataclass(frozen=True)
class RunOptions:
    """How a run goes, not what it computes: never saved with the artifact. Every entry point
    (`calibrate`, `scan_layers`, `audit`, `protect`, `gss.evaluate`'s) takes one as ``run=``,
    or its fields as keywords (`run_options`); the defaults here are calibration's."""

    batch_size: int = field(default=8, metadata=_about("rows per forward pass"))
    progress: bool = field(default=True, metadata=_about("progress bars on stderr"))
    keep_general: int | None = field(
        default=None,
        metadata=_about(
            "general tokens whose hidden states are kept so the thresholds need no second "
            "pass (default: as many as fit in 2^24 floats; 0: always a second pass)"
        ),
    )

    def __post_init__(self) -> None:
        _integer("batch_size", self.batch_size, 1, "e.g. 8")
        if not isinstance(self.progress, bool):  # "no" would be read as True
            raise GSSError(f"progress must be True or False, got {self.progress!r}.")
        if self.keep_general is not None:
            _integer("keep_general", self.keep_general, 0, "or leave it None")


RUN_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(RunOptions))

# Rows per batch of the entry points whose passes are not calibration's (whose default is
# `RunOptions.batch_size`: two models' forwards, one of them with gradients). Each is the
# default those functions always had, written here once: the rows batched together change a
# result's last bits in float, so a default batch size is part of the result and is kept.
EVALUATION_BATCH_SIZE = 16
"""Decoding and held-out perplexity over evaluation rows on a real model (`evaluate_model`,
`evaluate_steering`, `steering_sweep`, `other_prompts`, `secrets_said`, the text protect has
the reference write): rows of up to 512 tokens, one model, no gradients."""
METRIC_BATCH_SIZE = 64
"""The metric functions of `gss.evaluate` (`perplexity`, `token_accuracy`, `nk_memorization`,
`backdoor_success`, `exposure`, greedy decoding, teacher-forced matching), written for
TinyMem's small models and short rows, where a larger batch costs little."""


def run_options(
    run: RunOptions | None,
    batch_size: int | None = None,
    progress: bool | None = None,
    *,
    batch_default: int = RunOptions.batch_size,
    progress_default: bool = RunOptions.progress,
) -> RunOptions:
    """How an entry point runs: ``run`` (a `RunOptions`) when given, else the entry point's
    own defaults (``batch_default``, ``progress_default``), with the keywords ``batch_size`` and
    ``progress`` (None: not given) applied. A keyword that contradicts ``run`` is refused."""
    given = {
        name: value
        for name, value in (("batch_size", batch_size), ("progress", progress))
        if value is not None
    }
    return with_run(run, given, RunOptions(batch_default, progress_default))


def with_run(run: RunOptions | None, given: dict[str, Any], default: RunOptions) -> RunOptions:
    """``run`` (None: ``default``) with the run options ``given`` as keywords, all checked; a
    keyword that says otherwise than ``run`` is refused, naming both."""
    if run is None:
        return dataclasses.replace(default, **given)
    if not isinstance(run, RunOptions):
        raise GSSError(
            f"run must be a gss.RunOptions (e.g. gss.RunOptions(batch_size=4)), got "
            f"{type(run).__name__}."
        )
    dataclasses.replace(run, **given)  # checks the keywords' values
    clash = [name for name, value in given.items() if getattr(run, name) != value]
    if clash:
        said = ", ".join(f"{name}={given[name]!r}" for name in clash)
        held = ", ".join(f"{name}={getattr(run, name)!r}" for name in clash)
        raise GSSError(
            f"{said} contradicts run=RunOptions({held}): give each run option once, in run= "
            "or as a keyword."
        )
    return run


@dataclass(frozen=True)
class Window:
    """The (n, k)-extraction window: a row is prompted with its first ``k`` tokens and must
    reproduce tokens ``k..n-1``. The defaults are the paper's definition for long rows (as on
    Pythia: n = 72, k = 32); `gss.audit`, `gss.evaluate`, `gss.protect` and the CLI's ``--k``
    / ``--n`` read them from here, so they are written once."""

    k: int = field(default=32, metadata=_about("prompt tokens"))
    n: int = field(default=72, metadata=_about("match tokens k..n-1"))

    def __post_init__(self) -> None:
        for name in ("k", "n"):  # NumPy's and torch's integers as Python's, as in the config
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise GSSError(
                f"k must be an integer >= 1, got {self.k!r}: the prompt is a row's first k "
                "tokens (--k), at least one."
            )
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n <= self.k:
            raise GSSError(
                f"n must be an integer > k = {self.k}, got {self.n!r}: tokens k..n-1 are "
                "matched, so raise n (--n) above k or lower k (--k)."
            )


DEFAULT_WINDOW = Window()
"""The window every k / n default reads (`Window`'s defaults, written there once)."""


def resolve(
    config: CalibrationConfig | str | None,
    overrides: dict[str, Any],
    run: RunOptions | None = None,
) -> tuple[CalibrationConfig, RunOptions]:
    """The config and run options of a call: ``config`` (or a preset name; None:
    `DEFAULT_PRESET`) with the keyword ``overrides`` of either's fields applied, over ``run``
    (None: `RunOptions`' defaults; `with_run`), all checked before any work."""
    if config is None:
        config = DEFAULT_PRESET
    if isinstance(config, str):
        config = preset(config)
    elif not isinstance(config, CalibrationConfig):
        raise GSSError(
            f"config must be a CalibrationConfig or a preset name ({', '.join(PRESETS)}), got "
            f"{type(config).__name__}."
        )
    given = {k: overrides.pop(k) for k in list(overrides) if k in RUN_OPTION_NAMES}
    for name, other in INSTEAD_OF.items():  # one of the two would be silently ignored
        if name in overrides and other in overrides:
            raise GSSError(f"{name} replaces {other}'s rule, and both were given: keep one.")
    resolved = config.replace(**overrides)
    if "ridge_delta" in overrides and resolved.coefficient != "ridge":
        raise GSSError(
            "ridge_delta sets the ridge coefficient's regulariser: give coefficient='ridge' "
            "with it, or leave it out."
        )
    return resolved, with_run(run, given, RunOptions())
