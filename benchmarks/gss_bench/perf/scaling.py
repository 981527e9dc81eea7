"""Solve scaling: ``solve_probe_steer`` time vs hidden size d and rank K, full vs truncated SVD.

M is low rank plus noise and Sigma_gen a decaying-spectrum covariance plus a diagonal, like
real statistics. The full SVD is O(d^3) whatever K; the randomized one is O(d^2 K) after the
Cholesky factor (itself O(d^3) but with a small constant), so the gap widens with d.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gss.report import markdown_table
from gss.solve.whitened import ProbeSteer, SolveMethod, solve_probe_steer
from gss_bench.perf.common import Sizes, interleaved, log, paired_ratios, summary, sync

GOAL = {"d": 4096, "rank": 8, "seconds": 2.0}
_DEFAULTS = {name: p.default for name, p in inspect.signature(solve_probe_steer).parameters.items()}


def synthetic(d: int, seed: int = 0, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(M, Sigma) in float64 on ``device``: M = A B^T / r + noise, Sigma = G G^T / q + diagonal
    (SPD). The random draws come from one CPU generator, so every device solves the same
    statistics; the products are formed on the device."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=f64).to(device)

    r, q = min(d, 32), min(d, 256)
    a = randn(d, r)
    b = randn(d, r)
    m = a @ b.T / r
    m += 0.01 * randn(d, d)
    g = randn(d, q)
    g *= torch.arange(1, q + 1, dtype=f64, device=device).rsqrt()
    sigma = g @ g.T / q
    sigma = (sigma + sigma.T) / 2
    sigma += torch.diag(0.05 + 0.45 * torch.rand(d, generator=gen, dtype=f64).to(device))
    return m, sigma


def _timer(
    m: Tensor, sigma: Tensor, k: int, method: SolveMethod, results: dict[str, Any]
) -> Callable[[], float]:
    """An arm that solves once with ``method``, keeps the solution and returns its seconds."""

    def arm() -> float:
        sync(m.device)
        start = time.perf_counter()
        results[method] = solve_probe_steer(m, sigma, k, method=method)
        sync(m.device)
        return time.perf_counter() - start

    return arm


def accuracy(exact: ProbeSteer, approx: ProbeSteer) -> dict[str, float]:
    """How far the truncated solution is from the full one: the largest relative error of a
    singular value, and the smallest |cosine| between matching steer (and probe) directions,
    which a bare singular-value error hides (a value can be within 1% while its direction is
    far off)."""
    s_full, s_trunc = exact.singular_values, approx.singular_values
    return {
        "singular_value_rel_error": float(
            ((s_full - s_trunc).abs() / s_full.abs().clamp_min(1e-300)).max()
        ),
        "steer_min_cos": float(
            torch.nn.functional.cosine_similarity(exact.steer, approx.steer, dim=1).abs().min()
        ),
        "probe_min_cos": float(
            torch.nn.functional.cosine_similarity(exact.probe, approx.probe, dim=1).abs().min()
        ),
    }


def run(
    sizes: Sizes,
    *,
    max_full_d: int | None,
    progress: bool,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    limit = sizes.max_full_d if max_full_d is None else max_full_d
    small_m, small_s = synthetic(sizes.solve_dims[0], device=device)
    methods: tuple[SolveMethod, ...] = ("full", "truncated")
    for method in methods:  # warm-up: LAPACK/BLAS (or cuSOLVER/cuBLAS) initialisation
        solve_probe_steer(small_m, small_s, 1, method=method)
    del small_m, small_s
    rows = []
    for d in sizes.solve_dims:
        t0 = time.perf_counter()
        m, sigma = synthetic(d, device=device)
        sync(device)
        log(f"solve: d={d} data built in {time.perf_counter() - t0:.1f} s")
        repeats = 1 if d >= sizes.solve_big_d else sizes.solve_repeats
        for k in sizes.solve_ranks:
            if k > d:
                continue
            results: dict[str, Any] = {}
            arms = {"truncated": _timer(m, sigma, k, "truncated", results)}
            skipped = None
            if d <= limit:
                arms["full"] = _timer(m, sigma, k, "full", results)
            else:
                skipped = (
                    f"full SVD skipped above d={limit} (O(d^3) in time, several d x d float64 "
                    "copies in memory); raise --max-full-d to run it"
                )
            times = interleaved(arms, repeats, 0, f"solve d={d} K={k}", progress)
            row: dict[str, Any] = {
                "d": d,
                "rank": k,
                "repeats": repeats,
                "truncated": summary(times["truncated"]),
                "full": summary(times["full"]) if "full" in times else {"skipped": skipped},
            }
            truncated = results["truncated"]
            row["power_iters"] = truncated.power_iters
            row["converged"] = truncated.converged
            if "full" in times:
                row["full_over_truncated"] = summary(
                    paired_ratios(times["full"], times["truncated"])
                )
                row.update(accuracy(results["full"], truncated))
            if d == GOAL["d"] and k == GOAL["rank"]:
                row["goal_seconds"] = GOAL["seconds"]
                row["goal_met"] = row["truncated"]["median"] < GOAL["seconds"]
            rows.append(row)
            full_txt = f"{row['full']['median']:.3f} s" if "median" in row["full"] else "skipped"
            log(f"solve d={d} K={k}: truncated {row['truncated']['median']:.3f} s, full {full_txt}")
        del m, sigma
    return {
        "method": (
            "solve_probe_steer(M, Sigma, K) on synthetic float64 statistics (M low rank + "
            "noise, Sigma decaying spectrum + diagonal), method 'full' vs 'truncated' "
            f"(randomized SVD, oversample {_DEFAULTS['oversample']}, subspace iterations until "
            f"the top-K singular values move by < {_DEFAULTS['tol']:g}), run in turn; median of "
            f"{sizes.solve_repeats} runs (1 from d={sizes.solve_big_d}). float64 whatever "
            "--dtype (calibration's statistics are float64); on CUDA each solve starts and ends "
            "with torch.cuda.synchronize (a no-op on CPU)."
        ),
        "device": str(device),
        "goal": f"d={GOAL['d']}, K={GOAL['rank']} under {GOAL['seconds']} s",
        "max_full_d": limit,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    header = [
        "d",
        "K",
        "truncated s",
        "full s",
        "full / truncated",
        "iterations",
        "sv rel. error",
        "steer / probe min cos",
        "goal",
    ]
    rows = []
    for r in result["rows"]:
        full = r["full"]
        rows.append(
            [
                r["d"],
                r["rank"],
                f"{r['truncated']['median']:.3f}",
                f"{full['median']:.3f}" if "median" in full else "skipped",
                f"{r['full_over_truncated']['median']:.2f}" if "full_over_truncated" in r else "--",
                str(r.get("power_iters", "--"))
                + ("" if r.get("converged", True) else " (not settled)"),
                f"{r['singular_value_rel_error']:.1e}" if "singular_value_rel_error" in r else "--",
                f"{r['steer_min_cos']:.6f} / {r['probe_min_cos']:.6f}"
                if "steer_min_cos" in r
                else "--",
                ("met" if r["goal_met"] else "missed") + f" (< {r['goal_seconds']:g} s)"
                if "goal_met" in r
                else "",
            ]
        )
    return markdown_table(header, rows)
