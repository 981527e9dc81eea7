"""`gss signal`, `gss layers` and `gss calibrate`: the memorization signal, which block to
steer, and one block's steer built with the options given (over torchrun too)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.artifact.files import check_target, record_outputs
from gss.cli.inputs import (
    check_against_config,
    check_reference,
    check_results,
    config_options,
    load_models,
    read_rows,
    warn_same_source,
)
from gss.cli.options import (
    DATA_HELP,
    SCAN_FIELDS,
    add_batch_args,
    add_command,
    add_config_args,
    add_data_args,
    add_groups,
    add_model_args,
    add_out_args,
    add_preset_arg,
    add_reference_arg,
    parse_layers,
)
from gss.config import field_names
from gss.errors import GSSError, GSSWarning

if TYPE_CHECKING:
    from gss.cli.options import Commands

# `gss calibrate`'s config flags by what they set, each a section of its --help (a field named
# in none, e.g. a new one: "the steer")
MEMORIZED_FIELDS = ("omega_threshold", "memorized_quantile", "replies_only")
GATE_FIELDS = ("threshold_percentile", "gate_share", "gate", "max_threshold_samples")
SOLVE_FIELDS = ("centering", "solve_method", "jitter", "seed")


def _init_distributed(device: str) -> str:
    """Under torchrun (WORLD_SIZE > 1): join the process group; return this rank's device."""
    import os

    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE", "1").strip()
    if not world.isdigit():
        raise GSSError(
            f"WORLD_SIZE={world!r} in the environment is not a number of processes: torchrun "
            "sets it (docs/scaling.md). Unset it to run one process."
        )
    if int(world) <= 1:
        return device
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing and not dist.is_initialized():
        raise GSSError(
            f"WORLD_SIZE={world} is set but {', '.join(missing)} not: start the command with "
            "torchrun (docs/scaling.md), which sets them all, or unset WORLD_SIZE to run one "
            "process."
        )
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    if device == "cuda":
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def signal_command(args: argparse.Namespace) -> int:
    from gss.evaluate.signal_report import omega_all_zero, omega_of_texts, signal_report

    if args.plot and not args.out:  # before any model loads
        raise GSSError("--plot writes signal.png into --out: give --out DIR.")
    written = ["signal.json", *(["signal.png"] if args.plot else [])]
    check_results(args, written)
    if args.out and not args.plot and (Path(args.out) / "signal.png").exists():
        warnings.warn(
            f"{args.out}/signal.png is an earlier run's (this one has no --plot) and stays "
            "beside the new signal.json: pass --plot to replace it.",
            GSSWarning,
            stacklevel=2,
        )
    texts = read_rows(args, "--data", main=True)  # before the models: fails in seconds
    normal_texts = read_rows(args, "--normal-data", keep_rows=False) if args.normal_data else None
    model, tokenizer, reference = load_models(args)
    batching = {
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "progress": not args.no_progress,
    }
    omega = omega_of_texts(model, reference, texts, tokenizer, **batching)
    if omega_all_zero(omega):
        print(
            "gss: note: omega is 0 on every token: the reference gives the model's own "
            "log-probabilities (is it the fine-tuned model itself?)",
            file=sys.stderr,
        )
    normal = None
    if normal_texts is not None:
        normal = omega_of_texts(model, reference, normal_texts, tokenizer, **batching)
    report = signal_report(omega, texts, tokenizer, max_length=args.max_length, normal=normal)
    print(json.dumps(report.to_dict(), indent=2))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "signal.json").write_text(json.dumps(report.to_dict(), indent=2))
        if args.plot:
            report.plot(out / "signal.png", f"omega: {args.model}")
        record_outputs(out, written)
        print(f"wrote {out}")
    return 0


def _calibration_inputs(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any], Any]:
    """--data (rows keep their labels and completions), --gen-data and the calibration options,
    read and checked before the models load (a wrong path, column, split or option fails in
    seconds); then the model, its tokenizer and the reference."""
    texts = read_rows(args, "--data", main=True)
    gen_texts = read_rows(args, "--gen-data", keep_rows=False) if args.gen_data else None
    warn_same_source(
        args,
        "--gen-data",
        "--data",
        "the general statistics and the gates would be set on the very text whose memorized "
        "tokens the steer must act on, so the gates learn to stay closed there. Give text the "
        "fine-tune was not tuned on, or leave --gen-data out.",
    )
    overrides = config_options(args)
    check_reference(args)
    check_against_config(args, overrides)
    return texts, gen_texts, overrides, load_models(args)


