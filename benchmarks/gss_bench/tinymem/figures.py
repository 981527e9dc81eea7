"""Figures and ablation tables of the TinyMem benchmark (PNG + Markdown)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gss.report import markdown_table, pyplot, save_figure

COLORS = {
    "GSS": "#c44e52",
    "GSS ungated": "#dd8452",
    "Mean-diff": "#4c72b0",
    "GSS-TR": "#55a868",
    "GSS-TR ungated": "#8172b3",
}


def _utility_label(setting: str) -> str:
    return "clean test accuracy (%)" if setting.startswith("math") else "held-out perplexity"


# the zoom panel: accuracies down to this many points below the unmitigated model's, or
# perplexities up to this factor above it (the selection rule allows 1 point or 10%)
ZOOM_POINTS = 4.0
ZOOM_PERPLEXITY = 1.5


def pareto(records: list[dict[str, Any]], setting: str, path: Path) -> Path:
    """% memorized vs utility for every grid point of every method (all seeds). When some
    point lies far off, a second panel zooms on the utilities near the unmitigated model's,
    where the selection rule picks: at full range a few broken models (accuracy 4-55%,
    perplexity up to 1e8) squeeze every other point into one column."""
    plt = pyplot()
    runs = [r for r in records if r["setting"] == setting]
    math = setting.startswith("math")
    others = [n for n in dict.fromkeys(n for r in runs for n in r["methods"]) if n not in COLORS]
    palette = plt.get_cmap("tab20")
    colors = {**COLORS, **{n: palette(i % 20) for i, n in enumerate(others)}}
    base = [run["unmitigated"]["utility"] for run in runs]
    shown = [p["eval"]["utility"] for r in runs for m in r["methods"].values() for p in m["grid"]]
    shown += [run["reference"]["utility"] for run in runs] + base
    if math:
        limits = (min(base) - ZOOM_POINTS, max(shown) + 0.5)
        zoom = f"accuracy within {ZOOM_POINTS:g} points of the unmitigated"
    else:
        limits = (min(shown) / 1.1, max(base) * ZOOM_PERPLEXITY)
        zoom = f"perplexity up to {ZOOM_PERPLEXITY:g}x the unmitigated"
    zoomed = any(not limits[0] <= x <= limits[1] for x in shown)  # else one panel shows all
    size = (6.4 + (5.0 if zoomed else 0.0) + (2.0 if others else 0.0), 5.6 if others else 4.6)
    fig, grid = plt.subplots(1, 2 if zoomed else 1, figsize=size)
    axes = list(grid) if zoomed else [grid]
    for ax in axes:
        _pareto_points(ax, runs, colors)
        ax.set_xlabel(_utility_label(setting))
        ax.set_ylabel("% memorized")
        if not math:
            ax.set_xscale("log")
    if zoomed:
        axes[1].set_xlim(*limits)
        axes[0].set_title("every strength", fontsize=9)
        axes[1].set_title(f"zoom: {zoom}", fontsize=9)
    fig.suptitle(
        f"TinyMem {setting}: memorization vs utility (each point a strength; circled: selected)",
        fontsize=10,
    )
    handles, labels = axes[0].get_legend_handles_labels()
    axes[-1].legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return save_figure(fig, path)


def _pareto_points(ax: Any, runs: list[dict[str, Any]], colors: dict[str, Any]) -> None:
    """Every run's grid per method (seed 0 solid, others faded), the selected points circled,
    and the unmitigated and clean reference models."""
    for i, run in enumerate(runs):
        for name, method in run["methods"].items():
            xs = [p["eval"]["utility"] for p in method["grid"]]
            ys = [p["eval"]["memorized"] for p in method["grid"]]
            ax.plot(
                xs,
                ys,
                "o-",
                color=colors[name],
                alpha=1.0 if i == 0 else 0.35,
                label=name if i == 0 else None,
                ms=4,
            )
            sel = method["selected"]["eval"]
            ax.plot(sel["utility"], sel["memorized"], "o", mfc="none", mec="black", ms=10)
        for key, marker, label in (
            ("unmitigated", "*", "unmitigated"),
            ("reference", "P", "clean reference"),
        ):
            ax.plot(
                run[key]["utility"],
                run[key]["memorized"],
                marker,
                color="black",
                ms=11,
                label=label if i == 0 else None,
            )


def ablation(records: list[dict[str, Any]], name: str, out: Path) -> list[Path]:
    """Table (.md) and plot (.png) of one ablation: selected point per variant, per run."""
    plt = pyplot()
    header = ["setting", "seed", name, "% Mem", "% Correct", "utility", "delta"]
    extra_keys = sorted(
        {
            k
            for r in records
            for row in r.get("ablations", {}).get(name, [])
            for k in row
            if k not in ("variant", "selected", "grid")
        }
    )
    header += extra_keys
    rows = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in records:
        ab = r.get("ablations", {}).get(name)
        if not ab:
            continue
        for row in ab:
            ev = row["selected"]["eval"]
            rows.append(
                [
                    r["setting"],
                    r["seed"],
                    row["variant"],
                    ev["memorized"],
                    ev["correct"],
                    ev["utility"],
                    row["selected"]["strength"],
                ]
                + [row.get(k, "") for k in extra_keys]
            )
        labels = [str(row["variant"]) for row in ab]
        axes[0].plot(
            labels,
            [row["selected"]["eval"]["memorized"] for row in ab],
            "o-",
            label=f"{r['setting']} s{r['seed']} % memorized",
        )
        axes[0].plot(
            labels,
            [row["selected"]["eval"]["correct"] for row in ab],
            "s--",
            label=f"{r['setting']} s{r['seed']} % correct",
        )
        for row in ab:
            xs = [p["eval"]["utility"] for p in row["grid"]]
            ys = [p["eval"]["memorized"] for p in row["grid"]]
            axes[1].plot(xs, ys, "o-", ms=3, label=f"{name}={row['variant']}")
    axes[0].set_xlabel(name)
    axes[0].set_ylabel("% of noised rows (selected strength)")
    axes[0].set_title(f"GSS ablation: {name}")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("utility (accuracy % or perplexity)")
    axes[1].set_ylabel("% memorized")
    axes[1].set_title("every delta of every variant")
    axes[1].legend(fontsize=7)
    png = save_figure(fig, out / f"ablation_{name}.png")
    md = out / f"ablation_{name}.md"
    md.write_text(f"## Ablation: {name}\n\n" + markdown_table(header, rows))
    return [png, md]


def write_figures(records: list[dict[str, Any]], out: Path) -> list[Path]:
    paths = []
    for setting in dict.fromkeys(r["setting"] for r in records):
        paths.append(pareto(records, setting, out / f"pareto_{setting}.png"))
    names = dict.fromkeys(n for r in records for n in r.get("ablations", {}))
    for name in names:
        paths += ablation(records, name, out)
    return paths
