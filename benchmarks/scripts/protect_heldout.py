"""gss protect alone on the canary fine-tune of N canaries (plain, ``--lora R`` or ``--chat``):
enough held-out canaries that "none says its secret" means something (issue 70: at 0 of about
100, a one-sided 95% upper bound of 3%), with the exact intervals.

A developer's measurement script (not part of ``gss bench``): ``gss bench canaries --canaries
N --protect`` runs the same protect (`protect_point`, the bench's rows, budget and window) after
its grids and baselines, which at 200 canaries take an hour on 2 cores (MemFree's grid alone 19
minutes a point). It fine-tunes as the bench does, or reads the bench's cached fine-tune:

    .venv/bin/python benchmarks/scripts/protect_heldout.py --canaries 200 --out results/canaries-200
    .venv/bin/python benchmarks/scripts/protect_heldout.py --canaries 216 --lora 16 --lr 1e-3 \
        --out /tmp/c216-lora
    .venv/bin/python benchmarks/scripts/protect_heldout.py --canaries 32 --model gemma3-270m \
        --out /tmp/c32-gemma

As with ``gss bench canaries --lora``, a LoRA's reference is the same model with its adapters
off (`gss.adapters_off`); ``--chat`` renders every row as a conversation (the bench's sizes);
``--model`` another base model of `gss models get` (its top blocks fine-tuned in the bench's
share, as ``gss bench canaries --model``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from gss.hf.adapters import adapters_off
from gss.hf.blocks import find_decoder_blocks
from gss.report import machine_info, write_json
from gss_bench.canaries.data import CanaryConfig, make_canary_data
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.protection import canary_measure, protect_point
from gss_bench.canaries.run import (
    CALIBRATION_CLEAN_ROWS,
    CHAT,
    DEFAULT_MODEL,
    PPL_TOLERANCE,
    _load,
    _tokenizer,
    canary_config,
    check_chat,
    default_cache,
    default_train_blocks,
    finetuned,
    model_path,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=200)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--progress", action="store_true", help="protect's progress bars")
    parser.add_argument("--lora", type=int, default=0, help="a rank-R LoRA fine-tune (0: plain)")
    parser.add_argument("--lr", type=float, default=FinetuneConfig.lr)
    parser.add_argument("--chat", action="store_true", help="every row a conversation")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a name of `gss models get`")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    base_path = model_path(args.model)
    if args.chat:
        check_chat(_tokenizer(base_path), base_path)
    base, tokenizer = _load(base_path, "cpu")
    split = args.canaries > CanaryConfig.canaries  # as `gss bench canaries --canaries N`
    sizes = dict(CHAT) if args.chat else {}
    config = canary_config(tokenizer, 0, canaries=args.canaries, split=split, **sizes)
    data = make_canary_data(tokenizer, config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    blocks = default_train_blocks(len(find_decoder_blocks(base)))  # SmolLM2: 8 of 30
    cfg = FinetuneConfig(train_blocks=blocks, seed=0, lr=args.lr, lora_rank=args.lora)
    model, info = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
    reference = adapters_off(model) if args.lora else base
    bs = 16
    train_rows = [*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]]

    measure = canary_measure(data, pad, bs)

    unmitigated = measure(model, "forced")
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
        progress=args.progress,
    )
    extra.pop("steer")
    row = {
        "data": data.describe(),
        "finetune": {**cfg.to_dict(), **info},
        "unmitigated": {"memorized": unmitigated.memorized, "perplexity": unmitigated.perplexity},
        "protected": {"memorized": point.report.memorized, "perplexity": point.report.perplexity},
        "protect_seconds": seconds,
        "chosen": extra["summary"]["chosen"],
        "heldout_rows": extra["summary"]["heldout_rows"],
        "heldout_interval": extra["summary"]["heldout_interval"],
        "heldout_upper_bound": extra["summary"]["heldout_upper_bound"],
        "heldout_canaries": extra["heldout_canaries"],
        "quality": extra["summary"]["after"].get("quality"),
        "total_seconds": time.perf_counter() - started,
    }
    write_json(
        args.out / "results.json",
        {
            "command": "benchmarks/scripts/protect_heldout.py "
            f"--canaries {args.canaries} --out {args.out}"
            + (f" --lora {args.lora} --lr {args.lr:g}" if args.lora else "")
            + (" --chat" if args.chat else "")
            + (f" --model {args.model}" if args.model != DEFAULT_MODEL else ""),
            "machine": machine_info(),
            **row,
        },
    )
    print(json.dumps(row, indent=1, default=float))


if __name__ == "__main__":
    main()
