"""`gss generate` and `gss serve`: a steered model's greedy text in the terminal, and vLLM's
OpenAI server with the steers requests may ask for."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.artifact.files import check_creatable, check_outputs
from gss.cli.inputs import (
    check_delta,
    check_local_paths,
    config_stand_in,
    load_model_and_tokenizer,
    load_reference_flag,
    names_the_model,
)
from gss.cli.options import (
    HUB_ID,
    Flags,
    add_command,
    add_groups,
    add_model_args,
    port_number,
    positive_int,
)
from gss.errors import GSSError
from gss.hf.loading import ADAPTERS_OFF

if TYPE_CHECKING:
    from gss.cli.options import Commands


def _explain_out(args: argparse.Namespace) -> Path | None:
    """--explain-out's file, checked before the model loads; None without it."""
    if args.explain_out is not None and not args.explain_out.strip():
        raise GSSError("--explain-out is empty: give a file (.jsonl), or leave the flag out.")
    explain_out = Path(args.explain_out) if args.explain_out else None
    if args.overwrite and explain_out is None:
        raise GSSError("--overwrite replaces an existing --explain-out: give --explain-out FILE.")
    if explain_out is not None:  # before the model loads
        if explain_out.is_dir():
            raise GSSError(f"--explain-out {explain_out} is a directory: give a file (.jsonl).")
        if explain_out.is_symlink():
            raise GSSError(
                f"--explain-out {explain_out} is a link: give the file itself (gss writes no "
                "file through a link)."
            )
        check_creatable(explain_out, "--explain-out")
        # not into a model's or an artifact's folder, and over a file only if gss wrote it
        check_outputs(explain_out.parent, [explain_out.name], args.overwrite, "--explain-out")
    return explain_out


def _handoff_options(args: argparse.Namespace, explaining: bool) -> dict[str, Any]:
    """--min-signal, --min-confidence, --no-repeat-ngram and --handoff-gates as
    `gss.generate_steered` takes them (those given), checked: each needs
    --reference-where-open, which --explain does not take."""
    handoff = getattr(args, "reference_where_open", None)
    given = {
        "min_signal": getattr(args, "min_signal", None),
        "min_confidence": getattr(args, "min_confidence", None),
        "no_repeat_ngram": getattr(args, "no_repeat_ngram", None),
        "handoff_gates": getattr(args, "handoff_gates", None),
    }
    min_signal, min_confidence, no_repeat, gates = given.values()
    for flag, value, what in (
        ("--min-signal", min_signal, "sets where --reference-where-open hands a step to"),
        ("--min-confidence", min_confidence, "sets where --reference-where-open hands a step to"),
        ("--no-repeat-ngram", no_repeat, "guards the steps --reference-where-open hands to"),
        ("--handoff-gates", gates, "sets where --reference-where-open hands a step to"),
    ):
        if value is not None and handoff is None:
            raise GSSError(
                f"{flag} {what} the reference: give --reference-where-open REF too, or drop {flag}."
            )
    if min_signal is not None and not math.isfinite(min_signal):
        raise GSSError(f"--min-signal must be a finite number of nats, got {min_signal}.")
    if min_confidence is not None and not 0.0 <= min_confidence <= 1.0:
        raise GSSError(f"--min-confidence must be a probability in [0, 1], got {min_confidence}.")
    if no_repeat is not None and no_repeat < 0:
        raise GSSError(f"--no-repeat-ngram must be 0 (off) or more, got {no_repeat}.")
    if handoff is not None and explaining:
        raise GSSError(
            "--explain records the steer alone and --reference-where-open changes the tokens it "
            "would record: give one of them."
        )
    return {name: value for name, value in given.items() if value is not None}


