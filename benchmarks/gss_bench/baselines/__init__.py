"""Memorization-mitigation methods the paper compares against, in the same harness as GSS.

Every method has one interface (see :mod:`gss_bench.baselines.interface`)::

    from gss_bench.baselines import MitigationData, get_method

    data = MitigationData(memorized=rows_it_reproduces, clean=clean_rows, pad_id=pad)
    result = get_method("task-vector").run(model, data, alpha=1.0)
    result.model  # an edited copy (the original is untouched), or the original with a hook
    result.seconds  # the method's own wall time
    result.remove()  # detach the hook, if it has one

``method_names()`` lists them; each has a default grid (``get_method(name).grid``).
"""

from __future__ import annotations

import importlib

from gss_bench.baselines.interface import (
    Method,
    Mitigation,
    MitigationData,
    get_method,
    method_names,
    resolve_method_names,
)
from gss_bench.baselines.steering import MeanDifferenceSteer, mean_difference_vector

# Modules that register methods, imported on first lookup (keeps `import gss` light).
_MODULES = ("steering", "redirect", "unlearning", "finetune", "neurons", "weights", "decoding")


def load_all() -> None:
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")


__all__ = [
    "MeanDifferenceSteer",
    "Method",
    "Mitigation",
    "MitigationData",
    "get_method",
    "mean_difference_vector",
    "method_names",
    "resolve_method_names",
]
