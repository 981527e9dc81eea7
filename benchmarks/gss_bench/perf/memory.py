"""Peak memory of calibration vs corpus size, each size in a fresh process.

A peak is a high-water mark for the whole process, so every corpus size gets its own
interpreter (``python -m gss_bench.perf.memory --texts N``): it builds the models and data,
records the peak so far, calibrates, and prints both peaks as one JSON line. The statistics are
O(d^2) and the token streams are folded in batch by batch, so the increase should not grow
with the corpus.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from gss.report import markdown_table
from gss_bench.perf.common import QUICK, Sizes, log, peak_rss_mb, run_child


def child(argv: Sequence[str] | None = None) -> int:
    """One calibration at one corpus size; prints a JSON line with the peaks."""
    p = argparse.ArgumentParser(prog="python -m gss_bench.perf.memory")
    p.add_argument("--texts", type=int, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--keep-general", type=int, default=None, help="calibrate's keep_general (0: stream)"
    )
    args = p.parse_args(argv)
    import torch

    from gss.calibrate import calibrate
    from gss.hf.forward import forward_logits
    from gss_bench.perf.common import perturbed_copy, random_ids, tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()
    model = tiny_model(sizes)
    reference = perturbed_copy(model)
    ids = random_ids(args.texts, sizes.text_len, sizes.vocab, seed=5)
    with torch.no_grad():  # touch the kernels once, so the baseline includes their buffers
        warm = ids[: sizes.calib_batch]
        forward_logits(model, warm, torch.ones_like(warm))
    before = peak_rss_mb()
    start = time.perf_counter()
    artifact = calibrate(
        model,
        reference,
        ids,
        "gss",
        layer=sizes.layers // 2,
        rank=sizes.calib_rank,
        batch_size=sizes.calib_batch,
        keep_general=args.keep_general,
        progress=False,
    )
    seconds = time.perf_counter() - start
    after = peak_rss_mb()
    record = {
        "texts": args.texts,
        "tokens": int(ids.numel()),
        "memorized_tokens": artifact.provenance.token_counts["memorized"],
        "peak_rss_before_mb": before,
        "peak_rss_mb": after,
        "calibration_increase_mb": after - before,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(record))
    return 0


def _series(
    sizes: Sizes, quick: bool, threads: int | None, progress: bool, keep_general: int | None
) -> list[dict[str, Any]]:
    """One fresh process per corpus size, all with the same ``keep_general``."""
    rows = []
    label = "default" if keep_general is None else f"keep_general={keep_general}"
    for n in tqdm(sizes.memory_texts, desc=f"memory ({label})", disable=not progress, leave=False):
        args = ["--texts", str(n)]
        if keep_general is not None:
            args += ["--keep-general", str(keep_general)]
        record = run_child(
            "gss_bench.perf.memory",
            args,
            quick=quick,
            threads=threads,
            what=f"memory child for {n} texts",
        )
        rows.append(record)
        log(
            f"memory ({label}): {n} texts, peak {record['peak_rss_mb']:.0f} MB "
            f"(+{record['calibration_increase_mb']:.1f} MB during calibration)"
        )
    return rows


def run(sizes: Sizes, *, quick: bool, threads: int | None, progress: bool) -> dict[str, Any]:
    rows = _series(sizes, quick, threads, progress, None)
    # keep_general=0: the thresholds take a second pass instead of keeping general tokens'
    # hidden states, so what is left of the growth is everything else calibration holds
    streaming = _series(sizes, quick, threads, progress, 0)
    d = sizes.hidden
    return {
        "method": (
            "peak RSS (VmHWM) of a fresh process per corpus size: after building "
            "the tiny model, its perturbed reference and the token ids (before), and after "
            "gss.calibrate (peak); the increase is calibration's own high-water mark"
        ),
        "model": {"hidden": d, "layers": sizes.layers, "vocab": sizes.vocab},
        "statistics_mb": 2 * d * d * 8 / 2**20,  # the float64 Sigma scatter and M
        "kept_general_cap_mb": 2**24 * 4 / 2**20,  # calibrate's default keep_general, float32
        "rows": rows,
        "growth_mb": rows[-1]["calibration_increase_mb"] - rows[0]["calibration_increase_mb"],
        "streaming_rows": streaming,
        "streaming_growth_mb": streaming[-1]["calibration_increase_mb"]
        - streaming[0]["calibration_increase_mb"],
    }


def table(result: dict[str, Any]) -> str:
    if "skipped" in result:  # --device / --dtype other than cpu / float32: nothing measured
        return f"Skipped: {result['skipped']}.\n"
    header = ["texts", "tokens", "peak RSS MB", "calibration increase MB", "calibrate s"]
    streaming = result.get("streaming_rows")
    if streaming:
        header += ["keep_general=0: increase MB", "calibrate s"]
    rows = [
        [
            r["texts"],
            r["tokens"],
            f"{r['peak_rss_mb']:.0f}",
            f"{r['calibration_increase_mb']:.1f}",
            f"{r['seconds']:.2f}",
        ]
        + (
            [f"{streaming[i]['calibration_increase_mb']:.1f}", f"{streaming[i]['seconds']:.2f}"]
            if streaming
            else []
        )
        for i, r in enumerate(result["rows"])
    ]
    cap = result.get("kept_general_cap_mb")
    return markdown_table(header, rows) + (
        f"\nIncrease from the smallest to the largest corpus: {result['growth_mb']:+.1f} MB "
        f"(the d x d float64 statistics are ~{result['statistics_mb']:.1f} MB)."
        + (
            f" The increase includes the general tokens' hidden states that calibration keeps "
            f"so that the thresholds need no second pass, at most {cap:.0f} MB (2^24 floats, "
            f"`keep_general`); past that it drops them and makes a second pass instead."
            if cap
            else ""
        )
        + (
            f" With `keep_general=0` (always the second pass, nothing kept) the increase grows "
            f"by {result['streaming_growth_mb']:+.1f} MB over the same corpora.\n"
            if streaming
            else "\n"
        )
    )


if __name__ == "__main__":
    raise SystemExit(child())
