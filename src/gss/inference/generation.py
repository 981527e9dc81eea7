"""Greedy text from a steered model, prompt by prompt: what ``gss generate`` prints.

`generate_steered` encodes the prompts (each checked against the model's context and
vocabulary before any runs, `encode_prompt`), refuses a steer that gives NaN or infinite scores
(`check_finite_scores`), then generates with the steer attached: its gates tracked, or recorded
token by token (``explain``: `gss.inference.explain`), or with the reference choosing the token
where a gate opens (``reference``: `gss.inference.handoff`); with ``compare``, the unsteered
text too. The `Generation` it returns holds the texts, the gate statistics and the evidence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gss.artifact.files import record_outputs
from gss.artifact.stack import Steer
from gss.artifact.steering_artifact import SteeringArtifact
from gss.config import HANDOFF_GATES, HandoffGates
from gss.data import chat_prompt, check_text
from gss.errors import GSSError
from gss.hf.forward import check_sequences, context_length, model_device
from gss.inference.explain import Explanation, combined_gate_stats
from gss.inference.explain import explain as record_generation
from gss.inference.handoff import (
    MIN_CONFIDENCE,
    MIN_SIGNAL,
    NO_REPEAT_NGRAM,
    recommended_gates,
    reference_where_open,
)

__all__ = ["Generation", "check_finite_scores", "encode_prompt", "generate_steered"]


@dataclass(frozen=True)
class Generation:
    """What `generate_steered` made: per prompt the steered text (and, with ``compare``, the
    unsteered one); ``gate_stats``: ``any_open_share`` and ``tokens``, the share of positions
    where a gate opened (with a reference: of decoding steps the reference chose) and their
    count; ``explanations``: per prompt, with ``explain``; ``handed_over``: a reference chose
    the tokens where a gate opened; ``handoff_gates``: where it could (``"steer"``: at the
    steer's gates; ``"none"``: at any step)."""

    prompts: list[str]
    steered: list[str]
    gate_stats: dict[str, Any]
    unsteered: list[str] | None = None
    explanations: list[Explanation] = field(default_factory=list)
    handed_over: bool = False
    handoff_gates: str | None = None

    def summary(self) -> str:
        """The line ``gss generate`` ends with: where the gates opened."""
        stats = self.gate_stats
        share = f"{100 * stats['any_open_share']:.1f}% of {stats['tokens']}"
        if self.handed_over:
            where = {"steer": "where a gate opened", "none": "at any step"}
            rule = where.get(self.handoff_gates or "")
            tail = f", {rule}" if rule else ""
            return f"(the reference chose the token, at {share} decoding steps{tail})"
        return f"(gate opened on {share} positions)"

    def write_explanations(self, path: str | Path) -> int:
        """Write the explanations as JSON lines, one object per token (prompt and generated)
        with its prompt's index and text, recorded as gss's (`record_outputs`); the number of
        tokens written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for i, (prompt, e) in enumerate(zip(self.prompts, self.explanations, strict=True)):
                for row in e.rows():
                    f.write(json.dumps({"prompt_index": i, "prompt": prompt, **row}) + "\n")
        record_outputs(path.parent, [path.name])
        return sum(len(e.tokens) for e in self.explanations)


def encode_prompt(
    prompt: str, tokenizer: Any, model: Any, *, max_new_tokens: int, chat: bool = False
) -> Any:
    """``prompt``'s ids (``chat``: as a user message through the tokenizer's chat template),
    checked against ``model``'s context with ``max_new_tokens`` more and against its
    vocabulary; ``model`` may be a weightless stand-in holding its config."""
    check_text(prompt, f"--prompt {prompt!r}")
    if chat:
        text = chat_prompt(prompt, tokenizer)  # holds its own special tokens
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    length = enc["input_ids"].shape[1]
    if length == 0:
        raise GSSError(f"--prompt {prompt!r} has no tokens: give the text to continue.")
    limit = context_length(model)
    if limit is not None and length + max_new_tokens > limit[0]:
        raise GSSError(
            f"the prompt ({length} tokens) and --max-new-tokens {max_new_tokens} "
            f"pass the model's context ({limit[0]} positions, {limit[1]}): shorten the "
            "prompt or generate fewer tokens."
        )
    check_sequences((model,), enc["input_ids"], f"--prompt {prompt!r}")  # ids it has rows for
    return enc


def check_finite_scores(
    model: nn.Module, steer: Steer, encoded: Sequence[Any], prompts: Sequence[str], **options: Any
) -> None:
    """Refuse a steer (with ``options``, e.g. delta) under which ``model`` gives NaN or
    infinite next-token scores after one of the ``encoded`` prompts: they decode as padding."""
    with steer.attach(model, **options), torch.no_grad():
        for prompt, enc in zip(prompts, encoded, strict=True):
            scores = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
            if not bool(torch.isfinite(scores.logits[:, -1]).all()):
                raise GSSError(
                    f"the steered model gives NaN or infinite scores after --prompt {prompt!r}: "
                    "check the model's weights and dtype (float16 can overflow), or give a "
                    "smaller --delta."
                )


def _greedy_texts(
    model: nn.Module,
    tokenizer: Any,
    encoded: Sequence[Any],
    max_new_tokens: int,
    processors: tuple[Any, ...] = (),
) -> list[str]:
    """Each encoded prompt's greedy continuation, decoded (``processors``: logits
    processors)."""
    out = []
    for enc in encoded:
        with torch.no_grad():
            ids = model.generate(  # type: ignore[operator]  # transformers 4: no token_type_ids
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                logits_processor=list(processors),
            )
        out.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


def _explained(
    model: nn.Module,
    tokenizer: Any,
    steer: Steer,
    encoded: Sequence[Any],
    max_new_tokens: int,
    options: dict[str, Any],
) -> tuple[list[str], dict[str, Any], list[Explanation]]:
    """The steered texts, gate statistics and explanations of the same generation, recorded
    token by token (the same tokens: `gss.inference.explain`)."""
    explanations = [
        record_generation(
            model,
            steer,
            enc["input_ids"][0],
            max_new_tokens=max_new_tokens,
            tokenizer=tokenizer,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **options,
        )
        for enc in encoded
    ]
    steered = [
        tokenizer.decode(list(e.generated_ids), skip_special_tokens=True) for e in explanations
    ]
    return steered, combined_gate_stats(explanations), explanations


def _handed_over(
    model: nn.Module,
    tokenizer: Any,
    steer: Steer | None,
    reference: nn.Module,
    encoded: Sequence[Any],
    max_new_tokens: int,
    options: dict[str, Any],
    handoff: dict[str, Any],
) -> tuple[list[str], dict[str, Any]]:
    """The texts with ``reference`` choosing the token where a gate opens (``steer=None``: at
    any step), and the share of decoding steps it chose
    (`gss.inference.handoff.reference_where_open`)."""
    if options and isinstance(steer, SteeringArtifact):  # a stack takes none
        steer = steer.with_options(**options)
    with reference_where_open(model, steer, reference, **handoff) as processor:
        steered = _greedy_texts(model, tokenizer, encoded, max_new_tokens, (processor,))
    return steered, {"any_open_share": processor.handed_share, "tokens": processor.steps}


def generate_steered(
    model: nn.Module,
    tokenizer: Any,
    steer: Steer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 40,
    chat: bool = False,
    device: Any = None,
    delta: float | None = None,
    compare: bool = False,
    explain: bool = False,
    reference: nn.Module | None = None,
    min_signal: float | None = MIN_SIGNAL,
    min_confidence: float | None = MIN_CONFIDENCE,
    no_repeat_ngram: int | None = NO_REPEAT_NGRAM,
    handoff_gates: HandoffGates | None = None,
) -> Generation:
    """Greedy text from each of ``prompts`` with ``steer`` attached (at strength ``delta``:
    None for its own), as ``gss generate`` prints it.

    Every prompt is encoded and checked (`encode_prompt`, then moved to ``device``, default
    the model's) and the steered scores after it checked finite (`check_finite_scores`)
    before any generates.
    ``explain``: each generation recorded token by token (`Generation.explanations`);
    ``reference``: where a gate opens the reference chooses the token (``min_signal``,
    ``min_confidence``, ``no_repeat_ngram``: as `gss.reference_where_open` takes them;
    ``handoff_gates="none"``: at any step, the signal alone deciding, as its ``steer=None``;
    None: the rule `gss.protect` chose for ``steer`` on its tuning rows, else ``"steer"``),
    not with ``explain``; ``compare``: the unsteered text too.
    """
    if explain and reference is not None:
        raise GSSError(
            "--explain records the steer alone and --reference-where-open changes the tokens it "
            "would record: give one of them."
        )
    if handoff_gates not in (*HANDOFF_GATES, None):
        raise GSSError(f"handoff_gates must be 'steer', 'none' or None, got {handoff_gates!r}.")
    prompts = list(prompts)
    device = model_device(model) if device is None else device
    encoded = [  # every prompt checked before any runs
        encode_prompt(p, tokenizer, model, max_new_tokens=max_new_tokens, chat=chat).to(device)
        for p in prompts
    ]
    options: dict[str, Any] = {"delta": delta} if delta is not None else {}
    check_finite_scores(model, steer, encoded, prompts, **options)
    explanations: list[Explanation] = []
    rule = None
    if explain:
        steered, stats, explanations = _explained(
            model, tokenizer, steer, encoded, max_new_tokens, options
        )
    elif reference is not None:
        handoff = {
            "min_signal": min_signal,
            "min_confidence": min_confidence,
            "no_repeat_ngram": no_repeat_ngram,
        }
        rule = handoff_gates or recommended_gates(steer) or "steer"  # protect's choice
        gates = steer if rule == "steer" else None  # None: at any step
        steered, stats = _handed_over(
            model, tokenizer, gates, reference, encoded, max_new_tokens, options, handoff
        )
    else:
        with steer.attach(model, track_gates=True, **options) as handle:
            steered = _greedy_texts(model, tokenizer, encoded, max_new_tokens)
            stats = handle.gate_stats()
    unsteered = _greedy_texts(model, tokenizer, encoded, max_new_tokens) if compare else None
    return Generation(
        prompts,
        steered,
        stats,
        unsteered,
        explanations,
        handed_over=reference is not None,
        handoff_gates=rule,
    )
