"""How close the truncated solve comes to the full SVD on real calibration statistics.

A developer's measurement script (not part of ``gss bench``): it gathers the statistics of the
canary benchmark's SmolLM2-135M fine-tune (``gss bench canaries``; the fine-tune is read from
its cache, or trained once, ~10 min) at two blocks, and solves them with the full SVD and with
the truncated one, both with a fixed 4 subspace iterations (gss before it iterated to
convergence) and with the default (until the top-K singular values settle). d = 576 here, where
``method="auto"`` takes the full SVD; the truncated solve is forced to see how it fares on a
real spectrum: one strong direction, then a long flat tail.

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/solve_accuracy.py [--out DIR]

(``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 CPU reuses the fine-tune ``make bench`` caches.)
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from gss.report import machine_info, markdown_table, write_json
from gss.solve.whitened import solve_probe_steer
from gss.statistics.collect import collect_statistics
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.run import CALIBRATION_CLEAN_ROWS, default_cache, default_setup, finetuned
from gss_bench.perf.scaling import accuracy

LAYERS = (22, 29)  # the lowest fine-tuned block (the scan's best) and the last
RANKS = (1, 4, 8, 16, 64)
ITERATIONS = {"fixed 4": 4, "until settled": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/solve-accuracy")
    args = parser.parse_args()
    torch.set_num_threads(2)
    base_path, base, tokenizer, data, pad = default_setup()
    cfg = FinetuneConfig(train_blocks=8, seed=0)  # the canary benchmark's defaults
    model, _ = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
    texts = [*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]]
    rows, spectra = [], {}
    for layer in LAYERS:
        stats = collect_statistics(
            model, base, texts, layer=layer, gen_texts=data.general_rows, progress=False
        )
        memorization, sigma = stats.memorization.value, stats.sigma.covariance
        exact_all = solve_probe_steer(memorization, sigma, max(RANKS), method="full")
        spectra[layer] = exact_all.singular_values.tolist()
        for rank in RANKS:
            exact = solve_probe_steer(memorization, sigma, rank, method="full")
            for name, iterations in ITERATIONS.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    start = time.perf_counter()
                    found = solve_probe_steer(
                        memorization, sigma, rank, method="truncated", power_iters=iterations
                    )
                    seconds = time.perf_counter() - start
                rows.append(
                    {
                        "layer": layer,
                        "rank": rank,
                        "iterations": name,
                        "ran": found.power_iters,
                        "converged": found.converged,
                        "warned": bool(caught),
                        "seconds": seconds,
                        **accuracy(exact, found),
                    }
                )
                print(rows[-1], flush=True)
    out = Path(args.out)
    result = {
        "command": "ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/solve_accuracy.py",
        "machine": machine_info(),
        "model": "SmolLM2-135M, top 8 of 30 blocks fine-tuned on the canaries (seed 0)",
        "d": int(memorization.shape[0]),
        "statistics": f"{len(texts)} calibration rows, {len(data.general_rows)} general rows",
        "singular_values": spectra,
        "rows": rows,
    }
    write_json(out / "results.json", result)
    header = ["block", "K", "iterations", "ran", "steer / probe min cos", "sv rel. error"]
    table = markdown_table(
        header,
        [
            [
                r["layer"],
                r["rank"],
                r["iterations"],
                f"{r['ran']}" + ("" if r["converged"] else " (not settled)"),
                f"{r['steer_min_cos']:.6f} / {r['probe_min_cos']:.6f}",
                f"{r['singular_value_rel_error']:.1e}",
            ]
            for r in rows
        ],
    )
    tops = "; ".join(
        f"block {layer}: " + ", ".join(f"{v:.3f}" for v in values[:8])
        for layer, values in spectra.items()
    )
    (out / "table.md").write_text(
        "# Truncated vs full solve on real statistics\n\n"
        f"`{result['command']}`; {result['model']}, d = {result['d']}; "
        f"{result['statistics']}. Each truncated solve is compared with the full SVD of the "
        "same statistics: the smallest |cosine| between matching steer (probe) directions, and "
        "the largest relative error of a singular value.\n\n"
        f"Top singular values of the whitened memorization matrix: {tops}.\n\n{table}\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
