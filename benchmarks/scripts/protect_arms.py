"""gss protect on TinyMem settings under several search spaces, side by side: each arm is a
set of `gss.SearchSpace` fields over the defaults, run on the same cached models
(results/tinymem-protect-range/, docs/protect.md).

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/scripts/protect_arms.py --setting math_noise \
        --seeds 0,1,2 --arm 'delta_ceiling=100' --arm '' --out results/tinymem-protect-range

An arm is comma-separated ``field=value`` pairs (values are Python literals; '' is the default
search). Uses the models `gss bench tinymem --threads 2` trained and cached. Writes
``arms.json`` (one record per setting, seed and arm; each run adds its records to the
folder's) and ``arms.md``, and each run's own protect report under ``<setting><seed>/<arm>/``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from gss.protect import SearchSpace
from gss.report import markdown_table
from gss_bench.tinymem import methods as M
from gss_bench.tinymem.protection import protect_row
from gss_bench.tinymem.train import get_models


def parse_arm(text: str) -> dict[str, Any]:
    """``"gate_share=0.01,delta_ceiling=100"`` -> the SearchSpace fields it sets."""
    fields = {f.name for f in dataclasses.fields(SearchSpace)}
    arm: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        name, _, value = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"--arm: {name!r} is not a SearchSpace field ({sorted(fields)})")
        arm[name] = ast.literal_eval(value)
    return arm


def record(setting: str, seed: int, arm: str, row: dict[str, Any], seconds: float) -> dict:
    found = row["protect"]
    held = row.get("heldout_rows", {})
    return {
        "setting": setting,
        "seed": seed,
        "arm": arm or "default",
        "chosen": row["selected"]["params"],
        "points": found["trials"],
        "tuning_memorized": (found["chosen"] or {}).get("memorized"),
        "heldout_rows": held.get("rows"),
        "heldout_memorized": held.get("memorized"),
        "heldout_unmitigated": held.get("by_method", {}).get("Unmitigated"),
        # protect's own count on the rows it held out (prompted as in its audit)
        "protect_heldout": found["after"].get("memorized"),
        "all_rows_memorized": row["selected"]["eval"]["memorized"],
        "test_utility": row["selected"]["eval"]["utility"],
        "val_utility": row["selected"]["eval"]["val_utility"],
        "gates_open": found["gates"].get("open_share"),
        "seconds": seconds,
    }


HEADER = (
    "setting", "seed", "arm", "chosen", "points", "tuning rows left",
    "held-out rows left: protect's count", "held-out rows left, greedy (unmitigated)",
    "all rows", "utility, test (validation)", "seconds",
)  # fmt: skip


def table(records: list[dict]) -> str:
    rows = []
    for r in records:
        c = r["chosen"]
        chosen = (
            f"{c['variant']} blocks {c['blocks']}, delta {c['delta']}, rank {c['rank']}, "
            f"{c['gate']}"
            if c
            else "nothing within budget"
        )
        own, held = r.get("protect_heldout"), r["heldout_memorized"]
        greedy = (
            "--"
            if held is None
            else f"{held:.1f}% ({r['heldout_unmitigated']:.1f}%) of {r['heldout_rows']}"
        )
        rows.append(
            [
                r["setting"], r["seed"], r["arm"], chosen, r["points"],
                f"{r['tuning_memorized']:.1f}%", "--" if own is None else f"{own:.1f}%", greedy,
                f"{r['all_rows_memorized']:.2f}%",
                f"{r['test_utility']:.2f} ({r['val_utility']:.2f})", f"{r['seconds']:.0f}",
            ]
        )  # fmt: skip
    return markdown_table(HEADER, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", default="math_noise")
    p.add_argument("--seeds", default="0")
    p.add_argument("--arm", action="append", required=True, help="SearchSpace fields, or ''")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    arms = {text: parse_arm(text) for text in args.arm}
    torch.set_num_threads(2)
    records = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        mem, ref, data, _ = get_models(args.setting, "default", seed, None, progress=False)
        base = M.evaluate(mem, data, 256)
        for text, fields in arms.items():
            started = time.perf_counter()
            report = args.out / f"{args.setting}{seed}" / (text or "default")
            search = SearchSpace(**fields)
            row = protect_row(mem, ref, data, base, 256, seed, report_dir=report, search=search)
            records.append(record(args.setting, seed, text, row, time.perf_counter() - started))
            print(json.dumps(records[-1]), flush=True)
    # each run adds its records to the folder's (a rerun of a setting, seed and arm replaces it)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "arms.json"
    ours = {(r["setting"], r["seed"], r["arm"]) for r in records}
    kept = [
        r
        for r in (json.loads(path.read_text()) if path.exists() else [])
        if (r["setting"], r["seed"], r["arm"]) not in ours
    ]
    records = sorted(kept + records, key=lambda r: (r["setting"], r["seed"]))
    path.write_text(json.dumps(records, indent=2) + "\n")
    (args.out / "arms.md").write_text(table(records))


if __name__ == "__main__":
    main()