def layers_command(args: argparse.Namespace) -> int:
    from gss.layer_scan import scan_layers
    from gss.report import write_json

    layers = parse_layers(args.layers)
    check_results(args, ["layers.json", "layers.png"])
    texts, gen_texts, overrides, (model, tokenizer, reference) = _calibration_inputs(args)
    scan = scan_layers(
        model,
        reference,
        texts,
        args.preset,
        layers=layers,
        tokenizer=tokenizer,
        gen_texts=gen_texts,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        **{**overrides, "max_length": args.max_length},
    )
    unchanged = set(scan.unchanged)
    for layer, value in scan.strengths.items():
        note = "  <- steer here" if layer == scan.best else ""
        note += "  (output equals the reference's)" if layer in unchanged else ""
        print(f"block {layer:3d}: {value:.4g}{note}")
    print(
        f"({scan.memorized_tokens} memorized, {scan.general_tokens} general tokens, "
        f"{scan.seconds:.1f} s)"
    )
    if args.out:
        out = Path(args.out)
        write_json(out / "layers.json", scan.to_dict())
        scan.plot(out / "layers.png", f"signal strength per block: {Path(args.model).name}")
        record_outputs(out, ["layers.json", "layers.png"])
        print(f"wrote {out}/layers.json and layers.png")
    return 0


def calibrate_command(args: argparse.Namespace) -> int:
    from gss import distributed
    from gss.artifact.describe import open_share
    from gss.calibrate import calibrate

    check_target(args.out, args.overwrite)  # before the models load
    if args.device_map is None:  # torchrun: each rank on its own device
        args.device = _init_distributed(args.device or "cpu")
    texts, gen_texts, overrides, (model, tokenizer, reference) = _calibration_inputs(args)
    artifact = calibrate(
        model,
        reference,
        texts,
        args.preset,
        tokenizer=tokenizer,
        gen_texts=gen_texts,
        batch_size=args.batch_size,
        progress=distributed.rank() == 0 and not args.no_progress,
        **{**overrides, "max_length": args.max_length},
    )
    if distributed.rank() != 0:
        return 0
    artifact.save_pretrained(args.out, overwrite=args.overwrite)
    c, m = artifact.config, artifact.provenance
    print(
        f"saved {args.out}: layer {c.layer}, K={c.rank}, delta={c.delta}, "
        f"memorized tokens {m.token_counts['memorized']}/{m.token_counts['tokens']} "
        f"({100 * m.token_counts['memorized_share']:.1f}%), {open_share(artifact)}, "
        f"{m.timings['total']:.1f} s (`gss show {args.out}` for the details)"
    )
    return 0


def add_signal_parser(sub: Commands) -> None:
    p = add_command(sub, "signal", "memorization-signal pilot statistics", signal_command)
    models, data, run, output = add_groups(p, "the models", "data", "run", "output")
    add_model_args(models, reference=True, run=run)
    add_reference_arg(models)
    data.add_argument("--data", required=True, help=DATA_HELP)
    add_batch_args(run)
    data.add_argument("--normal-data", help="normal text: its omega beside --data's in the figure")
    add_data_args(data)
    add_out_args(output, "directory for signal.json (and signal.png with --plot)")
    output.add_argument("--plot", action="store_true", help="write the omega / burst histograms")


def add_layers_parser(sub: Commands) -> None:
    summary = "memorization signal strength per block (layer choice)"
    p = add_command(sub, "layers", summary, layers_command)
    titles = ("the models", "data", "what to compute", "run", "output")
    models, data, compute, run, output = add_groups(p, *titles)
    add_model_args(models, reference=True, run=run)
    add_reference_arg(models)
    data.add_argument("--data", required=True, help="calibration text with the memorized sequences")
    data.add_argument("--gen-data", help="held-out text for Sigma_gen")
    add_data_args(data)
    compute.add_argument("--layers", default="all", help="'all' or block indices, e.g. 4,8,12")
    add_preset_arg(compute)
    add_config_args(compute, SCAN_FIELDS)
    add_batch_args(run)
    add_out_args(output, "directory for layers.json and layers.png")


def add_calibrate_parser(sub: Commands) -> None:
    p = add_command(sub, "calibrate", "calibrate a steering artifact", calibrate_command)
    titles = ("the models", "data", "the steer", "memorized tokens", "the gate", "the solve")
    models, data, steer, memorized, gate, solve = add_groups(p, *titles)
    run, output = add_groups(p, "run", "output")
    add_model_args(models, reference=True, run=run)
    add_reference_arg(models)
    data.add_argument("--data", required=True, help=DATA_HELP)
    data.add_argument("--gen-data", help="held-out text for Sigma_gen and thresholds")
    add_data_args(data)
    add_preset_arg(steer)
    fields = [n for n in field_names() if n != "max_length"]  # --max-length: below
    sections = {
        **dict.fromkeys(MEMORIZED_FIELDS, memorized),
        **dict.fromkeys(GATE_FIELDS, gate),
        **dict.fromkeys(SOLVE_FIELDS, solve),
    }
    groups = {name: sections.get(name, steer) for name in fields}
    add_config_args(p, fields, required=("layer",), groups=groups)
    add_batch_args(run)
    add_out_args(output, "directory for the artifact", required=True)


# each command's parser, by name (`gss.cli.parser` puts them in `gss --help`'s order)
PARSERS: dict[str, Callable[[Commands], None]] = {
    "calibrate": add_calibrate_parser,
    "signal": add_signal_parser,
    "layers": add_layers_parser,
}
