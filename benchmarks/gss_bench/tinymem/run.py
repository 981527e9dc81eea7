"""``gss bench tinymem``: the paper's Table 1 on TinyMem, trained and measured on this machine.

For each setting and seed: train (or load from the cache) the memorizing and the clean
reference model, evaluate the unmitigated model, run one calibration pass at the chosen layer,
and sweep each method's strength (GSS gated, the same directions ungated, mean-difference
steering). Each method is reported at the strength the selection rule picks (lowest %
memorized whose validation utility stays within tolerance; see ``methods``); every grid point
is in the JSON. Writes ``results.json``, ``table.md`` and PNG figures under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gss import GSSError, __version__
from gss.protect import SearchSpace
from gss.report import cpu_capability, cpu_info, machine_info, markdown_table, write_json
from gss_bench import baseline_names, transformers_bars_off
from gss_bench.baselines import get_method
from gss_bench.protect_report import check_report_dir
from gss_bench.tinymem import leak_modes as LM
from gss_bench.tinymem import methods as M
from gss_bench.tinymem.data import SETTINGS
from gss_bench.tinymem.paper import PAPER
from gss_bench.tinymem.protection import PROTECT, protect_row, share_on
from gss_bench.tinymem.train import default_cache_dir, get_models, get_preset
from gss_bench.trained_on import (
    KEY_CPU_CAPABILITY,
    KEY_THREADS,
    describe_numerics,
    numerics_slug,
    same_numerics,
)

# Calibration passes shared by the methods: the presets (gss.config.PRESETS) they start from.
CALIBRATIONS: dict[str, str] = {
    "paper": "gss",  # GSS as published: omega > 0, log-likelihood target, one summed backward
    "tr": "gss-tr",
}
# Methods: (calibration pass, kind, options applied at attach time).
METHOD_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "GSS": ("paper", "gss", {}),
    "GSS ungated": ("paper", "gss", {"gate": "none"}),
    "Mean-diff": ("paper", "mean-diff", {}),
    "GSS-TR": ("tr", "gss", {}),
    "GSS-TR ungated": ("tr", "gss", {"gate": "none"}),
}
METHODS = (*METHOD_SPECS, PROTECT)
DEFAULT_LAYER = 1
DEFAULT_RANK = 4
ABLATIONS = ("layer", "rank", "percentile", "coefficient", "gate", "variant", "reference")
# The `variant` ablation: each single change of the calibration that the prototype combined,
# then all three (GSS-TR is the toward-reference change alone; see gss.config.PRESETS).
VARIANT_STEPS: dict[str, dict[str, Any]] = {
    "paper": {},
    "omega > 1 nat": {"omega_threshold": 1.0},
    "toward-reference (GSS-TR)": {"target": "toward-reference"},
    "per-position": {"gradient": "per-position"},
    "all three": {
        "omega_threshold": 1.0,
        "target": "toward-reference",
        "gradient": "per-position",
    },
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gss bench tinymem", description=__doc__.split("\n")[0])
    p.add_argument(
        "--settings",
        default="math_noise",
        help=f"comma-separated from {', '.join(SETTINGS)}, or 'all' (default math_noise)",
    )
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--quick", action="store_true", help="tiny models and data (smoke test)")
    p.add_argument("--preset", default=None, help="data/model preset (default, quick, paper)")
    p.add_argument("--layer", type=int, default=DEFAULT_LAYER, help="0-based block to steer")
    p.add_argument("--rank", type=int, default=DEFAULT_RANK, help="GSS directions K")
    p.add_argument(
        "--deltas",
        default=None,
        help="comma-separated delta grid for every sweep (default: the full grid)",
    )
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated from {', '.join(METHODS)} (default all)",
    )
    p.add_argument(
        "--baselines",
        default="",
        help="also run these baselines, each over its default grid: comma-separated names "
        "(see `gss baselines`), families (steering, unlearning, fine-tuning, neuron, weight, "
        "decoding) "
        "or 'all' (default none)",
    )
    p.add_argument(
        "--ablation",
        action="append",
        choices=ABLATIONS,
        default=[],
        help="also run this ablation (repeatable)",
    )
    p.add_argument(
        "--cache-dir", default=None, help=f"trained models (default {default_cache_dir()})"
    )
    p.add_argument("--out", default=None, help="results folder (default results/tinymem[-quick])")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: the cores, split evenly among --jobs)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run this many (setting, seed) pairs at once, each in its own process with its "
        "share of the cores, and no progress bars (default 1). Times in the table are then "
        "measured on that share",
    )
    p.add_argument(
        "--protect-prefer",
        choices=["reference", "margin", "utility"],
        default=SearchSpace.prefer,
        help=f"{PROTECT}: how points at the target are ranked (gss.SearchSpace.prefer)",
    )
    p.add_argument(
        "--protect-gates",
        default=",".join(SearchSpace.gates),
        help=f"{PROTECT}: comma-separated gates it may choose, the first tried on every block "
        f"(gss.SearchSpace.gates; default {','.join(SearchSpace.gates)})",
    )
    p.add_argument(
        "--protect-reply-check",
        type=int,
        default=SearchSpace.reply_check,
        help=f"{PROTECT}: how many of the best points at the target have their replies checked "
        "for loops (gss.SearchSpace.reply_check; 0: off)",
    )
    p.add_argument(
        "--leak-modes",
        action="store_true",
        help=f"also measure {PROTECT}, its hand-over and each baseline's chosen point the ways "
        "an attacker finds leaks (near-verbatim, sampled, longer and shorter prefixes: "
        "gss_bench.tinymem.leak_modes); writes leak_modes.md",
    )
    p.add_argument("--batch-size", type=int, default=256, help="evaluation batch size")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="DIR",
        help="run nothing: add the runs saved in DIR/results.json (repeatable) to --out's and "
        "rewrite its table and figures",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="overwrite --out; by default runs of other settings/seeds already in its "
        "results.json are kept and tabulated with the new ones",
    )
    return p


def _run_key(record: dict[str, Any]) -> tuple[str, int, str]:
    return (record["setting"], int(record["seed"]), record.get("preset", "default"))


def merge_runs(previous: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`new` plus every run of `previous` whose (setting, seed, preset) was not rerun.

    Lets the long table be built one setting at a time (`--settings lang_noise` after
    `--settings math_noise`) without losing the earlier runs; a rerun replaces its old record.
    A rerun on the same models and data keeps the methods of the old record it did not run
    (named in ``methods_kept``): `make bench`, which runs no baselines, leaves the baselines of
    an earlier ``--baselines all`` run of that seed in the table.
    """
    old = {_run_key(r): r for r in previous}
    fresh = {_run_key(r) for r in new}
    kept = [r for r in previous if _run_key(r) not in fresh]
    new = [_with_methods_of(r, old.get(_run_key(r))) for r in new]
    order = {name: i for i, name in enumerate(SETTINGS)}
    return sorted([*kept, *new], key=lambda r: (order.get(r["setting"], 99), int(r["seed"])))


