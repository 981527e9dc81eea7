"""gss protect narrowed to one block, rank and gate, per gate, on a TinyMem setting: where each
gate opens on the held-out memorized rows and what it leaves extractable
(results/tinymem-protect-gates/narrowed/, docs/protect.md).

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/scripts/protect_one_gate.py --setting math_noise \
        --seed 0 --block 3 --out results/tinymem-protect-gates/narrowed

Uses the models `gss bench tinymem --threads 2` trained and cached.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gss.protect import SearchSpace
from gss_bench.tinymem import methods as M
from gss_bench.tinymem.protection import protect_row
from gss_bench.tinymem.train import get_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", default="math_noise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--gates", default="hard,discriminant")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(2)
    mem, ref, data, _ = get_models(args.setting, "default", args.seed, None, progress=False)
    base = M.evaluate(mem, data, 256)
    for gate in args.gates.split(","):
        space = SearchSpace(
            presets=("gss-tr",),
            blocks=(args.block,),
            ranks=(args.rank,),
            gates=(gate,),
            max_blocks=1,
        )
        report = args.out / f"{args.setting}{args.seed}_{gate}"
        protect_row(mem, ref, data, base, 256, args.seed, report_dir=report, search=space)
        found = json.loads((report / "protect.json").read_text())
        where = found["gates"]["memorized_rows"]
        print(
            f"{gate}: {found['chosen']['memorized']:.1f}% of tuning rows extractable, "
            f"{found['after']['memorized']:.1f}% of held-out rows; gates open on "
            f"{100 * where['window']:.1f}% of window and {100 * where['prompt']:.1f}% of prompt "
            f"positions; general text {found['gates']['open_share']}"
        )


if __name__ == "__main__":
    main()
