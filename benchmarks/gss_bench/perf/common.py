"""Shared pieces of ``gss bench perf``: sizes, the tiny model, and interleaved timing.

This machine's timings vary 2-4x between runs, so nothing here reports a single wall time:
the arms of a comparison run in rounds (every arm once a round, in a fresh order) after
warm-up, and a speed is read as the median of the per-round ratios, which cancels drift that
hits both arms.

On CUDA, kernels run asynchronously: every timed span starts and ends with ``sync`` (or a
``syncer``), so a timer reads finished work. On CPU both are no-ops.
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Sizes:
    """Every size the benchmark uses; ``QUICK`` shrinks them for the smoke test."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 2048
    # inference overhead
    prompt_len: int = 16
    new_tokens: int = 32
    batch_sizes: tuple[int, ...] = (1, 16)
    ranks: tuple[int, ...] = (1, 4, 16)
    peer_rank: int = 4
    overhead_repeats: int = 21
    hook_calls: int = 2000
    warmup: int = 2
    artifact_texts: int = 64
    model_new_tokens: int = 16
    model_repeats: int = 7
    model_warmup: int = 1
    # calibration cost
    calib_texts: int = 256
    text_len: int = 32
    calib_batch: int = 8
    calib_rank: int = 4
    calib_repeats: int = 5
    # solve scaling
    solve_dims: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    solve_ranks: tuple[int, ...] = (1, 8, 64)
    solve_repeats: int = 3
    solve_big_d: int = 4096  # from this d on, one run per point
    max_full_d: int = 4096
    # memory
    memory_texts: tuple[int, ...] = (100, 400, 1600, 6400)


QUICK = Sizes(
    hidden=64,
    layers=2,
    vocab=256,
    prompt_len=8,
    new_tokens=4,
    batch_sizes=(1, 4),
    overhead_repeats=2,
    hook_calls=20,
    warmup=1,
    artifact_texts=16,
    model_new_tokens=4,
    model_repeats=1,
    calib_texts=24,
    text_len=12,
    calib_repeats=2,
    solve_dims=(64, 128),
    solve_repeats=2,
    memory_texts=(8, 32),
)


def log(message: str) -> None:
    print(f"[perf {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync(device: torch.device | str) -> None:
    """Wait until every kernel queued on ``device`` has finished, so a timer read next is real.

    CUDA launches return before the work is done; on CPU every op has finished when it
    returns, so this does nothing there (CPU timings stay comparable with earlier runs).
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _nothing() -> None:
    return None


def syncer(device: torch.device | str) -> Callable[[], None]:
    """``sync`` bound to ``device``, resolved once: for timers around microsecond spans
    (a hook call, a decode step), where even the device check would show. On CPU a function
    that does nothing."""
    if torch.device(device).type == "cuda":
        return partial(torch.cuda.synchronize, device)
    return _nothing


def peak_rss_mb() -> float:
    """This process's peak resident memory. Linux: ``VmHWM`` from /proc, which starts afresh
    at exec; ``ru_maxrss`` does not (it inherits the parent's peak across fork + exec, so a
    child of a big process would report the parent's peak)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def run_child(
    module: str, args: Sequence[str], *, quick: bool, threads: int | None, what: str
) -> dict[str, Any]:
    """Run ``python -m module args`` in a fresh interpreter (a peak RSS is a process-wide
    high-water mark) and return the JSON line it prints last."""
    cmd = [sys.executable, "-m", module, *args]
    if quick:
        cmd.append("--quick")
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return record


def tiny_model(
    sizes: Sizes,
    seed: int = 0,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A small Llama with random weights, built from a config (no download), in eval mode.

    The weights are drawn in float32 on the CPU and then moved, so every device and dtype
    starts from the same model (the default is a no-op move)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=sizes.hidden,
        intermediate_size=2 * sizes.hidden,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.heads,
        vocab_size=sizes.vocab,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model: nn.Module = LlamaForCausalLM(config)  # nn.Module's `to` (HF's wrapper is untyped)
    return freeze(model.to(device=device, dtype=dtype))


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no weight gradients: what calibration and inference both run with."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def perturbed_copy(model: nn.Module, scale: float = 0.02, seed: int = 1) -> nn.Module:
    """A stand-in reference model: the same weights plus a little noise, so omega = log p_model -
    log p_ref is small and of both signs, as between a fine-tuned model and its base."""
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype)
            p.add_(noise * (scale * float(p.float().std().clamp_min(1e-8))))
    return freeze(ref)


def random_ids(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Token ids drawn uniformly from the vocabulary (above the special ids 0-2)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen)


def interleaved(
    arms: Mapping[str, Callable[[], float]],
    repeats: int,
    warmup: int,
    desc: str,
    progress: bool,
) -> dict[str, list[float]]:
    """Run every arm ``warmup`` times, then ``repeats`` rounds, each in a fresh order.

    The order of round r is a permutation drawn with seed r, so no arm keeps a place (with the
    order reversed each round, the two end arms ran twice in a row at every round boundary;
    measured apart, that moved the ratios by less than the noise: docs/scaling.md).
    Each arm times itself and returns seconds, so set-up outside its measured span is free.
    """
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in tqdm(range(repeats), desc=desc, disable=not progress, leave=False):
        order = names[:]
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(arms[name]())
    return times


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of repeated measurements."""
    xs = sorted(float(v) for v in values)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {
        "median": statistics.median(xs),
        "q1": q1,
        "q3": q3,
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
    }


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-round ratios of two arms measured in the same rounds."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]
