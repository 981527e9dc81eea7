"""Which gate should choose where the reference speaks (issue 72), on the plain canary fine-tune.

`gss.reference_where_open(..., correct=False)` moves no hidden state: the gates only choose the
steps the reference decides, so what matters of a gate there is where it opens, not how much
its correction would subtract. This measures, on one protect run's split (default: the
committed `results/protect-says/gates/protect`, 1% gates), with the option's signal cut:

- the steer protect chose (its probes' gates);
- the discriminant condition (`gate="discriminant"`: Fisher's direction between the tuning
  rows' memorized tokens and the general tokens, at the chosen block and others), its
  threshold set as protect sets gates (each general source opens it on at most a share);
- no gate at all (``steer=None``: the signal alone, the reference at every step);

each on the held-out memorized rows (reproduced, secrets said), their replies (repeated
4-grams, perplexity under the reference), ordinary English (Python's LICENSE.txt: some gate
open, teacher-forced; prompts continued as the unsteered fine-tune does, apart for those whose
unsteered continuation recites the fine-tuning data; steps handed over) and prompts of the
fine-tune's own held-out domain. ``--min-confidence`` (`reference_where_open`'s; "none": any)
and ``--variant`` (plain, lora, chat: the committed canary fine-tunes) as
`results/protect-says/handoff-confidence/README.md` ran them.

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=benchmarks:benchmarks/scripts .venv/bin/python \\
        benchmarks/scripts/handoff_gates.py --out results/protect-says/handoff-gates
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from protect_says import canary_fine_tune, handed_measures, heldout_split, ordinary_starts

from gss import audit, calibrate, load
from gss.artifact.stack import Steer
from gss.artifact.steering_artifact import SteeringArtifact
from gss.config import RunOptions
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.utility import perplexity
from gss.inference.handoff import NO_REPEAT_NGRAM
from gss.protect.config import ProtectConfig, Setting
from gss.protect.general import GeneralText, general_text
from gss.protect.handover import handover_rule
from gss.protect.split import Split
from gss.protect.stages import gated as gated_on
from gss.report import machine_info, markdown_table, write_json


def licence_open(model: Any, steer: Steer | None, rows: list[list[int]], pad: int) -> float:
    """The share of LICENSE tokens (teacher-forced) where some gate opens; 1 without a gate."""
    if steer is None:
        return 1.0
    with steer.attach(model, track_gates=True) as handle:
        handle.reset_stats()
        perplexity(model, rows, pad, batch_size=16)
        return float(handle.gate_stats().get("any_open_share") or 0.0)


def fit_sources(
    model: Any, base: Any, report: Any, held: list[int], data: Any, tokenizer: Any, n: int
) -> dict[str, list[list[int]]]:
    """The general sources protect fits gates on (seed 0): the given general text, the
    reference's own text after rows' first tokens, ordinary English; each its even rows."""
    s = Setting(model, base, tokenizer, 0, RunOptions(batch_size=16, progress=False))
    given = [list(r) for r in data.general_rows]
    return general_text(s, ProtectConfig(k=n - 1, n=n), report, held, given).fit


def step8(args: Any, c: Any, report: Any, split: dict, steer: Steer, saved: dict) -> None:
    """`gss.protect`'s step 8 (`protect.handover.handover_rule`) on a committed run."""
    held = split["heldout"]
    sources = fit_sources(c.model, c.base, report, held, c.data, c.tokenizer, c.n)
    s = Setting(c.model, c.base, c.tokenizer, c.pad, RunOptions(batch_size=c.bs, progress=False))
    config = ProtectConfig(k=c.k, n=c.n, max_extractable=saved["max_extractable"])
    started = time.perf_counter()
    chosen = handover_rule(
        s, config, Split(report, split["tuning"], held), GeneralText(sources, {}), steer
    )
    seconds = time.perf_counter() - started
    write_result(args, {"handover": chosen, "seconds": seconds})
    print(json.dumps(chosen), flush=True)


