"""gss protect's search with the blocks below each steer replayed (`gss.steering.prefix_replay`)
and with every block run for every point, interleaved in one run: the same points to the last
bit, and how long each search took.

A developer's measurement script (not part of ``gss bench``) on the cached TinyMem models
(``gss bench tinymem`` trains them) and, with ``--canaries lora``, the LoRA canary fine-tune of
``gss bench canaries --lora 16 --lr 1e-3`` (SmolLM2-135M, 30 blocks):

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/scripts/protect_replay.py --rounds 2 \\
        --out results/protect-replay
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gss.protect import measure, protect
from gss.report import machine_info, write_json
from gss.steering.prefix_replay import BlockPrefixReplay

ARMS = ("replayed", "every block")


class _Counted(BlockPrefixReplay):
    """Keeps the last instance the search made, to read how many calls it replayed."""

    last: BlockPrefixReplay | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Counted.last = self


class _EveryBlock(_Counted):
    """Replays nothing: every block runs for every point."""

    @contextmanager
    def below(self, layer: int) -> Iterator[None]:
        yield


def _search(model: Any, reference: Any, arguments: dict[str, Any], arm: str) -> dict[str, Any]:
    """One protect run in ``arm``: its seconds, the points it measured, what it replayed."""
    kind = _EveryBlock if arm == "every block" else _Counted
    setattr(measure, "BlockPrefixReplay", kind)  # noqa: B010  (what the search's Judge makes)
    try:
        started = time.perf_counter()
        result = protect(model, reference, progress=False, **arguments)
        wall = time.perf_counter() - started
    finally:
        setattr(measure, "BlockPrefixReplay", BlockPrefixReplay)  # noqa: B010
    replay = _Counted.last
    return {
        "seconds": {**result.seconds, "wall": wall},
        "points": len(result.trials),
        "trials": [repr(t) for t in result.trials],
        "chosen": repr(result.chosen),
        "blocks": len(replay.blocks) if replay else None,
        "replayed_calls": replay.replayed if replay else None,
        "switched_off": bool(replay and replay.off),
    }


def _tinymem_cases(settings: list[str]) -> list[tuple[str, Any, Any, dict[str, Any]]]:
    """Each setting's seed-0 models (cached) and the arguments `gss bench tinymem` gives
    protect."""
    from gss_bench.tinymem.protection import protect_arguments
    from gss_bench.tinymem.train import get_models

    cases = []
    for setting in filter(None, settings):
        mem, ref, data, _ = get_models(setting, "default", 0, None, progress=False)
        cases.append((f"TinyMem {setting}, seed 0", mem, ref, protect_arguments(data, 256)))
    return cases


def _canary_case(setting: str) -> tuple[str, Any, Any, dict[str, Any]]:
    """The cached canary fine-tune, its reference, and the arguments `gss bench canaries`
    gives protect."""
    from gss.hf.adapters import adapters_off
    from gss_bench.canaries.finetune import FinetuneConfig
    from gss_bench.canaries.run import (
        CALIBRATION_CLEAN_ROWS,
        PPL_TOLERANCE,
        default_cache,
        default_setup,
        finetuned,
    )

    assert setting == "lora"
    base_path, base, tokenizer, data, pad = default_setup(chat=False)
    cfg = FinetuneConfig(seed=0, lora_rank=16, lr=1e-3)
    model, _ = finetuned(base, base_path, data, cfg, pad, default_cache(), tokenizer)
    rows = [*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]]
    arguments = {  # as gss_bench.canaries.protection.protect_point passes them
        "texts": [list(r) for r in rows],
        "tokenizer": tokenizer,
        "general": [list(r) for r in data.general_rows],
        "heldout": [list(r) for r in data.heldout_rows],
        "budget": PPL_TOLERANCE,
        "k": data.config.k,
        "n": data.config.row_len,
        "batch_size": 16,
        "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    }
    return "canaries, LoRA fine-tune (SmolLM2-135M)", model, adapters_off(model), arguments


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | blocks | points | search, every block (s) | search, replayed (s) | speed-up "
        "(median of rounds) [range] | same points |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['blocks']} | {row['points']} | "
            f"{statistics.median(row['every block']):.1f} | "
            f"{statistics.median(row['replayed']):.1f} | **{row['speedup']:.2f}x** "
            f"[{min(row['ratios']):.2f}-{max(row['ratios']):.2f}] | "
            f"{'yes' if row['same'] else 'NO'} |"
        )
    return "\n".join(lines)


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(rows)))
    names = [r["case"] for r in rows]
    ax.barh(names, [r["speedup"] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("search time, every block / replayed (median of rounds)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings",
        default="math_noise,math_backdoor,lang_noise,lang_backdoor",
        help="TinyMem settings, comma-separated ('' for none)",
    )
    parser.add_argument("--canaries", choices=["lora"], help="also the LoRA canary fine-tune")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--canary-rounds", type=int, default=1, help="rounds on the canaries")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = [(*case, args.rounds) for case in _tinymem_cases(args.settings.split(","))]
    if args.canaries:
        cases.append((*_canary_case(args.canaries), args.canary_rounds))
    rows = []
    for name, model, reference, arguments, rounds in cases:
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for r in range(rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:  # the order alternates by round
                runs[arm].append(_search(model, reference, arguments, arm))
                print(f"{name}, round {r}, {arm}: {runs[arm][-1]['seconds']['search']:.1f} s")
        every = [run["seconds"]["search"] for run in runs["every block"]]
        replayed = [run["seconds"]["search"] for run in runs["replayed"]]
        ratios = [e / p for e, p in zip(every, replayed, strict=True)]
        trials = {tuple(run["trials"]) for arm in ARMS for run in runs[arm]}
        rows.append(
            {
                "case": name,
                "blocks": runs["replayed"][0]["blocks"],
                "points": runs["replayed"][0]["points"],
                "every block": every,
                "replayed": replayed,
                "ratios": ratios,
                "speedup": statistics.median(ratios),
                "same": len(trials) == 1
                and len({run["chosen"] for arm in ARMS for run in runs[arm]}) == 1,
                "replayed_calls": [run["replayed_calls"] for run in runs["replayed"]],
                "switched_off": any(run["switched_off"] for run in runs["replayed"]),
                "runs": runs,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    given = {k.replace("_", "-"): v for k, v in vars(args).items() if v is not None}
    command = "benchmarks/scripts/protect_replay.py " + " ".join(
        f"--{k} {shlex.quote(str(v))}" for k, v in given.items() if k != "out"
    )
    write_json(
        args.out / "results.json", {"command": command, "machine": machine_info(), "rows": rows}
    )
    table = _table(rows)
    (args.out / "table.md").write_text(
        "# gss protect: the blocks below each steer replayed, or run for every point\n\n"
        + table
        + f"\n\n`{command}`; search = protect's own `seconds['search']` (steps 4-7), both arms "
        "in one process, their order alternating by round. Same points: every point measured "
        "(block, delta, % extractable, utility) equal to the last bit in every run of both "
        "arms, and the same point chosen.\n"
    )
    _figure(rows, args.out / "speed.png")
    print(table)


if __name__ == "__main__":
    main()