def _with_methods_of(record: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """``record`` plus the methods only ``before`` has, when both ran on the same models."""
    if before is None or "methods" not in record or "methods" not in before:
        return record
    same = _models_of(record) == _models_of(before) and record.get("data") == before.get("data")
    missing = {n: m for n, m in before["methods"].items() if n not in record["methods"]}
    if not same or not missing:
        return record
    earlier = before.get("methods_kept", {})
    kept = {n: earlier.get(n, before.get("command", "an earlier run")) for n in missing}
    return {
        **record,
        "methods": {**record["methods"], **missing},
        "methods_kept": {**record.get("methods_kept", {}), **kept},
    }


def _models_of(record: dict[str, Any]) -> dict[str, Any]:
    """The models' identity: cache folder and training record, not whether this run loaded
    them or trained them."""
    models = record.get("models") or {}
    return {role: {k: v for k, v in m.items() if k != "loaded"} for role, m in models.items()}


def _other_numerics(out: Path, threads: int) -> list[str]:
    """The numerics (CPU, vector instructions, threads) that trained the models of the table
    in `out` when they are not this machine's at `threads`: the same seeds train other weights
    there, and their runs and this machine's would mix in one table, this run's figures
    written over theirs. Empty when `out` has no table or this machine's models alone."""
    import json

    path = out / "results.json"
    if not path.is_file():
        return []
    named = [
        model["trained_on"]
        for run in json.loads(path.read_text()).get("runs", [])
        for model in (run.get("models") or {}).values()
        if model.get("trained_on")
    ]
    return sorted({describe_numerics(t, threads) for t in named if not same_numerics(t, threads)})


def _settings(text: str) -> list[str]:
    names = list(SETTINGS) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in SETTINGS:
            raise SystemExit(f"gss bench tinymem: unknown setting {name!r}; use {SETTINGS}")
    return names


def _log(message: str) -> None:
    print(f"[tinymem {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _merged_from(folders: Sequence[str], out: Path) -> list[dict[str, Any]]:
    """The runs saved in other results folders (later folders win on the same setting, seed
    and preset), with their pilot-study figures copied into `out`: so seeds or settings run
    apart (other processes, other machines) make one table."""
    import json
    import shutil

    records: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    for folder in map(Path, folders):
        path = folder / "results.json"
        if not path.is_file():
            raise SystemExit(f"gss bench tinymem --merge: {path} does not exist")
        runs = json.loads(path.read_text()).get("runs", [])
        records = merge_runs(records, runs)
        for run in runs:
            name = f"signal_{run['setting']}_seed{run['seed']}.png"
            if (folder / name).is_file() and folder.resolve() != out.resolve():
                shutil.copyfile(folder / name, out / name)
        _log(f"merging {len(runs)} run(s) from {path}")
    return records


def _worker_start(threads: int) -> None:
    torch.set_num_threads(threads)


def _run_in_processes(
    units: list[tuple[str, int]], args: argparse.Namespace, out: Path
) -> list[dict[str, Any]]:
    """`run_one` for every (setting, seed) in `args.jobs` spawned processes, in `units`' order.

    On a small CPU, one process per core runs these small models faster than one process using
    every core (their ops are too small to split well); each process gets its share of threads.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = min(args.jobs, len(units))
    threads = args.threads or max(1, (os.cpu_count() or 1) // jobs)
    _log(f"{len(units)} runs in {jobs} processes of {threads} thread(s) each")
    worker_args = argparse.Namespace(**{**vars(args), "no_progress": True})
    with ProcessPoolExecutor(
        jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_start,
        initargs=(threads,),
    ) as pool:
        futures = [pool.submit(run_one, s, seed, worker_args, out) for s, seed in units]
        return [f.result() for f in futures]


def run_one(setting: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Everything measured for one (setting, seed)."""
    started = time.perf_counter()
    _log(f"{setting}, seed {seed}")
    if args.no_progress:
        transformers_bars_off()
    preset = args.preset or ("quick" if args.quick else "default")
    mem, ref, data, info = get_models(
        setting, preset, seed, args.cache_dir, progress=not args.no_progress
    )
    trained = time.perf_counter() - started
    base = M.evaluate(mem, data, args.batch_size)
    reference = M.evaluate(ref, data, args.batch_size)
    _log(
        f"{setting} seed {seed}: unmitigated {base.memorized:.1f}% memorized of {base.rows} rows, "
        f"correct {base.correct:.1f}%, utility {base.utility:.2f} (eval {base.seconds:.1f} s); "
        f"reference {reference.memorized:.1f}% / {reference.correct:.1f}% / "
        f"{reference.utility:.2f}"
    )
    texts = M.calibration_rows(data, base)
    gen = M.general_rows(data)
    signal = pilot_signal(
        mem,
        ref,
        texts,
        gen,
        out / f"signal_{setting}_seed{seed}.png",
        f"TinyMem {setting} seed {seed}: omega on memorized + clean rows",
    )
    passes: dict[str, Any] = {}
    for name in dict.fromkeys(METHOD_SPECS[m][0] for m in args.methods if m in METHOD_SPECS):
        stats = M.calibrate_layer(mem, ref, texts, gen, args.layer, CALIBRATIONS[name])
        passes[name] = (stats, M.build_artifact(mem, stats, rank=args.rank, progress=False))
    sweeps, mitigation_time = {}, {}
    for name in (m for m in args.methods if m in METHOD_SPECS):
        calib, kind, options = METHOD_SPECS[name]
        stats, artifact = passes[calib]
        t = artifact.provenance.timings
        if kind == "mean-diff":
            sweeps[name] = M.mean_diff_sweep(
                mem, data, stats, batch_size=args.batch_size, base=base
            )
            mitigation_time[name] = t["signal"] + t["statistics"]
        else:
            sweeps[name] = M.gss_sweep(
                mem,
                data,
                artifact,
                deltas=args.delta_grid,
                batch_size=args.batch_size,
                base=base,
                **options,
            )
            mitigation_time[name] = t["total"]
    methods: dict[str, Any] = {}
    selected: dict[str, Any] = {}  # each method's chosen evaluation, per row
    for name, points in sweeps.items():
        chosen = M.select(points, base, data)
        selected[name] = chosen["eval"]
        methods[name] = {
            "selected": {**chosen, "eval": chosen["eval"].to_dict()},
            "grid": M.summarize(points),
            "mitigation_seconds": mitigation_time[name],
        }
        _log_choice(name, chosen)
    protected_steer: dict[str, Any] = {}  # protect's steer, for the leak modes
    chosen_made: dict[str, Any] = {}  # each baseline's chosen Mitigation, the same
    if PROTECT in args.methods:
        report_dir = out / f"protect_{setting}_seed{seed}"
        protected = protect_row(
            mem,
            ref,
            data,
            base,
            args.batch_size,
            seed,
            report_dir=report_dir,
            search=SearchSpace(
                prefer=args.protect_prefer,
                gates=tuple(args.protect_gates.split(",")),
                reply_check=args.protect_reply_check,
            ),
            keep=protected_steer,
        )
        methods[PROTECT] = protected
        if "heldout_rows" in protected:  # the other methods on the rows protect held out
            for name, ev in selected.items():
                protected["heldout_rows"]["by_method"][name] = share_on(
                    ev, protected["protect"]["heldout_index"]
                )[1]
        got = protected["selected"]["eval"]
        _log(
            f"  {PROTECT} {_strength(protected['selected'])}: {got['memorized']:.1f}% memorized, "
            f"{got['correct']:.1f}% correct, utility {got['utility']:.2f} "
            f"({protected['mitigation_seconds']:.0f} s)"
        )
    if args.baseline_names:
        mdata = M.baseline_data(data, base, args.layer)
        checkpoint = BaselineCheckpoint(out, setting, seed, preset, info)
        for name in args.baseline_names:
            row = checkpoint.done.get(name)
            if row is not None:
                _log(f"  baseline {name}: kept from the interrupted run in {checkpoint.path}")
                methods[name] = row
                continue
            _log(f"  baseline {name} ...")
            swept = time.perf_counter()
            made: dict[int, Any] = {}
            points = M.baseline_sweep(mem, data, name, mdata, args.batch_size, base, made)
            chosen = M.select(points, base, data)
            chosen_made[name] = (made[int(chosen["strength"])], mdata)
            grid = get_method(name).grid
            evaluated = {int(p["strength"]) for p in points}
            methods[name] = {
                "baseline": True,
                "family": get_method(name).family,
                "selected": {**chosen, "eval": chosen["eval"].to_dict()},
                "grid": M.summarize(points),
                # grid points a milder failed point ruled out (Method.dominated): not run
                "skipped": [dict(g) for i, g in enumerate(grid) if i not in evaluated],
                "mitigation_seconds": chosen["seconds"],
                # the whole default grid: every point's mitigation and evaluation
                "grid_seconds": time.perf_counter() - swept,
            }
            checkpoint.save(name, methods[name])
            _log_choice(name, chosen)
            skipped = len(grid) - len(points)
            _log(
                f"    grid of {len(points)} points: {methods[name]['grid_seconds']:.1f} s"
                + (f" ({skipped} stronger points skipped)" if skipped else "")
            )
    record: dict[str, Any] = {
        "setting": setting,
        "seed": seed,
        "preset": preset,
        "data": data.describe(),
        "models": {role: _model_summary(rec) for role, rec in info.items()},
        "unmitigated": base.to_dict(),
        "reference": reference.to_dict(),
        "calibration": {
            name: {
                "options": CALIBRATIONS[name],
                "layer": stats.layer,
                "rank": args.rank,
                "rows": len(texts),
                "general_rows": len(gen),
                "token_counts": art.provenance.token_counts,
                "gate_open_share": art.provenance.gate_open_share,
                "timings": art.provenance.timings,
                "signal_strength": M.signal_strength(stats),
            }
            for name, (stats, art) in passes.items()
        },
        "signal": signal,
        "methods": methods,
        "seconds": {"models": trained, "total": time.perf_counter() - started},
        "threads": torch.get_num_threads(),
    }
    if args.leak_modes:
        heldout = methods.get(PROTECT, {}).get("protect", {}).get("heldout_index")
        setups = LM.setups(mem, ref, record, protected_steer.get("steer"), chosen_made)
        record["leak_modes"] = LM.measure(
            setups, data, args.batch_size, heldout if data.noised else None
        )
    for name in args.ablation:
        record.setdefault("ablations", {})[name] = run_ablation(
            name, mem, ref, data, base, texts, gen, args, setting, seed
        )
    return record


class BaselineCheckpoint:
    """Baseline rows finished so far for one (setting, seed, preset), on disk after each method.

    A full ``--baselines all`` run takes tens of minutes per setting and writes results.json
    only at its end; if it is interrupted, rerunning the same command keeps the finished rows
    (same trained models, checked by their cache paths) and runs only the rest. The file is
    removed once results.json holds the run.
    """

    def __init__(
        self, out: Path, setting: str, seed: int, preset: str, models: dict[str, Any]
    ) -> None:
        self.path = self._path(out, setting, seed, preset)
        self.models = {role: str(rec.get("cache")) for role, rec in models.items()}
        self.done: dict[str, Any] = {}
        if self.path.exists():
            import json

            saved = json.loads(self.path.read_text())
            if saved.get("models") == self.models:
                self.done = saved.get("methods", {})

    def save(self, name: str, row: dict[str, Any]) -> None:
        self.done[name] = row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"models": self.models, "methods": self.done})

    @staticmethod
    def _path(out: Path, setting: str, seed: int, preset: str) -> Path:
        return out / "partial" / f"{setting}-seed{seed}-{preset}.json"

    @staticmethod
    def clear(out: Path, record: dict[str, Any]) -> None:
        """Drop the checkpoint of a run now saved in results.json (and the folder if empty)."""
        path = BaselineCheckpoint._path(out, record["setting"], record["seed"], record["preset"])
        path.unlink(missing_ok=True)
        if path.parent.is_dir() and not any(path.parent.iterdir()):
            path.parent.rmdir()


