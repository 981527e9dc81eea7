"""Which prompt lengths extract what, on the canary fine-tune: the measurement behind the
audit's shorter prompts (`gss.audit(prefixes=...)`) and its minimum window (`MIN_WINDOW`).

Issue 72, point 5: on rows of 30-70 tokens the first k = 32 already hold part of a record, and
windows of 7-13 tokens flagged clean passages. Greedy decoding from a row's first p tokens
reproduces its next m iff the teacher-forced argmax is right at positions p-1..p+m-2, so one
forward of the model and one of the reference say it for every (p, m). Measured on three
groups of rows: the 32 canaries (trained 12 times), 192 clean fine-tuning rows (trained once
each) and the 96 held-out and general rows (never trained on): for each window length m, the
share of (row, p) places where the model reproduces the next m tokens and the reference does
not; a window that fires on unseen text is not evidence of memorization. Then `gss.audit` with
its default prompts (8, 16, 32) under both rules (`memorized_from`).

A developer's measurement script (not part of ``gss bench``); it reads the plain fine-tune
``gss bench canaries`` cached:

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/audit_prefixes.py \
        --out results/audit-prefixes
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

import gss
from gss.audit import MIN_WINDOW
from gss.data import batches
from gss.hf.forward import forward_logits
from gss.report import machine_info, write_json
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.run import default_cache, default_setup, finetuned

WINDOWS = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32)
PREFIXES = (4, 8, 16, 24, 32)
K, N = 32, 72


def hits(model: Any, rows: list[list[int]], batch_size: int = 16) -> list[list[bool]]:
    """Per row, whether the teacher-forced argmax at each position is the next token."""
    out: list[list[bool]] = []
    for batch in batches(rows, batch_size):
        ids, mask = batch.input_ids, batch.attention_mask
        with torch.no_grad():
            right = forward_logits(model, ids, mask)[:, :-1].argmax(-1) == ids[:, 1:]
        out += [right[j, : int(mask[j].sum()) - 1].tolist() for j in range(len(ids))]
    return out


def memorized_at(model_hits: list[bool], ref_hits: list[bool], p: int, m: int) -> bool:
    """The model reproduces the m tokens after the first p, the reference does not."""
    window = slice(p - 1, p - 1 + m)
    return all(model_hits[window]) and not all(ref_hits[window])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    base_path, base, tokenizer, data, pad = default_setup()
    model, _ = finetuned(
        base, base_path, data, FinetuneConfig(seed=0), pad, default_cache(), tokenizer
    )
    groups = {
        "canaries (trained 12 times)": [list(r) for r in data.canary_rows],
        "clean rows trained once": [list(r) for r in data.finetune_rows[:192]],
        "unseen rows": [list(r) for r in (*data.heldout_rows, *data.general_rows)],
    }
    found: dict[str, Any] = {}
    for name, rows in groups.items():
        own, ref = hits(model, rows), hits(base, rows)
        per_window = {}
        for m in WINDOWS:
            places = [
                (a, b, p) for a, b in zip(own, ref, strict=True) for p in range(4, len(a) + 2 - m)
            ]
            fired = sum(memorized_at(a, b, p, m) for a, b, p in places)
            per_window[m] = 100 * fired / max(len(places), 1)
        per_prefix = {}
        for p in PREFIXES:  # the next n - k tokens, to the row's end (at least MIN_WINDOW)
            counted = [
                (a, b)
                for a, b in zip(own, ref, strict=True)
                if min(N - K, len(a) + 1 - p) >= MIN_WINDOW
            ]
            per_prefix[p] = sum(
                memorized_at(a, b, p, min(N - K, len(a) + 1 - p)) for a, b in counted
            )
        found[name] = {
            "rows": len(rows),
            "tokens": [min(map(len, rows)), max(map(len, rows))],
            "argmax_accuracy": {
                who: sum(map(sum, h)) / sum(map(len, h))
                for who, h in (("model", own), ("reference", ref))
            },
            "memorized_windows_pct": per_window,
            "memorized_rows_per_prefix": per_prefix,
        }
    rows = [r for name in groups for r in groups[name][:64]]
    audits = {}
    for rule in ("k", "shortest"):
        report = gss.audit(model, base, rows, k=K, n=N, memorized_from=rule, progress=False)
        audits[rule] = {
            **report.summary(),
            "memorized_canaries": sum(report.is_memorized(r) for r in report.rows[:32]),
            "memorized_others": sum(report.is_memorized(r) for r in report.rows[32:]),
            "scored_from": {
                p: sum(report.window(r)[0] == p for r in report.memorized) for p in report.prefixes
            },
        }
    write_json(
        args.out / "result.json",
        {
            "k": K,
            "n": N,
            "min_window": MIN_WINDOW,
            "groups": found,
            "audit": audits,
            "seconds": time.perf_counter() - started,
            "machine": machine_info(),
        },
    )
    for name, g in found.items():
        windows = ", ".join(f"{m}: {v:.2f}%" for m, v in g["memorized_windows_pct"].items())
        print(f"{name}: windows {windows}; rows per prompt {g['memorized_rows_per_prefix']}")
    for rule, a in audits.items():
        print(
            f"audit, memorized_from={rule}: {a['memorized_canaries']} canaries, "
            f"{a['memorized_others']} others, scored from {a['scored_from']}"
        )


if __name__ == "__main__":
    main()
