"""The reference where a gate opens, on TinyMem (issue 72): which steps should the reference
decide, where the steer's gates find few of the memorized positions?

`gss protect`'s report on TinyMem math noise said that with the reference's token where a gate
opens (`gss.reference_where_open`, its defaults) 64.6% of the held-out memorized rows were
still reproduced, where on the canaries none was. This runs `gss protect` by its defaults on a
setting's cached models (`gss bench tinymem` trains them), then generates greedily from the
held-out memorized prompts and from the clean validation rows' prompts under each hand-over
rule: the steer's gates or none (``steer=None``: the signal alone decides, the reference runs
at every step), `min_confidence` and `min_signal`. It also reads, teacher-forced over the
held-out windows, on how many of the positions that choose a memorized token (the fine-tune's
token more than 1 nat likelier under it than under the reference) some gate opens.

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=benchmarks .venv/bin/python \\
        benchmarks/scripts/handoff_tinymem.py --settings math_noise --out /tmp/handoff-tinymem

``--reports results/tinymem-amd-epyc`` reads the committed reports' steers and splits instead
of running protect (seconds, not minutes, a setting).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gss import load
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.utility import perplexity, repetition
from gss.inference.handoff import reference_where_open
from gss.protect import protect
from gss.protect.measure import prompt_and_target
from gss.report import machine_info, markdown_table, write_json
from gss_bench.gate_reading import reading_gates
from gss_bench.tinymem import methods as M
from gss_bench.tinymem.protection import protect_arguments
from gss_bench.tinymem.train import get_models

Rule = tuple[bool, float | None, float | None]  # (gates, min_confidence, min_signal)
RULES: list[Rule] = [
    (True, 0.98, 1.0),  # reference_where_open's defaults
    (True, None, 1.0),
    (True, None, None),
    (False, 0.98, 1.0),
    (False, 0.9, 1.0),
    (False, 0.98, 2.0),
    (False, None, 1.0),
]


def gates_on_memorized(
    model: Any, steer: Any, reference: Any, windows: list[tuple[list[int], list[int]]]
) -> dict[str, float]:
    """Teacher-forced over each (prompt, window): the share of window positions that choose a
    memorized token (signal > 1 nat) where some gate opens, and of the others."""
    memorized, opened = [], []
    with reading_gates(model, steer) as seen:
        for prompt, window in windows:
            ids = torch.tensor([list(prompt) + list(window)])
            seen.clear()
            with torch.no_grad():
                mine = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]
                theirs = reference(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]
            target = ids[0, 1:, None]
            start = len(prompt) - 1  # the positions that choose the window's tokens
            signal = (mine.gather(-1, target) - theirs.gather(-1, target))[start:, 0]
            memorized.append(signal > 1.0)
            opened.append(torch.stack(seen).any(0)[:-1][start:])
    mem, gate = torch.cat(memorized), torch.cat(opened)
    return {
        "memorized_positions": int(mem.sum()),
        "gate_open_memorized": 100.0 * float(gate[mem].float().mean()),
        "gate_open_other": 100.0 * float(gate[~mem].float().mean()),
    }


class SteeredView(torch.nn.Module):
    """``model`` with ``steer`` attached for each forward: handed to `reference_where_open` as
    its "reference", the steer's scores replace the fine-tune's only at the steps where a gate
    opens, the fine-tune is sure and the steer moves its choice by more than ``min_signal``."""

    def __init__(self, model: Any, steer: Any) -> None:
        super().__init__()
        self.inner = [model]  # not a submodule: its parameters are the fine-tune's
        self.steer = steer
        self.config = model.config

    def get_base_model(self) -> Any:
        return self.inner[0]

    def forward(self, **inputs: Any) -> Any:
        with warnings.catch_warnings():  # the gates' reading hooks are already on the blocks
            warnings.simplefilter("ignore")
            with self.steer.attach(self.inner[0]):
                return self.inner[0](**inputs)


def from_report(report: Path) -> SimpleNamespace:
    """A committed protect report's steer and held-out rows (indices into the rows protect
    got; every TinyMem row is checkable, so the audit's row i is row i), as `run` reads them
    from a fresh `protect`."""
    record = json.loads((report / "protect.json").read_text())
    if record["audit"]["checkable"] != record["audit"]["rows"]:
        raise SystemExit(f"{report}: some rows were not checkable; rerun protect instead")
    return SimpleNamespace(
        steer=load(report / "steer"),
        heldout=record["split"]["heldout"],
        chosen=record["chosen"],
        seconds=record["seconds"],
        report_seconds=record["report_seconds"],
        handover=record["handover"],
    )


def run(
    setting: str, seed: int, rules: list[Rule], sure: bool, reports: Path | None = None
) -> list[dict[str, Any]]:
    mem, ref, data, _ = get_models(setting, "default", seed, None, progress=False)
    arguments = protect_arguments(data, 256)
    started = time.perf_counter()
    if reports is not None:  # the committed report's steer and split: no protect run
        result: Any = from_report(reports / f"protect_{setting}_seed{seed}")
    else:
        result = protect(mem, ref, seed=seed, progress=False, **arguments)
    seconds = time.perf_counter() - started
    if result.steer is None:
        raise SystemExit(f"{setting} seed {seed}: protect found no steer within the budget")
    k, n, pad = arguments["k"], arguments["n"], data.pad_id
    texts = arguments["texts"]
    held = [texts[i if reports is not None else result.audit.rows[i].index] for i in result.heldout]
    windows = [prompt_and_target(r, k, n) for r in held]
    prompts = [p for p, _ in windows]
    # a backdoor pair's window may be shorter than n - k: each row's own length
    width = max(len(t) for _, t in windows)
    # clean prompts: the window's prompt length, or (a backdoor's k = 1) each row's first half
    clean = [list(r[: k if k > 1 else len(r) // 2]) for r in M.general_rows(data)[:128]]
    clean = [c for c in clean if c]

    def generate(processor: Any, rows: list[list[int]]) -> list[list[int]]:
        return greedy_generate(mem, rows, width, pad_id=pad, batch_size=64, processor=processor)

    def reproduced(out: list[list[int]]) -> float:
        same = [list(o[: len(t)]) == list(t) for o, (_, t) in zip(out, windows, strict=True)]
        return 100.0 * sum(same) / max(len(same), 1)

    def ppl(out: list[list[int]]) -> float:
        rows = [list(p) + list(o) for p, o in zip(prompts, out, strict=True)]
        return perplexity(ref, rows, pad, batch_size=64, prompt_lengths=[len(p) for p in prompts])

    plain_clean = generate(None, clean)
    own = greedy_generate(ref, prompts, width, pad_id=pad, batch_size=64)
    base = {
        "setting": setting,
        "seed": seed,
        "chosen": str(result.chosen),
        "protect_seconds": seconds if reports is None else None,  # None: read from a report
        "protect_steps_seconds": result.seconds,
        "report_seconds": result.report_seconds,
        # protect's step 8: each hand-over rule on the tuning rows, and the one it chose
        "handover": result.handover,
        "heldout_rows": len(held),
        "reference_repeated_4grams": repetition(own),
        "reference_own_ppl": ppl(own),
    }
    base |= gates_on_memorized(mem, result.steer, ref, windows)
    records: list[dict[str, Any]] = []

    def add(rule: str, out: list[list[int]], clean_out: list[list[int]], handed: Any) -> None:
        records.append(
            {
                **base,
                "rule": rule,
                "reproduced": reproduced(out),
                "repeated_4grams": repetition(out),
                "reference_ppl": ppl(out),
                "clean_unchanged": 100.0
                * sum(a == b for a, b in zip(clean_out, plain_clean, strict=True))
                / len(clean),
                "handed_share": handed,
            }
        )
        print(json.dumps(records[-1], default=float), flush=True)

    add("the fine-tune", generate(None, prompts), plain_clean, None)
    with result.steer.attach(mem):
        add("the steer alone", generate(None, prompts), generate(None, clean), None)
    for gates, confidence, signal in rules:
        steer = result.steer if gates else None
        rule = partial(
            reference_where_open, mem, steer, ref, min_confidence=confidence, min_signal=signal
        )
        with rule() as processor:
            out = generate(processor, prompts)
        with rule() as on_clean:
            clean_out = generate(on_clean, clean)
        name = (
            f"{'the steer’s gates' if gates else 'no gate'}, confidence >= {confidence}, "
            f"signal > {signal}"
        )
        add(name, out, clean_out, [processor.handed_share, on_clean.handed_share])
    if sure:  # the steer only where a gate opens and the fine-tune is sure: no reference
        view = partial(reference_where_open, mem, result.steer, SteeredView(mem, result.steer))
        with view() as processor:
            out = generate(processor, prompts)
        with view() as on_clean:
            clean_out = generate(on_clean, clean)
        name = "the steer where a gate opens and the fine-tune is sure (no reference)"
        add(name, out, clean_out, [processor.handed_share, on_clean.handed_share])
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="math_noise")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--rules",
        choices=["all", "defaults"],
        default="all",
        help="defaults: only the two rules protect's step 8 chooses between (its defaults' "
        "confidence and signal, with the steer's gates and with none)",
    )
    parser.add_argument(
        "--reports",
        type=Path,
        help="read each setting's steer and split from DIR/protect_<setting>_seed<seed> (a "
        "committed `gss bench tinymem` result, e.g. results/tinymem-amd-epyc) instead of "
        "running protect",
    )
    parser.add_argument(
        "--steer-where-sure",
        action="store_true",
        help="also the steer's own scores at the steps a gate opens and the fine-tune is sure "
        "(reference_where_open with the steered fine-tune as its reference: no second model)",
    )
    args = parser.parse_args()
    rules = RULES if args.rules == "all" else [r for r in RULES if r[1:] == (0.98, 1.0)]
    torch.set_num_threads(2)
    records = []
    for setting in args.settings.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            records += run(setting, seed, rules, args.steer_where_sure, args.reports)
    write_json(
        args.out / "result.json",
        {
            "command": "benchmarks/scripts/handoff_tinymem.py " + " ".join(sys.argv[1:]),
            "machine": machine_info(),
            "records": records,
        },
    )
    rows = [
        [
            r["setting"],
            r["seed"],
            r["rule"],
            f"{r['reproduced']:.1f} of {r['heldout_rows']}",
            f"{r['repeated_4grams']:.1f} ({r['reference_repeated_4grams']:.1f})",
            f"{r['reference_ppl']:.3f} ({r['reference_own_ppl']:.3f})",
            f"{r['clean_unchanged']:.1f}",
            "-" if r["handed_share"] is None else " / ".join(f"{h:.2%}" for h in r["handed_share"]),
        ]
        for r in records
    ]
    header = [
        "setting",
        "seed",
        "rule",
        "held-out rows reproduced %",
        "replies: repeated 4-grams % (reference)",
        "replies: ppl under the reference (its own)",
        "clean prompts unchanged %",
        "steps handed over (held-out / clean)",
    ]
    chose = []
    for r in {(r["setting"], r["seed"]): r for r in records}.values():
        h = r["handover"]
        if h:
            said = "; ".join(
                f"{rule}: {m['reproduced']:.1f}% of {h['tuning_rows']} tuning rows reproduced, "
                f"{100 * m['unchanged']:.1f}% of {h['ordinary_prompts']} ordinary prompts unchanged"
                for rule, m in h["rules"].items()
            )
            chose.append(
                f"- {r['setting']} seed {r['seed']}: step 8 chose **{h['gates']}** ({said})"
            )
    (args.out / "result.md").write_text(
        markdown_table(header, rows) + "\n" + "\n".join(chose) + "\n"
    )


if __name__ == "__main__":
    main()
