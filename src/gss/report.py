"""Tables (JSON, Markdown) and figures (PNG) in one style for every command and benchmark."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gss.errors import GSSError


def write_json(path: str | Path, data: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return p


def _jsonable(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; floats are printed with 2 decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def machine_info(**extra: Any) -> dict[str, Any]:
    """Where a benchmark ran: what its timings depend on, and (the CPU's model and the vector
    instructions torch uses on it) what float rounding, hence trained weights, depend on."""
    return {
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **package_versions("transformers", "triton"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        **cpu_info(),
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
        **extra,
    }


def package_versions(*names: str) -> dict[str, str]:
    """The installed versions of ``names`` (read from their metadata, nothing imported), for
    the ones installed: Triton's launch, for one, is part of what a CUDA timing measures."""
    found = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def cpu_info() -> dict[str, str]:
    """The CPU's model name and the vector instruction set torch's CPU kernels use on it
    (e.g. AVX2, AVX512): training from one seed on CPUs that differ in it gives other weights,
    as float sums are rounded in another order."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name, "cpu_capability": cpu_capability()}


def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels dispatch to (AVX2, AVX512, ...); the
    ``ATEN_CPU_CAPABILITY`` environment variable lowers it."""
    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return str(get()) if get is not None else "unknown"


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out, write (120 dpi, creating the folder) and close a figure; a path without a
    suffix gets ``.png`` (what matplotlib writes then), a directory is refused."""
    p = Path(path)
    if p.is_dir():
        raise GSSError(f"{p} is a directory: give the figure a file name, e.g. {p / 'plot.png'}.")
    if not p.suffix:
        p = p.with_suffix(".png")
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    pyplot().close(fig)
    return p


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_signal(
    omega: Tensor, stats: Any, path: str | Path, title: str, normal: Tensor | None = None
) -> Path:
    """The pilot-study figure: omega histogram and burst-length histogram of `stats`.

    With `normal` (omega on normal text), the histogram shows `omega` (the candidate, possibly
    memorized text) and `normal` side by side on the same bins.
    """
    import numpy as np

    plt = pyplot()
    values = omega[~omega.isnan()].double().numpy()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    if normal is None:
        axes[0].hist(values, bins=80, color="#4c72b0", log=True)
    else:
        other = normal[~normal.isnan()].double().numpy()
        bins = np.histogram_bin_edges(np.concatenate([values, other]), bins=80)
        axes[0].hist(values, bins=bins, color="#c44e52", alpha=0.6, log=True, label="candidate")
        axes[0].hist(other, bins=bins, color="#4c72b0", alpha=0.6, log=True, label="normal")
    axes[0].axvline(stats.mean, color="#c44e52", ls="--", label=f"mean {stats.mean:.2f}")
    axes[0].set_xlabel("omega = log p_model - log p_ref (nats)")
    axes[0].set_ylabel("tokens (log scale)")
    axes[0].set_title(f"{100 * stats.share_above_mean:.1f}% of tokens above the mean")
    axes[0].legend()
    lengths = sorted(stats.burst_histogram)
    axes[1].bar(lengths, [stats.burst_histogram[k] for k in lengths], color="#55a868")
    axes[1].set_xlabel("burst length (consecutive omega > 0 tokens)")
    axes[1].set_ylabel("bursts")
    axes[1].set_title(
        f"mean {stats.burst_mean_length:.2f}, {100 * stats.burst_single_share:.1f}% single"
    )
    fig.suptitle(title)
    return save_figure(fig, path)
