"""Which CPU numerics trained a cached model, so that caches keep other CPUs' weights apart.

torch's CPU kernels dispatch on the vector instructions the CPU has (AVX2, AVX512, ...), and
each rounds float sums in its own order: the same seed trains other weights on another of them
(TinyMem math noise: 34.4% memorized with AVX2, 39.1% with AVX-512; docs/benchmarks.md).
The committed benchmark models were trained with AVX2 (``ATEN_CPU_CAPABILITY=avx2``
reproduces them on an AVX-512 CPU), so AVX2 keeps the cache keys from before this existed.
"""

from __future__ import annotations

from typing import Any

import torch

from gss.report import cpu_capability, cpu_info

KEY_CPU_CAPABILITY = "AVX2"


def trained_on(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What a model's weights depend on beyond its seed and configs: torch, the device it
    trained on and the CPU."""
    return {"torch": torch.__version__, "device": torch.device(device).type, **cpu_info()}


def key_suffix(device: str | torch.device = "cpu") -> str:
    """Appended to a training cache key: '' on a CPU whose kernels use AVX2, else what the
    weights depend on instead (``-avx512``, or ``-cuda`` for a GPU's own kernels)."""
    kind = torch.device(device).type
    if kind != "cpu":
        return f"-{kind}"
    capability = cpu_capability()
    return "" if capability == KEY_CPU_CAPABILITY else f"-{capability.lower()}"


def trained_elsewhere(record: dict[str, Any], device: str | torch.device = "cpu") -> bool:
    """Whether a cached record names other numerics than this run's (a model cached before its
    key held them); a record that names none is trusted."""
    named = record.get("trained_on")
    if not named:
        return False
    kind = torch.device(device).type
    if named.get("device", "cpu") != kind:
        return True
    return kind == "cpu" and named.get("cpu_capability") != cpu_capability()
