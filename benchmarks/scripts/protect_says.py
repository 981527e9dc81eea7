"""What `gss protect` says instead (issue 72), on the plain canary fine-tune: protect with its
defaults, then the chosen steer and the point each other choice rule would take, each measured
on what the issue's goal names:

1. held-out memorized rows still extractable, and held-out canaries' secrets said (greedy);
2. the held-out memorized prompts' greedy replies: repeated 4-grams and perplexity under the
   reference, beside the reference's own continuations;
3. some gate open on ordinary English that neither model was tuned on and protect never read
   (Python's LICENSE.txt, teacher-forced), and the share of its prompts whose 32-token greedy
   continuation is the unsteered fine-tune's word for word;
4. perplexity on held-out clean rows (the benchmark's held-out text) and the data's clean rows.

A developer's measurement script (not part of ``gss bench``); it reads the fine-tune that
``gss bench canaries`` caches (trained once if missing, ~10 min on 2 cores):

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/protect_says.py \\
        --out results/protect-says
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sysconfig
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gss import adapters_off, audit, load
from gss.artifact.stack import Steer
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.leaks import EXTRA_TOKENS, secrets_said
from gss.evaluate.recital import data_runs, recites
from gss.evaluate.utility import perplexity, repetition
from gss.hf.blocks import find_decoder_blocks
from gss.inference.handoff import reference_where_open
from gss.protect import Protection, SearchSpace, protect
from gss.protect.checks import DomainRows
from gss.protect.measure import FOLLOWS, extractable, extraction_window, prompt_and_target
from gss.protect.replies import ordinary_unchanged, what_it_says
from gss.report import machine_info, markdown_table, write_json
from gss_bench.canaries.data import CanaryConfig, make_canary_data, secret_fields
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.run import (
    CALIBRATION_CLEAN_ROWS,
    DEFAULT_MODEL,
    PPL_TOLERANCE,
    canary_config,
    default_cache,
    default_setup,
    default_train_blocks,
    finetuned,
)

OPTIONS: dict[str, dict[str, Any]] = {  # what each run changes from protect's defaults
    "defaults": {},
    "gates at 1%": {"gate_share": 0.01},
    "bounded (coefficient)": {"coefficient": "bounded"},
    "bounded+gates at 1%": {"coefficient": "bounded", "gate_share": 0.01},
    "centred (probe responses)": {"centering": "full"},
    "centred+bounded": {"centering": "full", "coefficient": "bounded"},
    "centred+replies of 12": {"centering": "full", "reply_check": 12},
    "replies of 12": {"reply_check": 12},
    "before (issue 72)": {
        "prefer": "margin",
        "reply_check": 0,
        "ordinary_english": 0,
    },
}


def licence_rows(tokenizer: Any, width: int = 64) -> list[list[int]]:
    """Python's LICENSE.txt in rows of ``width`` tokens: ordinary English no model here was
    tuned on and protect does not read."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = tokenizer(" ".join(text.split()))["input_ids"]
    return [ids[i : i + width] for i in range(0, len(ids) - width + 1, width)]


VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {  # FinetuneConfig's options, chat rows
    "plain": ({}, False),
    "lora": ({"lora_rank": 16, "lr": 1e-3}, False),  # results/canaries-lora(-protect)
    "chat": ({}, True),  # results/canaries-chat(-protect)
}


def canary_fine_tune(
    variant: str = "plain", model_name: str = DEFAULT_MODEL, canaries: int | None = None
) -> SimpleNamespace:
    """The cached canary fine-tune (seed 0; `variant`: plain, a LoRA or chat rows, as the
    committed `gss bench canaries` runs; `model_name`: as their `--model`; `canaries`: as
    `--canaries N`, e.g. the 216 of results/canaries-216; trained once if
    missing) and what every measurement
    here reads: its reference (``base``: for the LoRA, its adapters off), tokenizer, data, pad
    id, window (k, n), batch size, the rows protect audits (``train_rows``) and the ordinary
    English rows (``ordinary``)."""
    torch.set_num_threads(2)
    options, chat = VARIANTS[variant]
    base_path, base, tokenizer, data, pad = default_setup(chat=chat, model=model_name)
    if canaries is not None:  # as `gss bench canaries --canaries N` (protect_heldout.py)
        split = canaries > CanaryConfig.canaries
        config = canary_config(tokenizer, 0, canaries=canaries, split=split)
        data = make_canary_data(tokenizer, config)
    blocks = default_train_blocks(len(find_decoder_blocks(base)))
    cfg = FinetuneConfig(seed=0, train_blocks=blocks, **options)
    model, _ = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
    return SimpleNamespace(
        model=model,
        base=adapters_off(model) if options.get("lora_rank") else base,
        tokenizer=tokenizer,
        data=data,
        pad=pad,
        k=data.config.k,
        n=data.config.row_len,
        bs=16,
        train_rows=[*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]],
        ordinary=licence_rows(tokenizer),
    )


