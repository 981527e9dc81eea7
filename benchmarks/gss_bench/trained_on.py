"""Which CPU numerics trained a cached model, so that caches keep other CPUs' weights apart.

torch's CPU kernels dispatch on the vector instructions the CPU has (AVX2, AVX512, ...), and
each rounds float sums in its own order: the same seed trains other weights on another of them
(TinyMem math noise: 34.4% memorized with AVX2, 39.1% with AVX-512; docs/benchmarks.md).
The committed benchmark models were trained with AVX2 (``ATEN_CPU_CAPABILITY=avx2``
reproduces them on an AVX-512 CPU), so AVX2 keeps the cache keys from before this existed.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gss.report import cpu_capability, cpu_info

KEY_CPU_CAPABILITY = "AVX2"
# The committed models were trained on 2 threads; another count splits float sums otherwise
# and trains other weights from the same seed (docs/benchmarks.md): it goes into the key.
KEY_THREADS = 2


def trained_on(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What a model's weights depend on beyond its seed and configs: torch, the device it
    trained on and the CPU."""
    return {
        "torch": torch.__version__,
        "device": torch.device(device).type,
        **cpu_info(),
        "threads": torch.get_num_threads(),
    }


def key_suffix(device: str | torch.device = "cpu") -> str:
    """Appended to a training cache key: '' on a CPU whose kernels use AVX2 with 2 threads
    (the committed models' conditions), else what the weights depend on instead
    (``-avx512``, ``-t4`` for 4 threads, or ``-cuda`` for a GPU's own kernels)."""
    kind = torch.device(device).type
    if kind != "cpu":
        return f"-{kind}"
    capability = cpu_capability()
    suffix = "" if capability == KEY_CPU_CAPABILITY else f"-{capability.lower()}"
    threads = torch.get_num_threads()
    return suffix + ("" if threads == KEY_THREADS else f"-t{threads}")


def trained_elsewhere(
    record: dict[str, Any], device: str | torch.device = "cpu", threads: int | None = None
) -> bool:
    """Whether a cached record names other numerics than this run's on ``threads`` threads
    (default: torch's count now; a model cached before its key held them); a record that
    names none is trusted."""
    named = record.get("trained_on")
    if not named:
        return False
    kind = torch.device(device).type
    if named.get("device", "cpu") != kind:
        return True
    if kind != "cpu":
        return False
    here = torch.get_num_threads() if threads is None else threads
    other_threads = named.get("threads") is not None and named["threads"] != here
    return named.get("cpu_capability") != cpu_capability() or other_threads


def other_cpu(record: dict[str, Any]) -> str | None:
    """The CPU a cached model was trained on when it is not this one (the same instructions
    and threads still train other weights on some other CPUs: docs/benchmarks.md), else None."""
    named = (record.get("trained_on") or {}).get("cpu")
    return named if named and named != cpu_info()["cpu"] else None


def same_numerics(named: dict[str, Any], threads: int) -> bool:
    """Whether a model's ``trained_on`` record names this machine's numerics at ``threads``
    threads: the same device, vector instructions, thread count and CPU."""
    record = {"trained_on": named}
    return not trained_elsewhere(record, threads=threads) and other_cpu(record) is None


def describe_numerics(named: dict[str, Any], threads: int | None = None) -> str:
    """A ``trained_on`` record (or this machine's `cpu_info` with ``threads``) in words; its
    thread count left out where it is ``threads``."""
    count = named.get("threads")
    at = f", {count} threads" if count and count != threads else ""
    return f"{named.get('cpu', 'an unnamed CPU')} ({named.get('cpu_capability', '?')}{at})"


def numerics_slug(threads: int) -> str:
    """This machine's numerics as a folder-name suffix: its CPU's name (``amd-epyc``), then
    ``-avx512`` or ``-t4`` where they are not the committed models' AVX2 and 2 threads."""
    name = re.sub(r"\((r|tm)\)", "", cpu_info()["cpu"].lower())
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cpu"
    capability = cpu_capability()
    slug += "" if capability == KEY_CPU_CAPABILITY else f"-{capability.lower()}"
    return slug + ("" if threads == KEY_THREADS else f"-t{threads}")
