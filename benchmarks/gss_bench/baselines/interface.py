"""One interface for every mitigation baseline, so the benchmark runs them all the same way.

A method takes the memorized model, the memorized (unlearn) set, a clean (retain) set and its
hyperparameters, and returns a :class:`Mitigation`: the model to evaluate (an edited *copy*, or
the original with a hook attached) and the method's own wall time. The original model is never
modified. Methods are registered by name with a small default grid, mildest setting first.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gss.errors import GSSError
from gss.steering.attach import SteerHandle

Rows = Sequence[Sequence[int]]


@dataclass(frozen=True)
class MitigationData:
    """What a baseline may use besides the model.

    - `memorized`: the unlearn set U, the training rows the model reproduces (token ids).
    - `clean`: the retain set C, clean rows of the training distribution.
    - `clean_twins`: the clean versions of the rows of U, same order (noise settings), or empty.
    - `prompt_len`: tokens of each row of U given as the prompt; methods that score only the
      memorized continuation start their loss there (None: the whole row).
    - `layer`: the decoder block activation methods act on (None: the middle block).
    - `reference`: a clean reference model, for methods that need one (None: not available).
    """

    memorized: Rows
    clean: Rows
    pad_id: int
    clean_twins: Rows = ()
    prompt_len: int | None = None
    layer: int | None = None
    reference: nn.Module | None = None

    def __post_init__(self) -> None:
        if not self.memorized:
            raise GSSError(
                "the memorized set is empty: a baseline needs at least one row the model "
                "reproduces. Measure memorization first and pass the rows it reproduced."
            )


@dataclass
class Mitigation:
    """A baseline's result: evaluate `model`; call `remove()` when done (detaches a hook)."""

    model: nn.Module
    seconds: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)
    handle: SteerHandle | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        """The method's full price: its own time plus reused work (``info["reused_seconds"]``:
        scores or a fine-tuned copy computed once for a whole grid, see `SharedWork`)."""
        return self.seconds + float(self.info.get("reused_seconds", 0.0))

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


@dataclass(frozen=True)
class Method:
    """A registered baseline: ``apply(model, data, **params) -> Mitigation``."""

    name: str
    family: str  # steering | unlearning | fine-tuning | neuron | weight
    apply: Callable[..., Mitigation]
    grid: tuple[dict[str, Any], ...]
    summary: str
    reduced_grid: str = ""  # why the default grid is smaller than the original's, if it is
    stronger: tuple[str, ...] = ()  # hyperparameters along which the edit only grows stronger

    def dominated(self, params: dict[str, Any], failed: Sequence[dict[str, Any]]) -> bool:
        """Whether a grid point that already broke the model's utility (one of `failed`) is no
        stronger than `params`: equal on every other hyperparameter and at most as large on each
        of `stronger`. Then `params` breaks it too, and a sweep may skip it."""
        for q in failed:
            if set(q) == set(params) and all(
                q[k] <= params[k] if k in self.stronger else q[k] == params[k] for k in params
            ):
                return True
        return False

    def run(self, model: nn.Module, data: MitigationData, **params: Any) -> Mitigation:
        """Apply the method and time it (the method's own wall time, nothing else)."""
        was_training = model.training
        t0 = time.perf_counter()
        result = self.apply(model, data, **params)
        result.seconds = time.perf_counter() - t0
        result.params = dict(params)
        model.train(was_training)
        return result


class SharedWork:
    """Within-process cache of the part of a method that its swept hyperparameters do not
    change (neuron scores, a fine-tuned copy), so a grid computes it once.

    An entry belongs to one live (model, data) pair plus the method's own key: it is dropped
    when either object is freed (weak references, so ids are never confused) and ignored once
    the model's weights change in place (parameter version counters). `get` returns the value,
    the seconds it cost when computed, and whether this call reused it: the caller charges
    those seconds as ``info["reused_seconds"]`` (`reuse_info`), so every grid point reports
    its full price.
    """

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._store: dict[tuple, tuple[Any, Any, tuple[int, ...], Any, float]] = {}

    @staticmethod
    def _versions(model: nn.Module) -> tuple[int, ...]:
        return tuple(p._version for p in model.parameters())

    def get(
        self, model: nn.Module, data: MitigationData, key: tuple, compute: Callable[[], Any]
    ) -> tuple[Any, float, bool]:
        full = (id(model), id(data), *key)
        hit = self._store.get(full)
        if (
            hit is not None
            and hit[0]() is model
            and hit[1]() is data
            and hit[2] == self._versions(model)
        ):
            return hit[3], hit[4], True
        t0 = time.perf_counter()
        value = compute()
        seconds = time.perf_counter() - t0

        def forget(_: object) -> None:
            self._store.pop(full, None)

        self._store.pop(full, None)
        refs = (weakref.ref(model, forget), weakref.ref(data, forget))
        self._store[full] = (*refs, self._versions(model), value, seconds)
        while len(self._store) > self.max_entries:
            self._store.pop(next(iter(self._store)))
        return value, seconds, False

    def clear(self) -> None:
        self._store.clear()


def reuse_info(seconds: float, reused: bool) -> dict[str, Any]:
    """``Mitigation.info`` entries for work obtained from a `SharedWork` cache."""
    return {"shared_seconds": seconds, "reused_seconds": seconds if reused else 0.0}


REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    family: str,
    grid: Sequence[dict[str, Any]],
    summary: str,
    reduced_grid: str = "",
    stronger: Sequence[str] = (),
) -> Callable[[Callable[..., Mitigation]], Callable[..., Mitigation]]:
    """Decorator: register ``apply`` under `name` with its default grid (`stronger`: see
    :meth:`Method.dominated`)."""

    def wrap(fn: Callable[..., Mitigation]) -> Callable[..., Mitigation]:
        if name in REGISTRY:
            raise RuntimeError(f"baseline {name!r} registered twice")
        REGISTRY[name] = Method(
            name, family, fn, tuple(grid), summary, reduced_grid, tuple(stronger)
        )
        return fn

    return wrap


def get_method(name: str) -> Method:
    """The registered baseline called `name`."""
    from gss_bench.baselines import load_all

    load_all()
    if name not in REGISTRY:
        raise GSSError(f"unknown baseline {name!r}; known: {', '.join(sorted(REGISTRY))}.")
    return REGISTRY[name]


def method_names(family: str | None = None) -> list[str]:
    """Registered baselines (of one family), in registration order."""
    from gss_bench.baselines import load_all

    load_all()
    return [n for n, m in REGISTRY.items() if family is None or m.family == family]


def resolve_method_names(text: str) -> list[str]:
    """Baseline names from a comma-separated list of names, families or ``all`` (the
    ``--baselines`` option of the benchmarks), in registration order, without repeats."""
    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        everything = method_names()
        found = everything if item == "all" else method_names(item)
        found = found or ([item] if item in everything else [])
        if not found:
            raise GSSError(
                f"unknown baseline {item!r}; use 'all', a family (steering, unlearning, "
                f"fine-tuning, neuron, weight, decoding) or one of {', '.join(everything)}."
            )
        out += [n for n in found if n not in out]
    return out
