"""PNG figures of ``gss bench perf``, one per part that ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gss.report import pyplot
from gss.report import save_figure as _save


def overhead(result: dict[str, Any], path: Path) -> Path:
    """Steered/unsteered throughput per (model, batch) and K, with quartile whiskers."""
    plt = pyplot()
    rows = [r for m in result["models"] for r in m["rows"]]
    groups = list(dict.fromkeys((r["model"], r["batch"]) for r in rows))
    ranks = sorted({r["rank"] for r in rows})
    width = 0.8 / len(ranks)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.6 * len(groups) + 2), 5.4))
    for j, k in enumerate(ranks):
        xs, ys, lo, hi = [], [], [], []
        for i, g in enumerate(groups):
            for r in rows:
                if (r["model"], r["batch"]) == g and r["rank"] == k:
                    s = r["ratio"]
                    xs.append(i + (j - (len(ranks) - 1) / 2) * width)
                    ys.append(s["median"])
                    lo.append(s["median"] - s["q1"])
                    hi.append(s["q3"] - s["median"])
        ax.bar(
            xs,
            ys,
            width,
            yerr=[lo, hi],
            capsize=3,
            error_kw={"ecolor": "0.55"},
            label=f"GSS K={k}, whole calls",
        )
        alt = [
            (i + (j - (len(ranks) - 1) / 2) * width, r["alternating_step_ratio"])
            for i, g in enumerate(groups)
            for r in rows
            if (r["model"], r["batch"]) == g and r["rank"] == k and "alternating_step_ratio" in r
        ]
        if alt:
            ax.errorbar(
                [x for x, _ in alt],
                [a["median"] for _, a in alt],
                yerr=[
                    [a["median"] - a["q1"] for _, a in alt],
                    [a["q3"] - a["median"] for _, a in alt],
                ],
                fmt="D",
                ms=4,
                capsize=2,
                color="black",
                label="steps alternating in a call" if j == 0 else None,
            )
    ax.axhline(1.0, color="black", lw=1)
    ax.axhline(0.99, color="#c44e52", ls="--", lw=1, label="goal 0.99")
    ax.set_xticks(range(len(groups)))
    # "name (random weights)" on two lines: neighbouring labels would overlap
    ax.set_xticklabels([f"{m.replace(' (', chr(10) + '(')}\nbatch {b}" for m, b in groups])
    ax.set_ylabel("steered / unsteered")
    low = min(r["ratio"]["q1"] for r in rows)
    high = max(r["ratio"]["q3"] for r in rows)
    ax.set_ylim(min(0.9, low - 0.02), max(1.05, high + 0.02))
    ax.set_title(
        "Inference overhead, steered / unsteered:\n"
        "greedy generate tokens/s (bars), alternating decode steps (diamonds)",
        fontsize=10,
    )
    # below the axes: inside, it hid the bars and whiskers it explains
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    return _save(fig, path)


def calibration(result: dict[str, Any], path: Path) -> Path:
    """Calibration time split into its phases, beside the unavoidable passes."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 2.8))
    passes = result["seconds"]["passes"]["median"]
    ax.barh([0], [passes], color="#8c8c8c", label="unavoidable passes")
    left = 0.0
    colors = {
        "signal": "#4c72b0",
        "statistics": "#55a868",
        "solve": "#c44e52",
        "thresholds": "#dd8452",
    }
    for name, color in colors.items():
        if name in result["phases"]:
            width = result["phases"][name]["median"]
            ax.barh([1], [width], left=left, color=color, label=f"calibrate: {name}")
            left += width
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["passes", "gss.calibrate"])
    ax.set_xlabel("seconds (median)")
    ax.set_title(f"Calibration cost: {result['ratio']['median']:.2f}x the passes (goal <= 1.2x)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # off the bars
    return _save(fig, path)


def solve(result: dict[str, Any], path: Path) -> Path:
    """Solve seconds vs d on log-log axes, one line per (method, K)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    ranks = sorted({r["rank"] for r in result["rows"]})
    for method, style in (("truncated", "o-"), ("full", "s--")):
        for j, k in enumerate(ranks):
            pts = [
                (r["d"], r[method]["median"])
                for r in result["rows"]
                if r["rank"] == k and "median" in r[method]
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=f"C{j}", label=f"{method} K={k}", ms=4)
    if any(r["d"] >= 4096 for r in result["rows"]):
        ax.plot([4096], [2.0], "k*", ms=12, label="goal: d=4096, K=8 < 2 s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden size d")
    ax.set_ylabel("seconds (median)")
    ax.set_title("solve_probe_steer scaling")
    ax.legend(fontsize=7)
    return _save(fig, path)


def memory(result: dict[str, Any], path: Path) -> Path:
    """Peak RSS and calibration's increase vs corpus size."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    texts = [r["texts"] for r in result["rows"]]
    ax.plot(texts, [r["peak_rss_mb"] for r in result["rows"]], "o-", label="peak RSS")
    ax.plot(
        texts,
        [r["calibration_increase_mb"] for r in result["rows"]],
        "s-",
        label="increase during calibration",
    )
    if result.get("streaming_rows"):
        ax.plot(
            texts,
            [r["calibration_increase_mb"] for r in result["streaming_rows"]],
            "^--",
            label="increase, keep_general=0 (second pass)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("calibration texts")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.set_title("Calibration memory vs corpus size (fresh process each)")
    ax.legend()
    return _save(fig, path)


def adapters(result: dict[str, Any], path: Path) -> Path:
    """Peak RSS of calibrating a LoRA fine-tune against a second base copy vs adapters_off."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    labels = ["base loaded again", "adapters_off"]
    rows = result["rows"]
    ax.bar(labels, [r["peak_rss_mb"] for r in rows], color=["#999999", "#2a6fbb"], label="peak")
    ax.bar(
        labels,
        [r["peak_rss_models_mb"] for r in rows],
        color="none",
        edgecolor="black",
        hatch="//",
        label="with the models resident",
    )
    ax.set_ylabel("peak RSS, MB")
    ax.set_title(f"Calibrating a LoRA fine-tune: {result['model']}")
    ax.legend(fontsize=8)
    return _save(fig, path)
