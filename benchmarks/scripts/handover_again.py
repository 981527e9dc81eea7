"""Step 8 of `gss protect` again on a written protect report of the canary benchmark, with
today's rule: what it would choose now, without searching again (issue 72).

A developer's measurement script. It rebuilds what protect had when step 8 ran (the cached
fine-tune as `protect_heldout.py` makes it, the audit and split, the general text: each
deterministic from the seed), checks that the split is the report's, and runs
`gss.protect.handover.handover_rule` with the report's steer:

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/handover_again.py \\
        --report /tmp/c32-lora/protect --lora 16 --lr 1e-3 --out /tmp/c32-lora/handover.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from gss import load
from gss.hf.adapters import adapters_off
from gss.hf.blocks import find_decoder_blocks
from gss.protect.config import Setting, resolve
from gss.protect.general import general_text
from gss.protect.handover import handover_rule
from gss.protect.search import _read_inputs
from gss.protect.split import audit_and_split
from gss.report import machine_info, write_json
from gss_bench.canaries.data import make_canary_data
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.protection import protect_arguments
from gss_bench.canaries.run import (
    CALIBRATION_CLEAN_ROWS,
    DEFAULT_MODEL,
    PPL_TOLERANCE,
    _load,
    canary_config,
    default_cache,
    default_train_blocks,
    finetuned,
    model_path,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, required=True, help="a protect report folder")
    parser.add_argument("--out", type=Path, required=True, help="the JSON written")
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--lr", type=float, default=FinetuneConfig.lr)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    torch.set_num_threads(2)
    base_path = model_path(args.model)
    base, tokenizer = _load(base_path, "cpu")
    data = make_canary_data(tokenizer, canary_config(tokenizer, 0))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    blocks = default_train_blocks(len(find_decoder_blocks(base)))
    cfg = FinetuneConfig(train_blocks=blocks, seed=0, lr=args.lr, lora_rank=args.lora)
    model, info = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
    if not info.get("loaded"):
        raise SystemExit("the fine-tune was not cached: run protect_heldout.py first")
    reference = adapters_off(model) if args.lora else base
    rows = [*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]]
    given = protect_arguments(data, tokenizer, rows, PPL_TOLERANCE, 16)
    texts, general, heldout = given.pop("texts"), given.pop("general"), given.pop("heldout")
    given.pop("tokenizer")
    pad_id = given.pop("pad_id")
    config, options = resolve(None, {**given, "progress": False})
    s = Setting(model, reference, tokenizer, pad_id, options)
    started = time.perf_counter()
    fit, _ = _read_inputs(s, config, general, heldout)
    split = audit_and_split(s, config, texts, fit)
    record = json.loads((args.report / "protect.json").read_text())
    if [split.tuning, split.heldout] != [record["split"]["tuning"], record["split"]["heldout"]]:
        raise SystemExit("the split differs from the report's: not the run that wrote it")
    text = general_text(s, config, split.audit, split.heldout, fit)
    handover = handover_rule(s, config, split, text, load(args.report / "steer"))
    write_json(
        args.out,
        {
            "command": "benchmarks/scripts/handover_again.py --report "
            f"{args.report} --out {args.out}"
            + (f" --lora {args.lora} --lr {args.lr:g}" if args.lora else "")
            + (f" --model {args.model}" if args.model != DEFAULT_MODEL else ""),
            "machine": machine_info(),
            "seconds": time.perf_counter() - started,
            "in_the_report": record["handover"],
            "now": handover,
        },
    )
    print(json.dumps(handover, indent=1, default=float))


if __name__ == "__main__":
    main()
