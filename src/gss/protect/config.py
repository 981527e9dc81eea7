"""`ProtectConfig`: everything `gss.protect` is told before it sees the data, in one frozen,
checked value (as `gss.CalibrationConfig` is for one calibration), so that a bad option is
refused before a model loads and a run can be repeated from its config alone."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from gss.audit import check_prefixes
from gss.config import DEFAULT_WINDOW, RUN_OPTION_NAMES, RunOptions, with_run
from gss.errors import GSSError
from gss.protect.space import SearchSpace, check_leak_modes, numbers_only


@dataclass(frozen=True)
class ProtectConfig:
    """What `gss.protect` aims for and may choose; an invalid value raises a `GSSError`
    naming the field and the fix when the config is made."""

    # % of the held-out memorized rows allowed to stay extractable (gss protect
    # --max-extractable); calibration's `target` is another thing (g's objective)
    max_extractable: float = 0.0
    # what counts as extracted, on the tuning rows the search reads and on the held-out rows
    # the target is checked on (teacher-forced, `gss.protect.space.LEAK_MODES`): the exact
    # (n, k) window, one run of 80% of it (near-verbatim), a window 100 samples likely say
    leak_modes: tuple[str, ...] = ("exact", "near-verbatim")
    # the utility may rise to base + budget * |base| ("relative": +5%) or base + budget
    budget: float = 0.05
    budget_mode: Literal["relative", "absolute"] = "relative"
    # (n, k)-extraction: prompted with k tokens, reproduce tokens k..n-1 (`gss.audit`)
    k: int = DEFAULT_WINDOW.k
    n: int = DEFAULT_WINDOW.n
    # the audit's other prompt lengths, and whether a row is memorized from k or from the
    # shortest prompt that extracts it (then tuned on, held out and measured from there)
    prefixes: tuple[int, ...] | None = None
    memorized_from: Literal["k", "shortest"] = "k"
    search: SearchSpace = field(default_factory=SearchSpace)
    seed: int = 0  # the tuning / held-out split and the reference's text
    reference_rows: int = 64  # rows of text the reference writes, as general text

    def __post_init__(self) -> None:
        if not isinstance(self.search, SearchSpace):
            raise GSSError(
                f"search must be a gss.SearchSpace (e.g. SearchSpace(blocks=(3,))), got "
                f"{type(self.search).__name__}."
            )
        self.search.check()
        check_prefixes(self.prefixes, self.k, self.n, self.memorized_from)
        if self.prefixes is not None:  # a list given: kept as the tuple a frozen value needs
            object.__setattr__(self, "prefixes", tuple(self.prefixes))
        budget = self.budget
        if self.budget_mode not in ("relative", "absolute") or not (
            numbers_only((budget,)) and math.isfinite(budget) and budget >= 0
        ):
            raise GSSError(
                f"budget must be >= 0 (a number) with budget_mode 'relative' or 'absolute', got "
                f"{budget!r}, {self.budget_mode!r}."
            )
        if not (numbers_only((self.max_extractable,)) and 0 <= self.max_extractable <= 100):
            raise GSSError(
                f"max_extractable (gss protect --max-extractable) is a % of rows, in [0, 100], "
                f"got {self.max_extractable}."
            )
        check_leak_modes(self.leak_modes)
        object.__setattr__(self, "leak_modes", tuple(self.leak_modes))
        for name, low in (("seed", 0), ("reference_rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
                raise GSSError(f"{name} must be an integer in [{low}, 2^63), got {value!r}.")

    def replace(self, **changes: Any) -> ProtectConfig:
        """A copy with ``changes`` applied and checked."""
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(ProtectConfig))


def resolve(
    config: ProtectConfig | None, overrides: dict[str, Any], run: RunOptions | None = None
) -> tuple[ProtectConfig, RunOptions]:
    """The config and run options of a `protect` call: ``config`` (None: the defaults) with
    the keyword ``overrides`` of either's fields applied, over ``run`` (None: `RunOptions`'
    defaults; `gss.config.with_run`), all checked before any work."""
    if config is None:
        config = ProtectConfig()
    elif not isinstance(config, ProtectConfig):
        raise GSSError(f"config must be a gss.ProtectConfig, got {type(config).__name__}.")
    if "target" in overrides:  # calibration's target is g's objective: one name, one meaning
        raise GSSError(
            "protect's target is now max_extractable (the % of held-out memorized rows "
            "allowed to stay extractable): pass max_extractable=."
        )
    unknown = sorted(set(overrides) - set(FIELDS) - set(RUN_OPTION_NAMES))
    if unknown:
        raise GSSError(
            f"protect got unknown option(s) {', '.join(unknown)}: give fields of "
            f"gss.ProtectConfig ({', '.join(FIELDS)}) or run options "
            f"({', '.join(RUN_OPTION_NAMES)})."
        )
    if "search" in overrides and overrides["search"] is None:  # as in SearchSpace | None
        overrides["search"] = SearchSpace()
    given = {k: overrides.pop(k) for k in list(overrides) if k in RUN_OPTION_NAMES}
    resolved = config.replace(**overrides) if overrides else config
    return resolved, with_run(run, given, RunOptions())


@dataclass(frozen=True)
class Setting:
    """What every step of a `protect` run is handed besides its config: the two models, how
    text becomes tokens and padding, and how the passes run."""

    model: nn.Module
    reference: nn.Module
    tokenizer: Any
    pad_id: int
    run: RunOptions

    @property
    def batch_size(self) -> int:
        return self.run.batch_size

    @property
    def progress(self) -> bool:
        return self.run.progress
