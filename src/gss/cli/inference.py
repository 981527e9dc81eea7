"""`gss generate` and `gss serve`: a steered model's greedy text in the terminal, and vLLM's
OpenAI server with the steers requests may ask for."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.artifact.files import check_creatable, check_outputs, record_outputs
from gss.cli.inputs import (
    check_delta,
    check_local_paths,
    config_stand_in,
    load_model_and_tokenizer,
    load_reference_flag,
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


def generate_command(args: argparse.Namespace) -> int:
    import torch

    from gss.artifact.stack import load
    from gss.data import chat_prompt
    from gss.hf.forward import check_sequences, context_length
    from gss.hf.loading import load_tokenizer

    if any(not prompt.strip() for prompt in args.prompt):
        raise GSSError("--prompt is empty: give the text to continue.")
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
    handoff = getattr(args, "reference_where_open", None)
    min_signal = getattr(args, "min_signal", None)
    min_confidence = getattr(args, "min_confidence", None)
    no_repeat = getattr(args, "no_repeat_ngram", None)
    for flag, value, what in (
        ("--min-signal", min_signal, "sets where --reference-where-open hands a step to"),
        ("--min-confidence", min_confidence, "sets where --reference-where-open hands a step to"),
        ("--no-repeat-ngram", no_repeat, "guards the steps --reference-where-open hands to"),
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
    if handoff is not None and (args.explain or explain_out is not None):
        raise GSSError(
            "--explain records the steer alone and --reference-where-open changes the tokens it "
            "would record: give one of them."
        )
    artifact = load(args.steer)  # a damaged artifact fails before the model loads
    check_delta(artifact, args.delta)
    if handoff is not None:
        check_local_paths(args, ("--reference-where-open",))
    prompts = args.prompt

    def encode(prompt: str, tokenizer: Any, model: Any) -> Any:
        """The prompt's ids, checked against ``model``'s context and vocabulary (before the
        weights load: a weightless stand-in holding --model's config)."""
        if args.chat:
            text = chat_prompt(prompt, tokenizer)  # holds its own special tokens
            enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:
            enc = tokenizer(prompt, return_tensors="pt")
        length = enc["input_ids"].shape[1]
        if length == 0:
            raise GSSError(f"--prompt {prompt!r} has no tokens: give the text to continue.")
        limit = context_length(model)
        if limit is not None and length + args.max_new_tokens > limit[0]:
            raise GSSError(
                f"the prompt ({length} tokens) and --max-new-tokens {args.max_new_tokens} "
                f"pass the model's context ({limit[0]} positions, {limit[1]}): shorten the "
                "prompt or generate fewer tokens."
            )
        check_sequences((model,), enc["input_ids"], f"--prompt {prompt!r}")  # ids it has rows for
        return enc

    stand_in = config_stand_in(args.model)
    if stand_in is not None:  # the prompts checked in seconds, before the weights load
        tokenizer = load_tokenizer(args.model, getattr(args, "model_revision", None))
        for prompt in prompts:
            encode(prompt, tokenizer, stand_in)
    model, tokenizer = load_model_and_tokenizer(args)
    reference = None
    if handoff is not None:
        reference = load_reference_flag(args, "--reference-where-open", model, tokenizer)
    pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    # every prompt checked before any runs
    encoded = [encode(prompt, tokenizer, model).to(args.device) for prompt in prompts]

    def run(processors: tuple[Any, ...] = ()) -> list[str]:
        out = []
        for enc in encoded:
            with torch.no_grad():
                ids = model.generate(  # only these two: transformers 4 refuses token_type_ids
                    input_ids=enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad_token_id,
                    logits_processor=list(processors),
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
        from gss.inference.explain import combined_gate_stats, explain

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
    elif reference is not None:
        from gss.artifact.steering_artifact import SteeringArtifact
        from gss.inference.handoff import (
            MIN_CONFIDENCE,
            MIN_SIGNAL,
            NO_REPEAT_NGRAM,
            reference_where_open,
        )

        steer = artifact
        if options and isinstance(artifact, SteeringArtifact):  # a stack takes none
            steer = artifact.with_options(**options)
        cut = MIN_SIGNAL if min_signal is None else min_signal
        sure = MIN_CONFIDENCE if min_confidence is None else min_confidence
        with reference_where_open(
            model,
            steer,
            reference,
            min_signal=cut,
            min_confidence=sure,
            no_repeat_ngram=NO_REPEAT_NGRAM if no_repeat is None else no_repeat,
        ) as processor:
            steered = run((processor,))
        stats = {"any_open_share": processor.handed_share, "tokens": processor.steps}
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
    share = f"{100 * stats['any_open_share']:.1f}% of {stats['tokens']}"
    if reference is not None:
        print(f"(a gate opened, and the reference chose the token, at {share} decoding steps)")
    else:
        print(f"(gate opened on {share} positions)")
    if explain_out is not None:
        explain_out.parent.mkdir(parents=True, exist_ok=True)
        with explain_out.open("w", encoding="utf-8") as f:
            for i, (prompt, e) in enumerate(zip(prompts, explanations, strict=True)):
                for row in e.rows():
                    f.write(json.dumps({"prompt_index": i, "prompt": prompt, **row}) + "\n")
        record_outputs(explain_out.parent, [explain_out.name])
        count = sum(len(e.tokens) for e in explanations)
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
