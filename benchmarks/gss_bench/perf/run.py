"""``gss bench perf``: speed and memory of gss, as ratios measured side by side.

Parts (``--only`` picks some): ``overhead`` (generate tokens/s steered vs unsteered),
``calibration`` (gss.calibrate vs the passes it cannot avoid, plus a profile), ``solve``
(solve_probe_steer vs d and K, full vs truncated SVD), ``memory`` (peak RSS of calibration
vs corpus size, a fresh process per size), ``adapters`` and ``audit`` (gss.audit rows/s vs
the forward passes it reads); ``protect`` (asked for by name only: minutes per round on the
canaries) times issue 72's protect search beside the search before it. Writes
``results.json``, ``table.md``, ``profile.txt`` and PNG figures under ``--out``.
``--device cuda --dtype bfloat16`` runs the first three parts on a GPU in half precision
(every timing synchronizes); memory is then skipped, as it measures host RSS of float32 CPU
calibration. ``--model`` takes local model directories; one holding only a ``config.json``
gives that architecture with random weights.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gss import __version__
from gss.report import machine_info, write_json
from gss_bench.perf import adapters, audit, calibration, figures, memory, overhead, scaling
from gss_bench.perf import protect as protect_cost
from gss_bench.perf.common import QUICK, Sizes, log

PARTS = ("overhead", "calibration", "solve", "memory", "adapters", "audit")
OPT_IN = ("protect",)  # asked for by name only (--only protect): minutes per round
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gss bench perf", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/perf", help="results folder (default results/perf)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, seconds)")
    p.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts from {', '.join(PARTS + OPT_IN)} (default all but "
        f"{', '.join(OPT_IN)})",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="local HF model directory to also measure the inference overhead on "
        "(e.g. SmolLM2-135M; repeat for several; a directory with only a config.json gives "
        "that architecture with random weights), and the adapters part's model (the first) "
        "instead of the tiny one; never downloaded",
    )
    p.add_argument(
        "--max-full-d",
        type=int,
        default=None,
        help="largest d for the full-SVD solve (default 4096; above it only truncated runs)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed rounds for overhead and calibration"
    )
    p.add_argument(
        "--new-tokens", type=int, default=None, help="new tokens per generate (overhead part)"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the models and solves run: cpu, cuda or cuda:N (default cpu); on CUDA "
        "every timed span synchronizes",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="model dtype for the overhead and calibration parts (default float32; the solve "
        "stays float64 like calibration's statistics)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _device(spec: str) -> torch.device:
    """``--device`` as a torch device, refused clearly where its timings would not be real."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError) as err:
        raise SystemExit(
            f"gss bench perf: --device {spec!r} is not a torch device ({err})"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":  # only CUDA has a synchronize here; other queues would mis-time
        raise SystemExit(f"gss bench perf: --device {spec}: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise SystemExit(
            f"gss bench perf: --device {spec} needs CUDA, but torch.cuda.is_available() is False "
            f"here (torch {torch.__version__}); run on a GPU machine or use --device cpu"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise SystemExit(
            f"gss bench perf: --device {spec}: only {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def _memory_skip_reason(device: torch.device, dtype: str) -> str | None:
    """Why the memory parts (memory, adapters) cannot run with these options (None: they can)."""
    if device.type == "cpu" and dtype == "float32":
        return None
    return (
        f"not run with --device {device} --dtype {dtype}: it measures the host peak RSS of "
        "float32 CPU calibration in fresh processes; run it with the defaults"
    )


def _parts(spec: str) -> list[str]:
    parts = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in parts if s not in PARTS + OPT_IN]
    if unknown or not parts:
        raise SystemExit(
            f"gss bench perf: unknown part(s) {unknown}; use {', '.join(PARTS + OPT_IN)}"
        )
    return parts


def _other_machine(part_machine: dict[str, Any] | None, current: dict[str, Any]) -> str:
    """Where a kept part was measured, when that is not the machine of this run (the CPU's
    name and vector instructions, else the platform string: older runs recorded only that)."""
    if part_machine is None:
        return "; machine not recorded"
    keys = ("cpu", "cpu_capability", "platform", "gpu")
    if all(part_machine.get(k) == current.get(k) for k in keys):
        return ""
    if part_machine.get("cpu"):
        return f"; on {part_machine['cpu']}, {part_machine.get('cpu_capability', '?')}"
    return f"; on {part_machine.get('platform', 'an unrecorded machine')}"


def table(results: dict[str, Any]) -> str:
    """The Markdown report: one section per part that ran."""
    m = results["machine"]
    device = m.get("device", "cpu")  # runs before --device were all cpu / float32
    if m.get("gpu"):
        device += f" ({m['gpu']})"
    versions = "".join(f", {k} {m[k]}" for k in ("transformers", "triton") if k in m)
    lines = [
        "# gss bench perf\n",
        f"`{results['command']}`; device {device}, {m.get('dtype', 'float32')}; "
        f"{m['cpu_count']} CPUs, {m['threads']} torch threads, "
        f"torch {m['torch']}{versions}, {m['platform']}. Every speed figure is a ratio of arms "
        "run in turn in one process after warm-up (median over rounds, IQR in brackets).\n",
    ]
    machines = results.get("part_machines", {})
    earlier = [
        f"{part} (`{command}`{_other_machine(machines.get(part), m)})"
        for part, command in results.get("part_commands", {}).items()
        if command != results["command"]
    ]
    if earlier:
        lines.append("Kept from earlier runs: " + "; ".join(earlier) + ".\n")
    parts = results["parts"]
    if "overhead" in parts:
        lines += [
            "## Inference overhead (greedy generate)\n",
            overhead.table(parts["overhead"]),
            f"Goal: {parts['overhead']['goal']}. A/A: the unsteered call timed as a second arm; "
            "its ratio is how far from 1 this measurement goes when nothing differs. No-op hook: a "
            "hook that returns at once, installed on the same block as a steer is (a wrapped "
            "forward), timed as one more arm. Alternating steps: one generate call per round and K "
            "whose decode steps alternate between steered and unsteered (the steer toggled outside "
            "the timed spans); per call, median unsteered step / median steered step. Neighbouring "
            "steps share the host's state, so this is the least noisy read of the steer's cost. "
            "As a forward hook: the same steer registered with register_forward_hook instead, as "
            "gss did before it wrapped the block's forward (at K = the peer's rank). Each round "
            "runs the arms in a fresh seeded order.\n",
        ]
    if "calibration" in parts:
        lines += [
            "## Calibration cost\n",
            calibration.table(parts["calibration"]),
            f"Goal: calibrate / passes {parts['calibration']['goal']}.\n",
        ]
    if "solve" in parts:
        lines += [
            "## Solve scaling (solve_probe_steer)\n",
            scaling.table(parts["solve"]),
            f"Goal: {parts['solve']['goal']}.\n",
        ]
    if "memory" in parts:
        lines += ["## Calibration memory vs corpus size\n", memory.table(parts["memory"])]
    if "audit" in parts:
        lines += [
            "## Audit speed (gss audit, (72, 32)-extraction)\n",
            audit.table(parts["audit"]),
            f"Goal: {parts['audit']['goal']}. Arms per round in a fresh seeded order: the audit, "
            "the model's forward alone, and the model's and the reference's forwards over the "
            "same rows and batches; ratios are per round (median, range).\n",
        ]
    if "protect" in parts:
        lines += [
            "## gss protect: issue 72's search beside the search before it\n",
            protect_cost.table(parts["protect"]),
            f"Goal: {parts['protect']['goal']}. The arm before issue 72 runs today's code with "
            f"the search space of then ({parts['protect']['before_space']}) and no per-point "
            "check besides the utility; both arms run in turn in one process, a fresh order "
            "each round, with no warm-up round (the first pays the process's first calls). "
            "Seconds are protect's own split of each arm's last run.\n",
        ]
    if "adapters" in parts:
        lines += [
            "## Calibrating an adapter (LoRA) fine-tune: base loaded again vs adapters_off\n",
            adapters.table(parts["adapters"]),
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = _parts(args.only)
    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes()
    progress = not args.no_progress
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "gss bench perf " + " ".join(argv if argv is not None else [])
    started = time.perf_counter()
    gpu = {"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    results: dict[str, Any] = {
        "command": command.strip(),
        "gss_version": __version__,
        "device": str(device),
        "dtype": args.dtype,
        "machine": machine_info(device=str(device), dtype=args.dtype, **gpu),
        "sizes": asdict(sizes),
        "parts": {},
        "seconds": {},
        "part_commands": {},
        "part_machines": {},  # what measured each part: kept parts may come from other runs
    }
    figure_paths = []
    for part in parts:
        t0 = time.perf_counter()
        log(f"{part} ...")
        if part == "overhead":
            result = overhead.run(
                sizes,
                model_paths=args.model,
                repeats=args.repeats,
                new_tokens=args.new_tokens,
                progress=progress,
                device=device,
                dtype=dtype,
            )
            figure_paths.append(figures.overhead(result, out / "overhead.png"))
        elif part == "calibration":
            result = calibration.run(
                sizes, repeats=args.repeats, progress=progress, out=out, device=device, dtype=dtype
            )
            figure_paths.append(figures.calibration(result, out / "calibration.png"))
        elif part == "solve":
            result = scaling.run(
                sizes, max_full_d=args.max_full_d, progress=progress, device=device
            )
            figure_paths.append(figures.solve(result, out / "solve.png"))
        elif part == "audit":
            result = audit.run(
                sizes,
                model_paths=args.model,
                repeats=args.repeats,
                progress=progress,
                quick=args.quick,
            )
            figure_paths.append(audit.figure(result, out / "audit.png"))
        elif part == "protect":
            result = protect_cost.run(repeats=args.repeats, progress=progress, quick=args.quick)
            figure_paths.append(protect_cost.figure(result, out / "protect.png"))
        elif reason := _memory_skip_reason(device, args.dtype):
            log(f"{part}: skipped, {reason}")
            result = {"skipped": reason}
        elif part == "memory":
            result = memory.run(sizes, quick=args.quick, threads=args.threads, progress=progress)
            figure_paths.append(figures.memory(result, out / "memory.png"))
        else:
            result = adapters.run(
                sizes,
                model_path=args.model[0] if args.model else None,
                quick=args.quick,
                threads=args.threads,
                progress=progress,
            )
            if "skipped" not in result:
                figure_paths.append(figures.adapters(result, out / "adapters.png"))
        results["parts"][part] = result
        results["seconds"][part] = time.perf_counter() - t0
        results["part_commands"][part] = results["command"]
        results["part_machines"][part] = results["machine"]
    results["seconds"]["total"] = time.perf_counter() - started
    previous = out / "results.json"
    if previous.exists() and not set(PARTS) <= set(parts):
        import json

        old = json.loads(previous.read_text())
        # parts measured on another device or dtype are not kept: one table, one setting
        # (results from before --device existed were cpu / float32)
        old_setting = (old.get("device", "cpu"), old.get("dtype", "float32"))
        same = old_setting == (results["device"], results["dtype"])
        if not same:
            log(f"not keeping the parts of {previous}: measured with {'/'.join(old_setting)}")
        kept = [k for k in old.get("parts", {}) if same and k not in results["parts"]]
        old_commands = old.get("part_commands", {})
        old_machines = old.get("part_machines", {})
        for k in kept:  # --only: keep the other parts' last results, say so
            results["parts"][k] = old["parts"][k]
            results["seconds"][k] = old.get("seconds", {}).get(k)
            results["part_commands"][k] = old_commands.get(k, old.get("command"))
            if k in old_machines:
                results["part_machines"][k] = old_machines[k]
            elif results["part_commands"][k] == old.get("command"):  # older files: one record
                results["part_machines"][k] = old.get("machine", {})
        if kept:
            log(f"kept {', '.join(kept)} from the previous {previous}")
    write_json(out / "results.json", results)
    md = table(results)
    (out / "table.md").write_text(md)
    print(md)
    print(
        f"wrote {out}: results.json, table.md, {len(figure_paths)} figures; "
        f"total {results['seconds']['total']:.0f} s"
    )
    return 0