def _log_choice(name: str, chosen: dict[str, Any]) -> None:
    ev = chosen["eval"]
    _log(
        f"  {name:12s} {_strength(chosen)}: {ev.memorized:.1f}% memorized, "
        f"{ev.correct:.1f}% correct, utility {ev.utility:.2f}"
        + ("" if chosen["within_tolerance"] else " (no strength within tolerance)")
    )


def _strength(point: dict[str, Any]) -> str:
    """A selected point's strength: delta/alpha, or a baseline's hyperparameters."""
    if "params" in point:
        return " ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in point["params"].items()
        )
    return f"{point['strength']:g}"


def pilot_signal(mem: Any, ref: Any, texts: list, gen: list, path: Path, title: str) -> dict:
    """omega on the calibration rows and as many clean rows: the paper's pilot statistics."""
    from gss.data import batches
    from gss.report import plot_signal
    from gss.signal.omega import memorization_signal, signal_statistics

    omegas = []
    for batch in batches([list(r) for r in [*texts, *gen[: len(texts)]]], 256):
        omegas.append(memorization_signal(mem, ref, batch.input_ids, batch.attention_mask))
    width = max(o.shape[1] for o in omegas)
    omega = torch.cat(
        [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=float("nan")) for o in omegas]
    )
    stats = signal_statistics(omega)
    plot_signal(omega, stats, path, title)
    return stats.to_dict()


