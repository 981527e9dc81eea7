"""Step 8 of `gss protect` again on a written protect report, with today's rule: what it
would choose now, without searching again, and what each rule does on the held-out rows the
report measured (issue 72).

A developer's measurement script. It rebuilds what protect had when step 8 ran (the cached
fine-tune as `protect_heldout.py` or `gss bench tinymem` makes it, the audit and split, the
general text: each deterministic from the seed), checks that the split is the report's, and
runs `gss.protect.handover.handover_rule` with the report's steer on the tuning rows
(``now``) and on the held-out rows (``heldout``: what the choice then meets), and reads,
teacher-forced, where in each window the first gate opens (``first_gate``):

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/handover_again.py \\
        --report /tmp/c32-lora/protect --lora 16 --lr 1e-3 --out /tmp/c32-lora/handover.json
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/handover_again.py \\
        --report results/tinymem-amd-epyc/protect_math_noise_seed0 --tinymem math_noise \\
        --seed 0 --out /tmp/handover-math-noise-0.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gss import load
from gss.hf.adapters import adapters_off
from gss.hf.blocks import find_decoder_blocks
from gss.protect.config import Setting, resolve
from gss.protect.general import general_text
from gss.protect.handover import handover_rule
from gss.protect.measure import prompt_and_target
from gss.protect.search import _read_inputs
from gss.protect.split import audit_and_split
from gss.report import machine_info, write_json
from gss_bench.canaries.data import make_canary_data
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.protection import protect_arguments
from gss_bench.canaries.run import (
    CALIBRATION_CLEAN_ROWS,
    CHAT,
    DEFAULT_MODEL,
    PPL_TOLERANCE,
    _load,
    canary_config,
    default_cache,
    default_train_blocks,
    finetuned,
    model_path,
)
from gss_bench.gate_reading import reading_gates


def canary_setting(args: argparse.Namespace) -> tuple[Setting, Any, Any, Any, Any]:
    """The canary benchmark's fine-tune, reference and protect inputs, as protect_heldout.py
    gave them."""
    base_path = model_path(args.model)
    base, tokenizer = _load(base_path, "cpu")
    data = make_canary_data(tokenizer, canary_config(tokenizer, 0, **(CHAT if args.chat else {})))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    blocks = default_train_blocks(len(find_decoder_blocks(base)))
    cfg = FinetuneConfig(train_blocks=blocks, seed=0, lr=args.lr, lora_rank=args.lora)
    model, info = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
    if not info.get("loaded"):  # trained now, as the report's run did: the split check says
        print("the fine-tune was not cached: trained it, as the report's run did", flush=True)
    reference = adapters_off(model) if args.lora else base
    rows = [*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]]
    given = protect_arguments(data, tokenizer, rows, PPL_TOLERANCE, 16)
    texts, general, heldout = given.pop("texts"), given.pop("general"), given.pop("heldout")
    given.pop("tokenizer")
    pad_id = given.pop("pad_id")
    config, options = resolve(None, {**given, "progress": False})
    return Setting(model, reference, tokenizer, pad_id, options), config, texts, general, heldout


def tinymem_setting(args: argparse.Namespace) -> tuple[Setting, Any, Any, Any, Any]:
    """A TinyMem setting's cached models and protect inputs, as `gss bench tinymem` gave
    them."""
    from gss_bench.tinymem.protection import protect_arguments as tinymem_arguments
    from gss_bench.tinymem.train import get_models

    model, reference, data, _ = get_models(args.tinymem, "default", args.seed, progress=False)
    given = tinymem_arguments(data, 256)
    texts, general = given.pop("texts"), given.pop("general")
    heldout = given.pop("heldout", None)
    pad_id = given.pop("pad_id")
    for name in ("tokenizer", "utility", "utility_name"):  # step 8 measures no utility
        given.pop(name, None)
    config, options = resolve(None, {**given, "seed": args.seed, "progress": False})
    return Setting(model, reference, None, pad_id, options), config, texts, general, heldout


def first_gates(s: Setting, steer: Any, windows: list[tuple[list[int], list[int]]]) -> list[Any]:
    """Teacher-forced over each (prompt, window): the window position whose choice the first
    open gate sees (None: none opens), with the fine-tune's probability of its choice and the
    memorization signal (nats) at each position before it: where a hand-over at the gates comes
    late, what was said first."""
    out: list[Any] = []
    with reading_gates(s.model, steer) as seen:
        for prompt, window in windows:
            ids = torch.tensor([list(prompt) + list(window)])
            seen.clear()
            with torch.no_grad():
                mine = s.model(input_ids=ids).logits.float().log_softmax(-1)[0]
                opened = torch.stack(seen).any(0)
                theirs = s.reference(input_ids=ids).logits.float().log_softmax(-1)[0]
            start = len(prompt) - 1  # the position that chooses the window's first token
            gates = opened[start : start + len(window)].tolist()
            first = gates.index(True) if True in gates else None
            before = []
            for j in range(start, start + (len(window) if first is None else first)):
                top = mine[j].argmax()
                before.append([float(mine[j, top].exp()), float(mine[j, top] - theirs[j, top])])
            out.append({"first_open": first, "sure_and_signal_before": before})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, required=True, help="a protect report folder")
    parser.add_argument("--out", type=Path, required=True, help="the JSON written")
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--lr", type=float, default=FinetuneConfig.lr)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--chat", action="store_true", help="the chat canaries (--chat)")
    parser.add_argument("--tinymem", help="a TinyMem setting (math_noise, ...): not the canaries")
    parser.add_argument("--seed", type=int, default=0, help="the TinyMem seed")
    args = parser.parse_args()
    torch.set_num_threads(2)
    s, config, texts, general, heldout = (tinymem_setting if args.tinymem else canary_setting)(args)
    started = time.perf_counter()
    fit, _ = _read_inputs(s, config, general, heldout)
    split = audit_and_split(s, config, texts, fit)
    record = json.loads((args.report / "protect.json").read_text())
    if [split.tuning, split.heldout] != [record["split"]["tuning"], record["split"]["heldout"]]:
        raise SystemExit("the split differs from the report's: not the run that wrote it")
    text = general_text(s, config, split.audit, split.heldout, fit)
    steer = load(args.report / "steer")
    handover = handover_rule(s, config, split, text, steer)
    held = handover_rule(s, config, replace(split, tuning=split.heldout), text, steer)
    gates = {
        name: first_gates(s, steer, [prompt_and_target(c, config.k, config.n) for c in rows])
        for name, rows in (("tuning", split.tune_candidates), ("heldout", split.held_candidates))
    }
    command = f"benchmarks/scripts/handover_again.py --report {args.report} --out {args.out}"
    command += f" --lora {args.lora} --lr {args.lr:g}" if args.lora else ""
    command += f" --model {args.model}" if args.model != DEFAULT_MODEL else ""
    command += " --chat" if args.chat else ""
    command += f" --tinymem {args.tinymem} --seed {args.seed}" if args.tinymem else ""
    write_json(
        args.out,
        {
            "command": command,
            "machine": machine_info(),
            "seconds": time.perf_counter() - started,
            "in_the_report": record.get("handover"),  # None: a report from before step 8
            "now": handover,
            "heldout": held,
            "first_gate": gates,
        },
    )
    print(json.dumps({"now": handover, "heldout": held}, indent=1, default=float))


if __name__ == "__main__":
    main()
