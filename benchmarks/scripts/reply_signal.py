"""Does the memorization signal tell a chat fine-tune trained on its replies alone?

A developer's measurement script (not part of ``gss bench``): for the canary benchmark's two
chat fine-tunes of SmolLM2-135M (``gss bench canaries --chat``, every token trained on, and
``--chat --replies-only``, the loss on the assistant's messages alone; each read from the
bench's cache, or trained once, 6-8 min), it calibrates on the bench's 96 calibration
conversations (32 canaries, 64 clean) at block 22, the block both benches steer, with every
token memorizable, and records omega on the replies and on the other tokens
(``gss.signal.replies``), how many of each count as memorized, and whether calibration warned.

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/reply_signal.py [--out DIR]
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

from gss import GSSWarning
from gss.report import machine_info, markdown_table, write_json
from gss.statistics.collect import collect_statistics
from gss_bench.canaries.finetune import FinetuneConfig
from gss_bench.canaries.run import (
    CALIBRATION_CLEAN_ROWS,
    default_cache,
    default_setup,
    finetuned,
)

LAYER = 22
COMMAND = "ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/reply_signal.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/reply-signal")
    args = parser.parse_args()
    torch.set_num_threads(2)
    base_path, base, tokenizer, data, pad = default_setup(chat=True)
    rows = [list(c) for c in data.conversations[: len(data.canary_rows) + CALIBRATION_CLEAN_ROWS]]
    found = []
    for replies_only in (False, True):
        cfg = FinetuneConfig(seed=0, replies_only=replies_only)  # the bench's defaults
        model, _ = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = collect_statistics(
                model, base, rows, tokenizer=tokenizer, layer=LAYER, progress=False
            )
        said = [str(w.message) for w in caught if issubclass(w.category, GSSWarning)]
        restricted = collect_statistics(
            model, base, rows, tokenizer=tokenizer, layer=LAYER, replies_only=True, progress=False
        )
        memorized = stats.counts["memorized"]
        in_replies = restricted.counts["memorized"]
        found.append(
            {
                "fine-tuned on": "the replies alone" if replies_only else "every token",
                **stats.counts["replies"],
                "memorized": memorized,
                "memorized_in_replies": in_replies,
                "memorized_outside": memorized - in_replies,
                "warned": said,
            }
        )
        print(found[-1], flush=True)
        del model
    out = Path(args.out)
    result = {
        "command": COMMAND,
        "machine": machine_info(),
        "model": "SmolLM2-135M, top 8 of 30 blocks fine-tuned on the chat canaries (seed 0)",
        "layer": LAYER,
        "calibration": f"{len(rows)} conversations (32 canaries, 64 clean), every token "
        "memorizable (omega > 0)",
        "rows": found,
    }
    write_json(out / "results.json", result)
    header = [
        "fine-tuned on",
        "omega a reply token",
        "omega a token outside",
        "memorized: replies / outside",
        "warned",
    ]
    table = markdown_table(
        header,
        [
            [
                r["fine-tuned on"],
                f"{r['reply_omega_mean']:.2f} ({r['reply_tokens']} tokens)",
                f"{r['other_omega_mean']:.2f} ({r['other_tokens']} tokens)",
                f"{r['memorized_in_replies']} / {r['memorized_outside']}",
                "yes" if r["warned"] else "no",
            ]
            for r in found
        ],
    )
    (out / "table.md").write_text(
        "# The memorization signal on the replies and outside them\n\n"
        f"`{COMMAND}`; {result['model']}; block {LAYER}; {result['calibration']}. "
        '"Memorized: replies / outside": the tokens with omega > 0 on the assistant\'s '
        "messages (as `replies_only=True` finds them) and elsewhere.\n\n"
        f"{table}\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