def generate_command(args: argparse.Namespace) -> int:
    from gss.artifact.stack import load
    from gss.data import check_text
    from gss.hf.loading import load_tokenizer
    from gss.inference.generation import encode_prompt, generate_steered

    if any(not prompt.strip() for prompt in args.prompt):
        raise GSSError("--prompt is empty: give the text to continue.")
    for prompt in args.prompt:  # before any model loads
        check_text(prompt, f"--prompt {prompt!r}")
    explain_out = _explain_out(args)
    explaining = args.explain or explain_out is not None
    handoff = getattr(args, "reference_where_open", None)
    handoff_options = _handoff_options(args, explaining)
    artifact = load(args.steer)  # a damaged artifact fails before the model loads
    check_delta(artifact, args.delta)
    if handoff is not None:
        check_local_paths(args, ("--reference-where-open",))
        if names_the_model(args, handoff):  # no choice is likelier under it than under itself
            raise GSSError(
                f"--reference-where-open {handoff} is --model: the fine-tune's choices are "
                "never likelier under it than under itself, so no step would be handed over. "
                "Pass the model it was tuned from (for a LoRA: adapters-off)."
            )
    prompts, chat, new_tokens = args.prompt, args.chat, args.max_new_tokens
    stand_in = config_stand_in(args.model)
    if stand_in is not None:  # the prompts checked in seconds, before the weights load
        tokenizer = load_tokenizer(args.model, getattr(args, "model_revision", None))
        for prompt in prompts:
            encode_prompt(prompt, tokenizer, stand_in, max_new_tokens=new_tokens, chat=chat)
    model, tokenizer = load_model_and_tokenizer(args)
    reference = None
    if handoff is not None:
        reference = load_reference_flag(args, "--reference-where-open", model, tokenizer)
    result = generate_steered(
        model,
        tokenizer,
        artifact,
        prompts,
        max_new_tokens=new_tokens,
        chat=chat,
        device=args.device,
        delta=args.delta,
        compare=args.compare,
        explain=explaining,
        reference=reference,
        **handoff_options,
    )
    for i, prompt in enumerate(prompts):
        print(f"prompt:    {prompt}")
        print(f"steered:   {result.steered[i]}")
        if result.unsteered is not None:
            print(f"unsteered: {result.unsteered[i]}")
        if args.explain:
            print(result.explanations[i].render())
    print(result.summary())
    if explain_out is not None:
        count = result.write_explanations(explain_out)
        print(f"wrote {explain_out}: one JSON object per token ({count} tokens)")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    import os
    import shlex

    from gss.serving import serve

    artifacts = serve.parse_artifacts(args.artifact)
    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    argv = serve.server_argv(
        args.model,
        artifacts,
        host=args.host,
        port=args.port,
        extra=extra,
        default=args.default,
        allow_opt_out=args.allow_opt_out,
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
            "every request, and no client can opt out of it)",
            file=sys.stderr,
            flush=True,
        )
    exposed = serve.exposure_warning(args.host, extra)
    if exposed is not None:
        print(exposed, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(argv[0], argv)  # the server replaces this process: signals reach vLLM directly
    return 0  # not reached


def add_generate_parser(sub: Commands) -> None:
    summary = "greedy generation with a steering artifact attached"
    p = add_command(sub, "generate", summary, generate_command)
    titles = ("the model", "the steer", "what to generate", "the reference where a gate opens")
    model, steer, prompts, handoff = add_groups(p, *titles)
    (output,) = add_groups(p, "output")
    add_model_args(model, run=output)
    steer.add_argument("--steer", required=True, help=f"artifact directory, {HUB_ID}")
    prompts.add_argument("--prompt", required=True, action="append", help="prompt (repeatable)")
    prompts.add_argument(
        "--max-new-tokens", type=positive_int, default=40, help="tokens to generate"
    )
    steer.add_argument("--delta", type=float, help="override the artifact's strength")
    output.add_argument("--compare", action="store_true", help="also print the unsteered text")
    prompts.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the tokenizer's chat template",
    )
    output.add_argument(
        "--explain",
        action="store_true",
        help="after each text, the tokens the steer acted on: per token the probe responses, "
        "the gates that opened and how far the steer moved the hidden state (gss.explain)",
    )
    output.add_argument(
        "--explain-out",
        metavar="FILE",
        help="write that evidence as JSON lines, one object per token (prompt and generated)",
    )
    output.add_argument(
        "--overwrite", action="store_true", help="replace an existing --explain-out"
    )
    _add_handoff_args(handoff)