def run_ablation(
    name: str,
    mem: Any,
    ref: Any,
    data: Any,
    base: Any,
    texts: list,
    gen: list,
    args: argparse.Namespace,
    setting: str = "",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One ablation: variants of GSS, each swept over delta and reported by the same rule."""
    bs = args.batch_size
    rows = []

    def add(label: Any, points: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        chosen = M.select(points, base, data)
        rows.append(
            {
                "variant": label,
                **extra,
                "selected": {**chosen, "eval": chosen["eval"].to_dict()},
                "grid": M.summarize(points),
            }
        )

    if name == "layer":
        n_layers = len(mem.transformer.h)
        for layer in range(n_layers):
            stats = M.calibrate_layer(mem, ref, texts, gen, layer)
            art = M.build_artifact(mem, stats, rank=args.rank, progress=False)
            add(
                layer,
                M.gss_sweep(mem, data, art, deltas=args.delta_grid, batch_size=bs, base=base),
                {
                    "signal_strength": M.signal_strength(stats),
                    "gate_open_share": art.provenance.gate_open_share["union"],
                },
            )
        return rows
    if name == "variant":
        for label, options in VARIANT_STEPS.items():
            stats = M.calibrate_layer(mem, ref, texts, gen, args.layer, **options)
            art = M.build_artifact(mem, stats, rank=args.rank, progress=False)
            info = {
                "memorized_share": stats.counts["memorized_share"],
                "calibration_seconds": art.provenance.timings["total"],
            }
            add(
                f"{label}, gated",
                M.gss_sweep(mem, data, art, deltas=args.delta_grid, batch_size=bs, base=base),
                info,
            )
            add(
                f"{label}, ungated",
                M.gss_sweep(
                    mem, data, art, deltas=args.delta_grid, batch_size=bs, base=base, gate="none"
                ),
                info,
            )
        return rows
    if name == "reference":
        preset = args.preset or ("quick" if args.quick else "default")
        full = get_preset(setting, preset).reference.epochs
        epochs = sorted({*get_preset(setting, preset).reference.snapshots, full})
        for ep in epochs:
            _, ref_ep, _, _ = get_models(
                setting, preset, seed, args.cache_dir, progress=False, reference_epochs=ep
            )
            stats = M.calibrate_layer(mem, ref_ep, texts, gen, args.layer)
            art = M.build_artifact(mem, stats, rank=args.rank, progress=False)
            add(
                ep,
                M.gss_sweep(mem, data, art, deltas=args.delta_grid, batch_size=bs, base=base),
                {"memorized_share": stats.counts["memorized_share"]},
            )
        return rows
    stats = M.calibrate_layer(mem, ref, texts, gen, args.layer)
    if name == "rank":
        full_art = M.build_artifact(mem, stats, rank=16, progress=False)
        for k in (1, 2, 4, 8, 16):
            art = full_art.with_options(rank=k)
            add(
                k, M.gss_sweep(mem, data, art, deltas=args.delta_grid, batch_size=bs, base=base), {}
            )
    elif name == "percentile":
        for pct in (90.0, 95.0, 99.0, 99.9):
            art = M.build_artifact(
                mem, stats, rank=args.rank, threshold_percentile=pct, progress=False
            )
            add(
                pct,
                M.gss_sweep(mem, data, art, deltas=args.delta_grid, batch_size=bs, base=base),
                {"gate_open_share": art.provenance.gate_open_share["union"]},
            )
    elif name == "coefficient":
        art = M.build_artifact(mem, stats, rank=args.rank, progress=False)
        for coef in ("projection", "ridge", "paper-constant"):
            add(
                coef,
                M.gss_sweep(
                    mem,
                    data,
                    art,
                    deltas=args.delta_grid,
                    batch_size=bs,
                    base=base,
                    coefficient=coef,
                ),
                {},
            )
    elif name == "gate":
        for gate in ("hard", "relu", "none", "discriminant"):
            art = M.build_artifact(mem, stats, rank=args.rank, gate=gate, progress=False)
            add(
                gate,
                M.gss_sweep(mem, data, art, deltas=args.delta_grid, batch_size=bs, base=base),
                {"gate_open_share": art.provenance.gate_open_share["union"]},
            )
    return rows


def _model_summary(record: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "cache",
        "loaded",
        "train_seconds",
        "tokens_per_second",
        "epochs",
        "threads",
        "trained_on",
    )
    out = {k: record[k] for k in keep if k in record}
    log = record.get("log") or {}
    if isinstance(log, dict):
        out.update({k: log[k] for k in ("seconds", "tokens_per_second") if k in log})
    return out


def _fmt(values: Sequence[float], digits: int = 2) -> str:
    mean, sd = M.mean_std(values)
    if len(values) > 1:
        return f"{mean:.{digits}f} ± {sd:.{digits}f}"
    return f"{mean:.{digits}f}"


def table(records: list[dict[str, Any]]) -> str:
    """Markdown table laid out like the paper's Table 1, one block of columns per setting."""
    settings = list(dict.fromkeys(r["setting"] for r in records))
    lines = []
    for setting in settings:
        runs = sorted((r for r in records if r["setting"] == setting), key=lambda r: r["seed"])
        utility = "Acc %" if setting.startswith("math") else "Perp"
        header = [
            "Method",
            "% Mem",
            "% Correct",
            utility,
            "Time (s)",
            "Strength",
            f"paper % Mem / {utility} / s",
        ]
        rows_out = []

        def paper(name: str, setting: str = setting) -> str:
            p = PAPER[setting].get(name)
            if p is None:
                return "not in paper"
            return f"{p[0]:.2f} / {p[1]:.2f}" + (f" / {p[2]:g}" if p[2] is not None else "")

        for label, key in (("Unmitigated", "unmitigated"), ("Reference (clean)", "reference")):
            evs = [r[key] for r in runs]
            rows_out.append(
                [
                    label,
                    _fmt([e["memorized"] for e in evs]),
                    _fmt([e["correct"] for e in evs]),
                    _fmt([e["utility"] for e in evs]),
                    "--",
                    "--",
                    paper("Unmitigated") if key == "unmitigated" else "--",
                ]
            )
        names = dict.fromkeys(n for r in runs for n in r["methods"])
        ordered = [m for m in METHODS if m in names] + [n for n in names if n not in METHODS]
        for name in ordered:
            have = [r for r in runs if name in r["methods"]]
            sel = [r["methods"][name]["selected"] for r in have]
            evs = [s["eval"] for s in sel]
            rows_out.append(
                [
                    name,
                    _fmt([e["memorized"] for e in evs]),
                    _fmt([e["correct"] for e in evs]),
                    _fmt([e["utility"] for e in evs]),
                    _fmt([r["methods"][name]["mitigation_seconds"] for r in have], 3),
                    ", ".join(_strength(s) + ("" if s["within_tolerance"] else "*") for s in sel),
                    paper(name),
                ]
            )
        seeds = " / ".join(str(r["seed"]) for r in runs)
        n_rows = " / ".join(str(r["unmitigated"]["rows"]) for r in runs)
        lines.append(
            f"### {setting} (seed{'s' if len(runs) > 1 else ''} {seeds}; % memorized rests "
            f"on {n_rows} rows)\n"
        )
        lines.append(markdown_table(header, rows_out))
    lines.append(
        "\n% Mem: noise: rows reproducing their noised continuation; backdoor: attack success. "
        "% Correct: rows continued exactly like the clean twin. Utility: test half of the clean "
        "test sets. Strength: delta (GSS), alpha (mean-diff) or a baseline's grid point, "
        "picked by the rule: lowest % "
        f"memorized with validation accuracy within {M.ACC_TOLERANCE} point (perplexity within "
        f"{100 * M.PPL_TOLERANCE:.0f}%); * = no strength within tolerance. Time: mitigation "
        "pipeline (calibration passes, solve, thresholds) or the baseline's own wall clock "
        "(shared work such as neuron scores charged in full to every grid point) on this "
        "machine. Paper: its Table 1 (mean of 3 seeds, one H100).\n"
    )
    return "\n".join(lines)


def summary_table(records: list[dict[str, Any]]) -> str:
    """One row per method, one ``% Mem / utility (time)`` column per setting (seed means)."""
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in records)]
    names = dict.fromkeys(n for r in records for n in r["methods"])
    ordered = [m for m in METHODS if m in names] + [n for n in names if n not in METHODS]
    header = ["Method"] + [
        f"{s.replace('_', ' ')}: % Mem / {'Acc' if s.startswith('math') else 'Perp'} (s)"
        for s in settings
    ]

    def cell(evs: list[dict[str, Any]], seconds: list[float] | None, ok: bool = True) -> str:
        if not evs:
            return "--"
        mem = _fmt([e["memorized"] for e in evs], 1)
        text = f"{mem} / {_fmt([e['utility'] for e in evs])}"
        if seconds:
            text += f" ({M.mean_std(seconds)[0]:.3g})"
        return text + ("" if ok else "*")

    rows = []
    for label, key in (("Unmitigated", "unmitigated"), ("Clean reference model", "reference")):
        rows.append(
            [label] + [cell([r[key] for r in records if r["setting"] == s], None) for s in settings]
        )
    for name in ordered:
        row = [name]
        for s in settings:
            have = [
                r["methods"][name] for r in records if r["setting"] == s and name in r["methods"]
            ]
            row.append(
                cell(
                    [m["selected"]["eval"] for m in have],
                    [m["mitigation_seconds"] for m in have],
                    all(m["selected"]["within_tolerance"] for m in have),
                )
            )
        rows.append(row)
    return markdown_table(header, rows)


