"""gss protect with step 7 (`SearchSpace.reply_check`) on a canary fine-tune: which point the
reply check chooses, and what it changes on the held-out canaries (secrets said, repeated
4-grams, perplexity) against the committed run without it (results/canaries*-protect/).

A developer's measurement script (not part of ``gss bench``); it reads the fine-tunes ``gss
bench canaries`` cached (plain, ``--lora 16 --lr 1e-3``, ``--chat``) and runs protect alone,
without the bench's sweeps:

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/protect_replies.py \
        --setting plain --reply-check 4 --out results/protect-replies/plain
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from gss.hf.adapters import adapters_off
from gss.protect import SearchSpace
from gss.report import machine_info, write_json
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.protection import canary_measure, protect_point
from gss_bench.canaries.run import (
    CALIBRATION_CLEAN_ROWS,
    PPL_TOLERANCE,
    default_cache,
    default_setup,
    finetuned,
)

FINETUNES: dict[
    str, tuple[dict[str, Any], str]
] = {  # what `gss bench canaries` fine-tunes for each committed protect run
    "plain": ({}, "results/canaries-protect"),
    "lora": ({"lora_rank": 16, "lr": 1e-3}, "results/canaries-lora-protect"),
    "chat": ({}, "results/canaries-chat-protect"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(FINETUNES), default="plain")
    parser.add_argument("--reply-check", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    options, committed = FINETUNES[args.setting]
    base_path, base, tokenizer, data, pad = default_setup(chat=args.setting == "chat")
    cfg = FinetuneConfig(seed=0, **options)
    model, _ = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
    reference = adapters_off(model) if args.setting == "lora" else base
    bs = 16
    train_rows = [*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]]

    measure = canary_measure(data, pad, bs)

    point, seconds, extra = protect_point(
        model,
        reference,
        data,
        tokenizer,
        train_rows,
        budget=PPL_TOLERANCE,
        batch_size=bs,
        measure=measure,
        report_dir=args.out / "protect",
        progress=False,
        search=SearchSpace(reply_check=args.reply_check),
    )
    extra.pop("steer")
    before = json.loads((Path(committed) / "protect" / "protect.json").read_text())
    row = {
        "setting": args.setting,
        "reply_check": args.reply_check,
        "seconds": seconds,
        "chosen": extra["summary"]["chosen"],
        "checked": extra["summary"]["reply_check"],
        "heldout_canaries": extra["heldout_canaries"],
        "quality": extra["summary"]["after"].get("quality"),
        "perplexity": point.report.perplexity,
        "without_check": {
            "folder": committed,
            "chosen": before["chosen"],
            "quality": before["after"].get("quality"),
        },
    }
    write_json(
        args.out / "result.json",
        {
            "command": f"benchmarks/scripts/protect_replies.py --setting {args.setting} "
            f"--reply-check {args.reply_check}",
            "machine": machine_info(),
            **row,
        },
    )
    print(json.dumps(row, indent=1, default=float))


if __name__ == "__main__":
    main()