def _add_handoff_args(p: Flags) -> None:
    """`gss generate --reference-where-open` and the flags that tune it."""
    p.add_argument(
        "--reference-where-open",
        metavar="REF",
        help="where a gate opens, take the next token from REF (the model the fine-tune was "
        f"tuned from, loaded as --model is; {ADAPTERS_OFF} for a PEFT adapter's base): it says "
        "what the reference would, at a second model's memory (gss.reference_where_open)",
    )
    p.add_argument(
        "--min-signal",
        type=float,
        metavar="NATS",
        help="with --reference-where-open: hand a step over only where the fine-tune's choice "
        "is more than NATS likelier under it than under REF (default 1, the measured best; "
        "higher keeps more of the fine-tune's own words)",
    )
    p.add_argument(
        "--min-confidence",
        type=float,
        metavar="P",
        help="with --reference-where-open: a row's first hand-over also needs the fine-tune "
        "to give its choice probability P or more (default 0.98, the measured best: a "
        "recitation starts near-certain); after it --min-signal alone decides for that row "
        "(0: any probability, wherever a gate opens)",
    )
    p.add_argument(
        "--handoff-gates",
        choices=("steer", "none"),
        help="with --reference-where-open: which steps may be handed over: where the steer's "
        "gates open (steer: on the canaries the fewest ordinary prompts change), or any step, "
        "the signal and --min-confidence alone deciding (none: REF runs at every step; where "
        "the gates find few memorized tokens, as on TinyMem math noise, it leaks less). "
        "Default: the rule gss protect chose for this steer on its tuning rows, else steer",
    )
    p.add_argument(
        "--no-repeat-ngram",
        type=int,
        metavar="N",
        help="with --reference-where-open: at the steps REF decides it may not complete an "
        "N-gram the text already holds (default 6, the measured best: a small reference put "
        "mid-sentence loops; 0: REF's scores as they are)",
    )


def add_serve_parser(sub: Commands) -> None:
    summary = "vLLM's OpenAI server; each request may name an artifact to steer it"
    p = add_command(sub, "serve", summary, serve_command)
    server, artifacts = add_groups(p, "the server", "the artifacts")
    server.add_argument(
        "--model", required=True, help="the model vLLM serves: its directory or a Hub repo id"
    )
    artifacts.add_argument(
        "--artifact",
        required=True,
        action="append",
        metavar="NAME=DIR",
        help="an artifact (a directory or a Hub repo id) requests may ask for by NAME "
        '("vllm_xargs": {"gss": NAME}); repeatable',
    )
    artifacts.add_argument(
        "--default",
        metavar="NAME",
        help="the artifact that steers every request that names no other served artifact; "
        'one asking for {"gss": "none"} is refused unless --allow-opt-out (default: requests '
        "naming none are not steered)",
    )
    artifacts.add_argument(
        "--allow-opt-out",
        action="store_true",
        help='let a request ask for {"gss": "none"} and be served unsteered despite --default',
    )
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address the server listens on (default: 127.0.0.1, this machine only; "
        "0.0.0.0 for every interface, with -- --api-key KEY)",
    )
    server.add_argument("--port", type=port_number, default=8000, help="the server's port")
    server.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="after --: flags for vLLM's server, passed on (e.g. -- --max-model-len 4096)",
    )


# each command's parser, by name (`gss.cli.parser` puts them in `gss --help`'s order)
PARSERS: dict[str, Callable[[Commands], None]] = {
    "generate": add_generate_parser,
    "serve": add_serve_parser,
}