def heldout_table(records: list[dict[str, Any]]) -> str:
    """% memorized on the noised rows ``GSS protect`` held out of its search, by method (seed
    means): the fair comparison, since the summary's % Mem counts its tuning rows too. Empty
    when no run has them (protect not run, or backdoor settings, whose counted rows are never
    trained on and so already unseen)."""
    with_rows = [r for r in records if "heldout_rows" in r["methods"].get(PROTECT, {})]
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in with_rows)]
    if not settings:
        return ""
    by_setting = {
        s: [r["methods"][PROTECT]["heldout_rows"] for r in with_rows if r["setting"] == s]
        for s in settings
    }
    names = dict.fromkeys(n for rows in by_setting.values() for h in rows for n in h["by_method"])
    ordered = [n for n in ("Unmitigated", *METHODS) if n in names]
    header = ["Method"] + [
        f"{s.replace('_', ' ')}: % Mem on {' / '.join(str(h['rows']) for h in by_setting[s])} "
        "held-out rows"
        for s in settings
    ]
    rows = [
        [name]
        + [
            _fmt([h["by_method"][name] for h in by_setting[s] if name in h["by_method"]], 1)
            for s in settings
        ]
        for name in ordered
    ]
    return (
        "On the noised rows GSS protect held out of its search (half of the rows its audit "
        "found extractable, never used to choose; counted here by the benchmark's own test, "
        "which the unmitigated model fails on some of), every method at its selected point. "
        "The summary's % Mem above also counts the rows protect tuned on:\n\n"
        + markdown_table(header, rows)
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = _settings(args.settings)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.delta_grid = tuple(float(d) for d in args.deltas.split(",")) if args.deltas else M.DELTAS
    for m in args.methods:
        if m not in METHODS:
            raise SystemExit(f"gss bench tinymem: unknown method {m!r}; use {METHODS}")
    try:
        SearchSpace(gates=tuple(args.protect_gates.split(","))).check()
    except GSSError as e:
        raise SystemExit(f"gss bench tinymem: --protect-gates: {e}") from None
    args.baseline_names = baseline_names(args.baselines, "tinymem")
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    out = Path(args.out or ("results/tinymem-quick" if args.quick else "results/tinymem"))
    if args.jobs < 1:
        raise SystemExit(f"gss bench tinymem: --jobs must be >= 1, got {args.jobs}")
    units = [(setting, seed) for setting in settings for seed in seeds]
    started = time.perf_counter()
    if not args.merge and cpu_capability() != KEY_CPU_CAPABILITY:
        _log(
            f"torch's CPU kernels use {cpu_capability()} here; the committed tables' models were "
            "trained with AVX2, and these train other weights from the same seeds. "
            "ATEN_CPU_CAPABILITY=avx2 reproduces them on the CPU that trained them (make bench "
            "sets it)."
        )
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    if not args.merge and threads != KEY_THREADS:
        _log(
            f"{threads} thread(s) a process: the committed tables' models were trained on "
            f"{KEY_THREADS}, and another count trains other weights (--threads {KEY_THREADS}, "
            "as make bench runs it, with --jobs 1)."
        )
    others = [] if args.merge or args.fresh else _other_numerics(out, threads)
    if others and args.out is None:
        apart = out.with_name(f"{out.name}-{numerics_slug(threads)}")
        _log(
            f"{out} holds models trained on {'; '.join(others)}; this machine, "
            f"{describe_numerics({**cpu_info(), 'threads': threads})}, trains other weights from "
            f"the same seeds, so its table goes to {apart} rather than into that one "
            f"(--out {out} --fresh replaces that table)"
        )
        out = apart
    elif others:
        _log(
            f"warning: {out} holds models trained on {'; '.join(others)}, which this machine "
            "does not train from the same seeds: this run joins their table (its 'Models "
            "trained on' line names each CPU); --fresh starts the table anew"
        )
    if PROTECT in args.methods and not args.merge:  # before any work: only its own reports
        for setting, seed in units:
            check_report_dir(out / f"protect_{setting}_seed{seed}")
    if args.merge:
        records = _merged_from(args.merge, out)
    elif args.jobs > 1 and len(units) > 1:
        records = _run_in_processes(units, args, out)
    else:
        records = []
        for setting, seed in units:
            records.append(run_one(setting, seed, args, out))
    fresh_runs = [] if args.merge else list(records)
    total = time.perf_counter() - started
    for record in fresh_runs:
        record["command"] = "gss bench tinymem " + " ".join(argv or [])
    previous_file = out / "results.json"
    if previous_file.exists() and not args.fresh:
        import json

        previous = json.loads(previous_file.read_text()).get("runs", [])
        merged = merge_runs(previous, records)
        fresh_keys = {_run_key(r) for r in records}
        kept = [f"{r['setting']} seed {r['seed']}" for r in merged if _run_key(r) not in fresh_keys]
        if kept:
            _log(
                f"kept {len(kept)} earlier run(s) from {previous_file}: "
                f"{', '.join(sorted(set(kept)))} (--fresh to drop them)"
            )
        for r in merged:
            if _run_key(r) in fresh_keys and r.get("methods_kept"):
                _log(
                    f"{r['setting']} seed {r['seed']}: kept the earlier run's "
                    f"{', '.join(sorted(r['methods_kept']))} (same models; --fresh to drop them)"
                )
        records = merged
    md = table(records)
    run_seconds = sum(r["seconds"]["total"] for r in records)
    from gss_bench.tinymem.figures import write_figures

    figures = write_figures(records, out)
    write_json(
        out / "results.json",
        {
            "command": "gss bench tinymem " + " ".join(argv or []),
            "gss_version": __version__,
            "machine": machine_info(),
            "selection_rule": {
                "acc_tolerance_points": M.ACC_TOLERANCE,
                "ppl_tolerance_relative": M.PPL_TOLERANCE,
                "deltas": args.delta_grid,
                "alphas": M.ALPHAS,
            },
            "total_seconds": total,
            "runs_seconds": run_seconds,
            "jobs": min(args.jobs, len(units)),
            "runs": records,
        },
    )
    (out / "table.md").write_text(md)
    (out / "summary.md").write_text(
        summary_table(records)
        + "\n\nMeans over the seeds each cell has (± their std when more than one); (s): "
        "mitigation time; * = no grid point within the utility "
        "tolerance (the mildest is shown). Per-setting tables with % correct, strengths and "
        "the paper's numbers: table.md.\n\n"
        + (f"{held}\n\n" if (held := heldout_table(records)) else "")
        + _time_line(records, run_seconds)
        + " "
        + _trained_on_line(records)
        + "\n"
    )
    if leaks := LM.tables(records):
        (out / "leak_modes.md").write_text(LM.HEADER + leaks + "\n")
    for record in fresh_runs:
        BaselineCheckpoint.clear(out, record)
    print(md)
    print(_time_line(records, run_seconds))
    print(f"wrote {out}: results.json, table.md, {len(figures)} figures; total {total:.0f} s")
    return 0


def _trained_on_line(records: list[dict[str, Any]]) -> str:
    """Which CPUs trained the table's models: the same seed trains other weights on a CPU with
    other vector instructions (docs/benchmarks.md), so the numbers are that machine's."""
    seen: set[str] = set()
    for record in records:
        for model in record.get("models", {}).values():
            t = model.get("trained_on")
            seen.add(f"{t['cpu']} ({t['cpu_capability']})" if t else "unrecorded")
    named = sorted(seen - {"unrecorded"})
    line = f"Models trained on: {'; '.join(named)}. " if named else ""
    if "unrecorded" in seen:
        line += "Some models came from a cache that did not record the CPU that trained them. "
    return line + "Another CPU's vector instructions train other weights from the same seed."


def _time_line(records: list[dict[str, Any]], run_seconds: float) -> str:
    """What the table cost: its runs' own clocks summed (runs kept from earlier invocations,
    or run side by side with --jobs, each count their own wall time)."""
    commands = sorted({r.get("command", "?") for r in records})
    line = (
        f"The table's {len(records)} run(s) took {run_seconds:.0f} s "
        f"({run_seconds / 60:.1f} min) by their own clocks, made by {len(commands)} "
        f"command(s): " + "; ".join(f"`{c}`" for c in commands) + "."
    )
    for r in records:  # methods a later run on the same models did not rerun (merge_runs)
        by_command: dict[str, list[str]] = {}
        for name, command in r.get("methods_kept", {}).items():
            by_command.setdefault(command, []).append(name)
        for command, names in sorted(by_command.items()):
            line += (
                f" {r['setting']} seed {r['seed']}: {', '.join(names)} from `{command}` "
                "(same models)."
            )
    return line