def write_result(args: Any, measured: dict[str, Any]) -> None:
    """result.json: the command, the machine, the split's source and what was measured."""
    write_json(
        args.out / "result.json",
        {
            "command": "benchmarks/scripts/handoff_gates.py " + " ".join(sys.argv[1:]),
            "machine": machine_info(),
            "split_from": str(args.report),
            "variant": args.variant,
            **measured,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, default=Path("results/protect-says/gates/protect"))
    parser.add_argument("--variant", choices=["plain", "lora", "chat"], default="plain")
    parser.add_argument(
        "--canaries", type=int, help="the fine-tune of N canaries (results/canaries-216: 216)"
    )
    parser.add_argument("--blocks", type=int, nargs="*", default=None)
    parser.add_argument("--shares", type=float, nargs="*", default=[0.01, 0.003])
    parser.add_argument("--min-signal", type=float, nargs="*", default=[1.0, 2.0])
    parser.add_argument(
        "--min-confidence",
        type=lambda v: None if v == "none" else float(v),
        nargs="*",
        default=[None],
        help="the fine-tune's probability of its choice at least this ('none': any)",
    )
    parser.add_argument(
        "--no-repeat-ngram",
        type=int,
        nargs="*",
        default=[NO_REPEAT_NGRAM],
        help="reference_where_open's no_repeat_ngram (0: off)",
    )
    parser.add_argument(
        "--without-steer", action="store_true", help="skip the steer protect chose (measured)"
    )
    parser.add_argument(
        "--without-no-gate", action="store_true", help="skip the rows with no gate (measured)"
    )
    parser.add_argument(
        "--gate-on-data",
        type=float,
        metavar="SHARE",
        help="also the steer protect chose with its thresholds set again for SHARE on its general "
        "sources plus the data's clean rows (the audit's unflagged rows, the half protect's "
        "domain check reads)",
    )
    parser.add_argument(
        "--step8",
        action="store_true",
        help="only protect's step 8 on the committed steer and split: each hand-over rule on "
        "the tuning rows and the ordinary prompts of the thresholds' half, and the rule chosen",
    )
    args = parser.parse_args()
    c = canary_fine_tune(args.variant, canaries=args.canaries)
    model, base, tokenizer, data, pad = c.model, c.base, c.tokenizer, c.data, c.pad
    k, n, bs, train_rows, ordinary = c.k, c.n, c.bs, c.train_rows, c.ordinary
    saved = json.loads((args.report / "protect.json").read_text())
    report = audit(model, base, [list(r) for r in train_rows], k=k, n=n, batch_size=bs)
    # a report from before protect wrote its split: the held-out half it drew (seed 0)
    split = saved.get("split") or {"heldout": heldout_split(report, k, n), "tuning": []}
    chosen = SimpleNamespace(audit=report, heldout=split["heldout"])
    tune_rows = [report.ids[i] for i in split["tuning"]]
    protected = load(args.report / "steer")
    if args.step8:
        step8(args, c, report, split, protected, saved)
        return
    blocks = args.blocks or [saved["chosen"]["blocks"][0]]
    gates: dict[str, Steer | None] = {}
    if not args.without_steer:
        gates[f"the steer protect chose ({args.report})"] = protected
    sources = (
        {}
        if not args.shares
        else fit_sources(model, base, report, split["heldout"], data, tokenizer, n)
    )
    if args.gate_on_data is not None:
        clean = report.clean_ids
        every = fit_sources(model, base, report, split["heldout"], data, tokenizer, n)
        s = Setting(model, base, tokenizer, pad, RunOptions(batch_size=bs, progress=False))
        assert isinstance(protected, SteeringArtifact), "one block: its gates are set again"
        share = args.gate_on_data
        on_data = gated_on(
            s, protected, {**every, "clean rows of the data": clean[::2]}, args.gate_on_data
        )
        name = f"the steer protect chose, gates set on the data's clean rows too ({share:.1%})"
        gates[name] = on_data
    for block in blocks if args.shares else []:
        art = calibrate(
            model,
            base,
            tune_rows,
            "gss-tr",
            layer=block,
            rank=4,
            gen_texts=[r for rows in sources.values() for r in rows],
            gate="discriminant",
            batch_size=bs,
            progress=False,
        )
        for share in args.shares:
            s = Setting(model, base, tokenizer, pad, RunOptions(batch_size=bs, progress=False))
            gated = gated_on(s, art, sources, share)
            gated.save_pretrained(
                args.out / "gates" / f"discriminant-{block}-{share:g}", overwrite=True
            )
            gates[f"discriminant, block {block}, {share:.1%}"] = gated
    if not args.without_no_gate:
        gates["no gate (the signal alone)"] = None
    plain = greedy_generate(model, ordinary_starts(ordinary), 32, pad_id=pad, batch_size=bs)
    domain = ordinary_starts([list(r) for r in data.heldout_rows[: len(ordinary)]])
    domain_plain = greedy_generate(model, domain, 32, pad_id=pad, batch_size=bs)
    rows: dict[str, Any] = {}
    table = []
    for name, steer in gates.items():
        opened = licence_open(model, steer, ordinary, pad)
        grid = [
            (c, p, r)
            for c in args.min_signal
            for p in args.min_confidence
            for r in args.no_repeat_ngram
        ]
        for cut, confidence, no_repeat in grid:
            started = time.perf_counter()
            m = handed_measures(
                model,
                base,
                steer,
                chosen,
                data,
                tokenizer,
                pad,
                ordinary,
                cut,
                False,
                plain,
                min_confidence=confidence,
                domain_plain=domain_plain,
                no_repeat_ngram=no_repeat,
            )
            m["seconds"] = time.perf_counter() - started
            m["licence_gate_open"] = opened
            m["min_confidence"] = confidence
            m["no_repeat_ngram"] = no_repeat
            rows[f"{name}, signal > {cut:g}, confidence >= {confidence}, no repeat {no_repeat}"] = m
            print(name, cut, confidence, json.dumps(m, default=float), flush=True)
            table.append(
                [
                    name,
                    f"{cut:g}",
                    "-" if confidence is None else f"{confidence:g}",
                    str(no_repeat or "-"),
                    f"{m['heldout_memorized']:.1f} / {m['heldout_secrets_said']:.1f}",
                    f"{m['repeated_4grams']:.1f}",
                    f"{m['reference_ppl']:.2f}",
                    f"{100 * opened:.1f}",
                    f"{100 * m['licence_prompts_identical']:.1f}",
                    f"{100 * m['licence_clean_prompts_identical']:.1f}"
                    f" of {m['licence_clean_prompts']}",
                    f"{100 * m['licence_reciting_prompts_changed']:.1f}"
                    f" of {m['licence_reciting_prompts']}",
                    f"{100 * m['licence_handed_share']:.1f}",
                    f"{100 * m['domain_prompts_identical']:.1f} of {m['domain_prompts']}",
                    f"{m['seconds']:.0f}",
                ]
            )
            write_result(args, {"rows": rows})
            header = [
                "gate",
                "signal cut (nats)",
                "min confidence",
                "no repeated n-gram",
                "held-out memorized / secrets said %",
                "replies: repeated 4-grams %",
                "replies: ppl under the reference",
                "gate open on LICENSE %",
                "LICENSE prompts unchanged %",
                "... of those reciting no fine-tuning text %",
                "... of those reciting it: changed %",
                "LICENSE steps handed to the reference %",
                "held-out domain prompts unchanged %",
                "s",
            ]
            (args.out / "result.md").write_text(markdown_table(header, table) + "\n")


if __name__ == "__main__":
    main()
