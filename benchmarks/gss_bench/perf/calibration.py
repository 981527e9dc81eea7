"""Calibration cost: ``gss.calibrate`` against the passes any gradient-based calibration needs.

The baseline runs, over the same batches, exactly the work that cannot be avoided: the
reference forward (no grad) and the model forward with the layer-L output as a leaf, then one
backward of the summed log-likelihood down to that leaf (weights frozen, as in calibration).
Everything gss adds on top (omega, the token split, the O(d^2) statistics, the solve, the
partial threshold pass) is the overhead the ratio measures.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gss.calibrate import calibrate
from gss.data import batches, encode
from gss.hf.blocks import resolve_layer
from gss.hf.forward import forward_logits, target_mask, token_logprobs
from gss.report import markdown_table
from gss.steering.attach import split_block_output
from gss_bench.perf.common import (
    Sizes,
    interleaved,
    log,
    paired_ratios,
    perturbed_copy,
    random_ids,
    summary,
    sync,
    tiny_model,
)

PHASES = ("signal", "statistics", "solve", "thresholds")


class _Leaf:
    """Forward hook that makes the block output a leaf requiring grad (and remembers it)."""

    def __init__(self) -> None:
        self.hidden: Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden, rebuild = split_block_output(output)
        self.hidden = hidden.detach().requires_grad_(True)
        return rebuild(self.hidden)


def unavoidable_passes(
    model: nn.Module, reference: nn.Module, seqs: list[list[int]], layer: int, batch_size: int
) -> None:
    """Reference forward + model forward + backward to block ``layer``, batch by batch."""
    _, block = resolve_layer(model, layer)
    leaf = _Leaf()
    handle = block.register_forward_hook(leaf)
    try:
        for batch in batches(seqs, batch_size):
            with torch.no_grad():
                forward_logits(reference, batch.input_ids, batch.attention_mask)
            with torch.enable_grad():
                logits = forward_logits(model, batch.input_ids, batch.attention_mask)
                lp = token_logprobs(logits, batch.input_ids)
                valid = target_mask(batch.attention_mask).to(lp.device)
                objective = (lp * valid).sum()
                assert leaf.hidden is not None
                torch.autograd.grad(objective, leaf.hidden)
            leaf.hidden = None
    finally:
        handle.remove()


def run(
    sizes: Sizes,
    *,
    repeats: int | None,
    progress: bool,
    out: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    model = tiny_model(sizes, device=device, dtype=dtype)
    reference = perturbed_copy(model)
    # the ids stay on the CPU, as a user's token ids do: both arms batch them on the CPU and
    # move every batch to the model's device (ids on the GPU would make calibrate's batching
    # copy them back row by row, a cost no real run pays)
    ids = random_ids(sizes.calib_texts, sizes.text_len, sizes.vocab, seed=3)
    seqs = encode(ids)
    layer = sizes.layers // 2
    kwargs: dict[str, Any] = {
        "layer": layer,
        "rank": sizes.calib_rank,
        "batch_size": sizes.calib_batch,
        "progress": False,
    }
    phase_runs: list[dict[str, float]] = []
    last: dict[str, Any] = {}

    def calib() -> float:
        sync(device)
        start = time.perf_counter()
        artifact = calibrate(model, reference, ids, "gss", **kwargs)
        sync(device)
        elapsed = time.perf_counter() - start
        phase_runs.append(dict(artifact.provenance.timings))
        last["artifact"] = artifact
        return elapsed

    def passes() -> float:
        sync(device)
        start = time.perf_counter()
        unavoidable_passes(model, reference, seqs, layer, sizes.calib_batch)
        sync(device)
        return time.perf_counter() - start

    times = interleaved(
        {"calibrate": calib, "passes": passes},
        repeats or sizes.calib_repeats,
        1,
        "calibration cost",
        progress,
    )
    phase_runs = phase_runs[-len(times["calibrate"]) :]  # drop the warm-up run
    ratios = paired_ratios(times["calibrate"], times["passes"])
    profile_path = out / "profile.txt"
    write_profile(lambda: calibrate(model, reference, ids, "gss", **kwargs), profile_path)
    artifact = last["artifact"]
    phases = {
        name: summary([run[name] for run in phase_runs])
        for name in (*PHASES, "total")
        if all(name in run for run in phase_runs)
    }
    result = {
        "method": (
            "gss.calibrate (statistics, solve, thresholds) vs the unavoidable passes over the "
            "same batches (reference forward + model forward + backward of the summed "
            "log-likelihood to the block-L output, weights frozen); interleaved after one "
            "warm-up each; ratio = median over rounds of calibrate seconds / passes seconds. "
            "On CUDA each call starts and ends with torch.cuda.synchronize (a no-op on CPU); "
            "the phase split is calibrate's own timers, which do not synchronize."
        ),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "goal": "<= 1.2",
        "model": {"hidden": sizes.hidden, "layers": sizes.layers, "vocab": sizes.vocab},
        "texts": sizes.calib_texts,
        "text_len": sizes.text_len,
        "tokens": int(ids.numel()),
        "batch_size": sizes.calib_batch,
        "layer": layer,
        "rank": sizes.calib_rank,
        "token_counts": artifact.provenance.token_counts,
        "seconds": {"calibrate": summary(times["calibrate"]), "passes": summary(times["passes"])},
        "raw_seconds": times,
        "ratio": summary(ratios),
        "phases": phases,
        "profile": profile_path.name,
    }
    log(
        f"calibration: {result['seconds']['calibrate']['median']:.2f} s vs passes "
        f"{result['seconds']['passes']['median']:.2f} s, ratio {result['ratio']['median']:.3f}"
    )
    return result


def write_profile(fn: Any, path: Path, top: int = 15) -> Path:
    """cProfile of one call: the top functions by cumulative and by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    buf = io.StringIO()
    buf.write(f"cProfile of one gss.calibrate call: top {top} by cumulative time\n")
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(top)
    buf.write(f"\n\ntop {top} by own (total) time\n")
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(top)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())
    return path


def table(result: dict[str, Any]) -> str:
    s = result["seconds"]
    rows: list[list[Any]] = [
        ["unavoidable passes (ref fwd + model fwd + bwd to layer L)", s["passes"]["median"], ""],
        ["gss.calibrate", s["calibrate"]["median"], f"{result['ratio']['median']:.3f}"],
    ]
    for name, phase in result["phases"].items():
        if name != "total":
            rows.append([f"  phase: {name}", phase["median"], ""])
    header = ["", "seconds (median)", "calibrate / passes"]
    text = markdown_table(header, [[r[0], f"{r[1]:.3f}", r[2]] for r in rows])
    r = result["ratio"]
    return text + (
        f"\n{result['texts']} texts x {result['text_len']} tokens, batch {result['batch_size']}, "
        f"K={result['rank']}; ratio IQR {r['q1']:.3f}-{r['q3']:.3f} over {r['n']} rounds; "
        f"profile in {result['profile']}.\n"
    )