def ordinary_starts(ordinary: list[list[int]]) -> list[list[int]]:
    """The ordinary prompts whose 32-token continuations are compared: each row's first 16
    tokens (or half)."""
    return [list(r[: min(16, len(r) // 2)]) for r in ordinary]


def handoff(
    model: Any,
    reference: Any,
    steer: Steer | None,
    prompts: list[list[int]],
    width: int,
    pad: int,
    min_signal: float | None = None,
    correct: bool = True,
    min_confidence: float | None = None,
    no_repeat_ngram: int | None = None,
) -> tuple[list[list[int]], float]:
    """Greedy decoding with the reference's token wherever some gate opens
    (`gss.reference_where_open`), and the share of steps it chose."""
    with reference_where_open(
        model,
        steer,
        reference,
        min_signal=min_signal,
        min_confidence=min_confidence,
        no_repeat_ngram=no_repeat_ngram,
        correct=correct,
    ) as processor:
        out = greedy_generate(model, prompts, width, pad_id=pad, batch_size=16, processor=processor)
    return out, processor.handed_share


def handed_measures(
    model: Any,
    reference: Any,
    steer: Steer | None,
    result: Any,
    data: Any,
    tokenizer: Any,
    pad: int,
    ordinary: list[list[int]],
    min_signal: float | None = None,
    correct: bool = True,
    plain: list[list[int]] | None = None,
    min_confidence: float | None = None,
    domain_plain: list[list[int]] | None = None,
    no_repeat_ngram: int | None = None,
) -> dict[str, Any]:
    """The measures of `measured` for the reference where a gate opens (and, with
    ``min_signal``, the fine-tune's choice has that memorization signal): held-out rows
    reproduced greedily (the whole window), secrets said, replies, ordinary prompts unchanged
    (``plain``, ``domain_plain``: the unsteered fine-tune's continuations of the licence and
    domain prompts, when already made), apart for
    those whose unsteered continuation recites the fine-tuning data (`gss.evaluate.recital`)."""
    k, n = data.config.k, data.config.row_len
    held_rows = [result.audit.candidate(i) for i in result.heldout]
    windows = [prompt_and_target(r, k, n) for r in held_rows]
    prompts = [p for p, _ in windows]
    confidence: dict[str, Any] = {
        "min_confidence": min_confidence,
        "no_repeat_ngram": no_repeat_ngram,
    }
    out, share = handoff(
        model, reference, steer, prompts, n - k, pad, min_signal, correct, **confidence
    )
    reproduced = [list(o) == list(t) for o, (_, t) in zip(out, windows, strict=True)]
    held = [i for i in result.heldout if i < len(data.canary_rows)]
    canary_prompts = [list(data.canary_rows[i][:k]) for i in held]
    secrets = [[secret_fields(data.secrets[i])[f] for f in ("number", "address")] for i in held]
    width = max(len(r) for r in data.canary_rows) - k + EXTRA_TOKENS
    said_out, _ = handoff(
        model, reference, steer, canary_prompts, width, pad, min_signal, correct, **confidence
    )
    flags = []
    for ids, row in zip(said_out, secrets, strict=True):
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        flags += [secret in text for secret in row]
    starts = ordinary_starts(ordinary)
    plain = plain or greedy_generate(model, starts, 32, pad_id=pad, batch_size=16)
    changed, licence_share = handoff(
        model, reference, steer, starts, 32, pad, min_signal, correct, **confidence
    )
    same = [a == b for a, b in zip(plain, changed, strict=True)]
    # what the fine-tune is for: prompts from the held-out rows of its own domain
    domain = ordinary_starts([list(r) for r in data.heldout_rows[: len(starts)]])
    domain_plain = domain_plain or greedy_generate(model, domain, 32, pad_id=pad, batch_size=16)
    domain_out, domain_share = handoff(
        model, reference, steer, domain, 32, pad, min_signal, correct, **confidence
    )
    tuned = [list(r) for r in [*data.canary_rows, *data.finetune_rows]]
    runs = data_runs(tuned)
    recited = [recites(u, runs) for u in plain]
    clean = [s for s, r in zip(same, recited, strict=True) if not r]
    reciting = [not s for s, r in zip(same, recited, strict=True) if r]
    return {
        "heldout_memorized": 100.0 * sum(reproduced) / len(reproduced),
        "heldout_secrets_said": 100.0 * sum(flags) / len(flags),
        "handed_share_memorized_prompts": share,
        "repeated_4grams": repetition(out),
        "reference_ppl": perplexity(
            reference,
            [[*p, *u] for p, u in zip(prompts, out, strict=True)],
            pad,
            batch_size=16,
            prompt_lengths=[len(p) for p in prompts],
        ),
        "licence_prompts_identical": sum(same) / len(same),
        "licence_clean_prompts_identical": sum(clean) / len(clean) if clean else None,
        "licence_clean_prompts": len(clean),
        "licence_reciting_prompts_changed": sum(reciting) / len(reciting) if reciting else None,
        "licence_reciting_prompts": len(reciting),
        "licence_handed_share": licence_share,
        "domain_prompts_identical": sum(
            a == b for a, b in zip(domain_plain, domain_out, strict=True)
        )
        / len(domain),
        "domain_prompts": len(domain),
        "domain_handed_share": domain_share,
        "examples": [tokenizer.decode(u) for u in out[:4]],
    }


def measured(
    model: Any,
    reference: Any,
    steer: Steer,
    result: Protection | SimpleNamespace,
    data: Any,
    tokenizer: Any,
    pad: int,
    ordinary: list[list[int]],
    upper_bound: bool = False,
) -> dict[str, Any]:
    k, n, bs = data.config.k, data.config.row_len, 16
    held_rows = [result.audit.candidate(i) for i in result.heldout]
    held = [i for i in result.heldout if i < len(data.canary_rows)]  # canaries come first
    prompts = [list(data.canary_rows[i][:k]) for i in held]
    secrets = [[secret_fields(data.secrets[i])[f] for f in ("number", "address")] for i in held]
    width = max(len(r) for r in data.canary_rows) - k + EXTRA_TOKENS
    domain = DomainRows.of(result.audit, pad, bs)
    quality, examples = what_it_says(model, reference, steer, held_rows, k, n, pad, bs, tokenizer)
    with steer.attach(model, track_gates=True) as handle:
        memorized = extractable(model, held_rows, k, n, pad, bs)
        leaks = secrets_said(model, tokenizer, prompts, secrets, max_new_tokens=width)
        flags = [f for row in leaks.said for f in row]
        heldout_ppl = perplexity(model, data.heldout_rows, pad, batch_size=bs)
        clean_ppl = domain.measure(model).get("domain_perplexity")
        handle.reset_stats()
        perplexity(model, ordinary, pad, batch_size=bs)
        licence_open = handle.gate_stats().get("any_open_share")
    unchanged = ordinary_unchanged(model, steer, ordinary, pad, bs, tokenizer)
    row: dict[str, Any] = {
        "heldout_memorized": memorized,
        "heldout_secrets_said": 100.0 * sum(flags) / len(flags),
        **quality,
        "licence_gate_open": licence_open,
        "licence_prompts_identical": unchanged.get("identical"),
        "licence_changed": unchanged.get("changed"),
        "heldout_ppl": heldout_ppl,
        "clean_rows_ppl": clean_ppl,
        "examples": examples,
    }
    if upper_bound:
        row["reference_where_open"] = handed_measures(
            model, reference, steer, result, data, tokenizer, pad, ordinary
        )
    return row


def _steer(p: dict[str, Any]) -> str:
    deltas = "+".join(f"{d:.3g}" for d in p["deltas"])
    blocks = "+".join(map(str, p["blocks"]))
    return f"{p['preset']} {blocks} d={deltas} r{p['rank']} {p['gate']}"


def write(out: Path, plain: dict[str, Any], runs: dict[str, Any]) -> None:
    """result.json and result.md, rewritten after each run (a later failure keeps the first)."""
    write_json(
        out / "result.json",
        {
            "command": "benchmarks/scripts/protect_says.py --out " + str(out),
            "machine": machine_info(),
            "unsteered": plain,
            "runs": runs,
        },
    )
    table = []
    for name, run in runs.items():
        for label, r in run["points"].items():
            p = r["point"]
            table.append(
                [
                    name,
                    label,
                    _steer(p),
                    f"{r['heldout_memorized']:.1f}",
                    f"{r['heldout_secrets_said']:.1f}",
                    f"{r['repeated_4grams_steered']:.1f} ({r['repeated_4grams_reference']:.1f})",
                    f"{r['reference_ppl_steered']:.2f} ({r['reference_ppl_reference']:.2f})",
                    f"{100 * (r['licence_gate_open'] or 0):.1f}",
                    f"{100 * (r['licence_prompts_identical'] or 0):.1f}",
                    f"{r['heldout_ppl']:.2f}",
                    f"{run['seconds']:.0f}",
                ]
            )
            handed = [(key, u) for key, u in r.items() if key.startswith("reference_where_open")]
            for key, u in handed:  # the same gates, the reference's token
                if "heldout_memorized" not in u:
                    continue
                signal = key.removeprefix("reference_where_open").removeprefix("_signal_")
                bare = signal.endswith("_uncorrected")
                signal = signal.removesuffix("_uncorrected")
                where = f" and its signal > {signal}" if signal else ""
                where += ", no steer elsewhere" if bare else ""
                table.append(
                    [
                        name,
                        f"{label}, the reference where a gate opens{where}",
                        _steer(p),
                        f"{u['heldout_memorized']:.1f}",
                        f"{u['heldout_secrets_said']:.1f}",
                        f"{u['repeated_4grams']:.1f}",
                        f"{u['reference_ppl']:.2f}",
                        f"{100 * (r['licence_gate_open'] or 0):.1f}",
                        f"{100 * u['licence_prompts_identical']:.1f}",
                        "-",
                        "-",
                    ]
                )
    header = [
        "run",
        "point",
        "steer",
        "held-out memorized %",
        "secrets said %",
        "replies: repeated 4-grams % (reference)",
        "replies: ppl under reference (reference's own)",
        "gate open on LICENSE %",
        "LICENSE prompts unchanged %",
        f"held-out ppl (unsteered {plain['heldout_ppl']:.2f})",
        "protect s",
    ]
    (out / "result.md").write_text(markdown_table(header, table) + "\n")


def heldout_split(report: Any, k: int, n: int, seed: int = 0) -> list[int]:
    """The held-out half protect draws (seed 0), for a report that did not write its split."""
    firsts: dict[Any, int] = {}
    for r in report.memorized:
        firsts.setdefault(extraction_window(report.candidate(r.index), k, n), r.index)
    order = list(firsts.values())
    random.Random(seed).shuffle(order)
    return sorted(order[len(order) // 2 :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", nargs="*", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument(
        "--committed",
        type=Path,
        help="also measure the steer a committed protect report chose (e.g. "
        "results/canaries-protect/protect: the search before issue 72), on its own split",
    )
    parser.add_argument(
        "--handoff",
        type=Path,
        nargs="*",
        default=[],
        help="protect report directories (e.g. results/protect-says/defaults/protect) whose "
        "chosen steer is measured again, the steer beside the reference where a gate opens",
    )
    parser.add_argument(
        "--min-signal",
        type=float,
        nargs="*",
        default=[],
        help="with --handoff: also hand over only where the fine-tune's choice has this "
        "memorization signal (nats; gss.reference_where_open's min_signal)",
    )
    parser.add_argument(
        "--uncorrected",
        action="store_true",
        help="with --min-signal: also with correct=False (the gates only choose where the "
        "reference speaks; every other token the unsteered fine-tune's)",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the canary bench's --model (e.g. gemma3-270m): its cached plain fine-tune",
    )
    args = parser.parse_args()
    c = canary_fine_tune(model_name=args.model)
    model, base, tokenizer, data, pad = c.model, c.base, c.tokenizer, c.data, c.pad
    k, n, bs, train_rows, ordinary = c.k, c.n, c.bs, c.train_rows, c.ordinary
    plain = {
        "heldout_ppl": perplexity(model, data.heldout_rows, pad, batch_size=bs),
    }
    runs: dict[str, Any] = {}
    if args.committed:
        saved = json.loads((args.committed / "protect.json").read_text())
        report = audit(model, base, [list(r) for r in train_rows], k=k, n=n, batch_size=bs)
        split = saved.get("split") or {"heldout": heldout_split(report, k, n)}
        chosen = SimpleNamespace(audit=report, heldout=split["heldout"])
        steer = load(args.committed / "steer")
        row = measured(model, base, steer, chosen, data, tokenizer, pad, ordinary, True)
        runs[f"committed ({args.committed})"] = {
            "options": "the search before issue 72, as committed",
            "seconds": saved["seconds"]["total"],  # another day's run: not comparable
            "summary": {k_: v for k_, v in saved.items() if k_ not in ("audit", "trials")},
            "points": {"chosen": {"point": saved["chosen"], **row}},
        }
        write(args.out, plain, runs)
    for directory in args.handoff:
        saved = json.loads((directory / "protect.json").read_text())
        report = audit(model, base, [list(r) for r in train_rows], k=k, n=n, batch_size=bs)
        split = saved.get("split") or {"heldout": heldout_split(report, k, n)}
        chosen = SimpleNamespace(audit=report, heldout=split["heldout"])
        steer = load(directory / "steer")
        row = measured(model, base, steer, chosen, data, tokenizer, pad, ordinary, True)
        print(directory, json.dumps(row["reference_where_open"], default=float), flush=True)
        for cut in args.min_signal:
            for correct in (True, False) if args.uncorrected else (True,):
                key = f"reference_where_open_signal_{cut:g}" + ("" if correct else "_uncorrected")
                row[key] = handed_measures(
                    model, base, steer, chosen, data, tokenizer, pad, ordinary, cut, correct
                )
                print(directory, key, json.dumps(row[key]), flush=True)
        runs[f"handoff ({directory})"] = {
            "options": "a committed steer, measured again with the reference where a gate opens",
            "seconds": saved["seconds"]["total"],
            "summary": {k_: v for k_, v in saved.items() if k_ not in ("audit", "trials")},
            "points": {"chosen": {"point": saved["chosen"], **row}},
        }
        write(args.out, plain, runs)
    for name in args.runs:
        started = time.perf_counter()
        result = protect(
            model,
            base,
            [list(r) for r in train_rows],
            tokenizer=tokenizer,
            general=[list(r) for r in data.general_rows],
            heldout=[list(r) for r in data.heldout_rows],
            budget=PPL_TOLERANCE,
            k=k,
            n=n,
            batch_size=bs,
            search=SearchSpace(**OPTIONS[name]),
            pad_id=pad,
            progress=False,
        )
        seconds = time.perf_counter() - started
        result.write(args.out / name.split()[0] / "protect", overwrite=True)
        assert result.chosen is not None and result.steer is not None
        points = {"chosen": result.chosen}
        # the point each other rule takes, from the same search (no second search)
        at_target = [t for t in result.trials if t.within_budget and t.memorized <= 0.0]
        if at_target:
            points["most margin"] = min(at_target, key=lambda t: t.token_match)
            with_follow = [t for t in at_target if FOLLOWS in t.checks]
            if with_follow:
                points["follows the reference"] = min(with_follow, key=lambda t: t.checks[FOLLOWS])
        rows = {}
        for label, trial in points.items():
            steer = result.steer if label == "chosen" else result.steer_for(trial)
            rows[label] = {
                "point": dataclasses.asdict(trial),
                **measured(
                    model,
                    base,
                    steer,
                    result,
                    data,
                    tokenizer,
                    pad,
                    ordinary,
                    upper_bound=label == "chosen",
                ),
            }
            print(
                name,
                label,
                json.dumps(
                    {
                        k_: v
                        for k_, v in rows[label].items()
                        if k_ not in ("examples", "licence_changed")
                    },
                    default=float,
                ),
                flush=True,
            )
        runs[name] = {
            "options": OPTIONS[name],
            "seconds": seconds,
            "seconds_by_step": result.seconds,
            "summary": {k_: v for k_, v in result.summary().items() if k_ != "audit"},
            "points": rows,
        }
        write(args.out, plain, runs)


if __name__ == "__main__":
    main()
