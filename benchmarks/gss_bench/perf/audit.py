"""Audit speed: `gss.audit` rows/s against the forward passes it cannot avoid.

The audit reads everything from one teacher-forced forward of the model and one of the
reference over each batch (no generation), so its floor is two forwards over the same tokens.
Three arms per round, in a fresh seeded order: the audit, the model's forward alone ("one
forward", the issue's unit) and both forwards (the floor), over the same rows and batches.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gss.audit import audit
from gss.data import batches
from gss.hf.forward import forward_logits, vocab_size
from gss.report import markdown_table
from gss.statistics.capture import calibration_mode
from gss_bench.perf.common import (
    Sizes,
    interleaved,
    log,
    paired_ratios,
    perturbed_copy,
    random_ids,
    summary,
    tiny_model,
)
from gss_bench.perf.overhead import load_local_model, model_name

K, N = 32, 72  # the (n, k) of the paper's extraction test, gss audit's defaults


def _forwards(models: list[nn.Module], rows: torch.Tensor, batch_size: int) -> float:
    start = time.perf_counter()
    with calibration_mode(*models), torch.no_grad():
        for batch in batches(rows.tolist(), batch_size):
            for m in models:
                forward_logits(m, batch.input_ids, batch.attention_mask)
    return time.perf_counter() - start


def measure(
    model: nn.Module, name: str, rows: int, batch_size: int, repeats: int, progress: bool
) -> dict[str, Any]:
    reference = perturbed_copy(model)
    ids = random_ids(rows, N, vocab_size(model), seed=3)

    def audit_arm() -> float:
        start = time.perf_counter()
        audit(model, reference, ids.tolist(), k=K, n=N, batch_size=batch_size, progress=False)
        return time.perf_counter() - start

    times = interleaved(
        {
            "audit": audit_arm,
            "one forward": lambda: _forwards([model], ids, batch_size),
            "two forwards": lambda: _forwards([model, reference], ids, batch_size),
        },
        repeats=repeats,
        warmup=1,
        desc=f"audit speed: {name}",
        progress=progress,
    )
    return {
        "model": name,
        "rows": rows,
        "tokens_per_row": N,
        "batch_size": batch_size,
        "seconds": {arm: summary(ts) for arm, ts in times.items()},
        "rows_per_second": rows / summary(times["audit"])["median"],
        "vs_one_forward": summary(paired_ratios(times["audit"], times["one forward"])),
        "vs_two_forwards": summary(paired_ratios(times["audit"], times["two forwards"])),
    }


def run(
    sizes: Sizes, model_paths: list[str] | None, repeats: int | None, progress: bool, quick: bool
) -> dict[str, Any]:
    rows, batch_size = (16, 4) if quick else (256, 8)
    repeats = repeats or sizes.solve_repeats  # whole passes over the rows: a few rounds do
    results = []
    if model_paths:
        for path in model_paths:
            model, _ = load_local_model(path)
            results.append(measure(model, model_name(path), rows, batch_size, repeats, progress))
    else:
        results.append(
            measure(tiny_model(sizes), "tiny Llama", rows, batch_size, repeats, progress)
        )
    for r in results:
        log(
            f"audit {r['model']}: {r['rows_per_second']:.1f} rows/s, "
            f"{r['vs_one_forward']['median']:.2f}x one forward, "
            f"{r['vs_two_forwards']['median']:.2f}x the two forwards it needs"
        )
    return {
        "models": results,
        "goal": "the audit costs about the two forwards it reads (ratio to two forwards near 1)",
    }


def figure(result: dict[str, Any], path: Path) -> Path:
    """Seconds of each arm per model (median, with the range as error bars)."""
    from gss.report import pyplot, save_figure

    plt = pyplot()
    arms = ["one forward", "two forwards", "audit"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        xs = [i + j * width for i in range(len(result["models"]))]
        s = [r["seconds"][arm] for r in result["models"]]
        med = [v["median"] for v in s]
        err = [
            [m - v["min"] for m, v in zip(med, s, strict=True)],
            [v["max"] - m for m, v in zip(med, s, strict=True)],
        ]
        ax.bar(xs, med, width, yerr=err, label=arm)
    ax.set_xticks([i + width for i in range(len(result["models"]))])
    ax.set_xticklabels([r["model"] for r in result["models"]])
    ax.set_ylabel("seconds")
    ax.set_title("gss audit vs the forward passes it reads")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def table(result: dict[str, Any]) -> str:
    header = ["model", "rows x tokens", "audit s", "rows/s", "x one forward", "x two forwards"]
    body = [
        [
            r["model"],
            f"{r['rows']} x {r['tokens_per_row']}",
            f"{r['seconds']['audit']['median']:.2f}",
            f"{r['rows_per_second']:.1f}",
            f"{r['vs_one_forward']['median']:.2f} ({r['vs_one_forward']['min']:.2f}-"
            f"{r['vs_one_forward']['max']:.2f})",
            f"{r['vs_two_forwards']['median']:.2f} ({r['vs_two_forwards']['min']:.2f}-"
            f"{r['vs_two_forwards']['max']:.2f})",
        ]
        for r in result["models"]
    ]
    return markdown_table(header, body)
