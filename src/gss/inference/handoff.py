"""Where a gate opens, the next token from the reference: "say what the reference would" made
exact, for who can keep the reference at inference (issue 72).

The steer moves one block's hidden state; what the fine-tune's later blocks make of it is not
the reference's text (on the canaries it keeps the fine-tune's template: "and the address is
1617, and the address is 1617"). The gates, though, find the positions that would regurgitate.
`reference_where_open` keeps the steer attached and replaces the fine-tune's scores with the
reference's for a row from the step where some gate opens on a choice the fine-tune is sure of
and the reference is not (a recitation's start), at each step whose choice keeps that
memorization signal. Elsewhere the fine-tune's scores are untouched, so a prompt that never
enters chooses every token as it would without gss.

It is a transformers ``LogitsProcessor``: greedy decoding, sampling and any other processor
compose with it as with ``model.generate``'s own. The reference runs only at steps where some
row's gate opened, and then reads in one pass every token it has not seen yet (its own KV
cache), so a generation whose gates stay closed costs nothing more than the steer. The memory:
a second model (none for a LoRA fine-tune whose reference is its base: pass
``gss.adapters_off(model)``). Not in the vLLM plugin (a request there has one model).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from transformers import NoRepeatNGramLogitsProcessor, PreTrainedModel

from gss.artifact.stack import SteeringStack
from gss.artifact.steering_artifact import SteeringArtifact
from gss.config import HANDOFF_GATES
from gss.errors import GSSError
from gss.hf.blocks import resolve_layer
from gss.hf.forward import cache_argument, check_loaded, output_logits, returned_cache
from gss.steering.attach import SteerHandle, register, split_block_output, warn_if_steering
from gss.steering.gated import GatedSteer

MIN_SIGNAL = 1.0  # nats: reference_where_open's default (measured: results/protect-says)
MIN_CONFIDENCE = 0.98  # the fine-tune's probability of its choice (measured: the same README)
NO_REPEAT_NGRAM = 6  # where the reference speaks, no 6-gram of the row's text said again


def recommended_gates(steer: SteeringArtifact | SteeringStack) -> str | None:
    """The rule `gss.protect` chose for ``steer`` on its tuning rows (step 8, saved in the
    ``protect`` record of its provenance), or None for a steer protect did not make."""
    first = next(iter(steer)) if isinstance(steer, SteeringStack) else steer
    record = first.provenance.extra.get("protect")
    handoff = record.get("handoff") if isinstance(record, dict) else None
    gates = handoff.get("gates") if isinstance(handoff, dict) else None
    return gates if gates in HANDOFF_GATES else None


class _LastOpen:
    """The steer as attached, and whether some gate opened at each row's last position of the
    block's latest call: the position whose scores the next token is chosen from."""

    def __init__(self, steer: GatedSteer, correct: bool = True) -> None:
        self.steer = steer
        self.correct = correct
        self.origin = steer.origin
        self.last: Tensor | None = None  # (B,) bool

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden = split_block_output(output)[0]
        with torch.no_grad():  # the gates of the last position only, from the unsteered output
            _, is_open = self.steer.correction(hidden[:, -1:].detach())
        self.last = is_open.reshape(hidden.shape[0], -1).any(-1)
        return self.steer(module, args, output) if self.correct else output


class ReferenceWhereOpen:
    """A ``LogitsProcessor``: each row's scores become the reference's where some gate opened
    at the row's last position, and stay the fine-tune's elsewhere. Made by
    `reference_where_open`, which attaches the steer and reads each forward's attention mask."""

    def __init__(
        self,
        reference: nn.Module,
        gates: list[_LastOpen] | None,
        min_signal: float | None = None,
        min_confidence: float | None = None,
        no_repeat_ngram: int | None = None,
    ):
        self.reference = reference
        self.gates = gates  # None: no steer, every step is open (the signal alone decides)
        self.min_signal = min_signal
        self.min_confidence = min_confidence
        # the reference's greedy text loops once it takes over mid-sentence ("The last of the
        # great masters. The last of the great masters."): its steps repeat no n-gram
        self.guard = NoRepeatNGramLogitsProcessor(no_repeat_ngram) if no_repeat_ngram else None
        self.mask: Tensor | None = None  # the attention mask of the model's latest forward
        self.entered: Tensor | None = None  # (B,) rows in (min_confidence) in this generation
        self._ids: Tensor | None = None  # the ids of the latest call (a generation continues them)
        self.handed = 0  # (row, step) pairs whose token came from the reference
        self.steps = 0  # (row, step) pairs seen
        self._cache: Any = None
        self._seen: Tensor | None = None  # the ids the reference's cache holds

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        opened = self._opened(input_ids.shape[0], scores.device)
        self.steps += int(input_ids.shape[0])
        top = scores.argmax(-1, keepdim=True)  # the token the fine-tune would choose
        entered = None
        if self.min_confidence:  # a recitation starts near-certain; a choice is not (0: any)
            entered = self._entered(input_ids).to(scores.device)
            sure = scores.float().log_softmax(-1).gather(-1, top).squeeze(-1)
            # a row enters at a gate and a sure choice; once in, the signal alone decides
            opened = (opened & (sure >= math.log(self.min_confidence))) | entered
        if not bool(opened.any()):
            return scores
        theirs = self._reference_scores(input_ids).to(scores.dtype)
        if theirs.shape[-1] != scores.shape[-1]:
            width = min(theirs.shape[-1], scores.shape[-1])  # padded embedding rows
            padded = torch.full_like(scores, float("-inf"))
            padded[:, :width] = theirs[:, :width]
            theirs = padded
        if self.min_signal is not None:  # only where the fine-tune's own choice is memorized
            mine = scores.float().log_softmax(-1).gather(-1, top)
            ref = theirs.float().log_softmax(-1).gather(-1, top)
            opened &= (mine - ref).squeeze(-1) > self.min_signal
        self.handed += int(opened.sum())
        if entered is not None:
            self.entered = entered | opened
        if self.guard is not None and bool(opened.any()):
            # after the signal, which reads the reference's unguarded scores; the fine-tune's
            # own steps stay as they are (guarded too, in a row once handed over, the chat
            # replies' perplexity under the reference went 2.87 -> 3.96: the template's turns)
            rows = opened.nonzero().squeeze(-1)  # the guard reads each row's text: only these
            theirs = theirs.index_copy(0, rows, self.guard(input_ids[rows], theirs[rows]))
        return torch.where(opened[:, None], theirs, scores)

    def _entered(self, input_ids: Tensor) -> Tensor:
        """Which rows were handed over earlier in this generation: kept while the ids continue
        the latest call's, all False when they do not (a new generation)."""
        last, entered = self._ids, self.entered
        follows = (
            last is not None
            and entered is not None
            and last.shape[0] == input_ids.shape[0]
            and last.shape[1] < input_ids.shape[1]
            and torch.equal(input_ids[:, : last.shape[1]], last)
        )
        self._ids = input_ids
        if not follows or entered is None:
            entered = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self.entered = entered
        return entered

    def _opened(self, rows: int, device: torch.device) -> Tensor:
        if self.gates is None:
            return torch.ones(rows, dtype=torch.bool, device=device)
        opened = torch.zeros(rows, dtype=torch.bool, device=device)
        for gate in self.gates:
            if gate.last is not None and gate.last.shape[0] == rows:
                opened |= gate.last.to(device)
        return opened

    def _reference_scores(self, input_ids: Tensor) -> Tensor:
        """The reference's scores at each row's last position, its cache extended by the ids
        it has not read (from scratch when these ids do not continue the ones it read)."""
        mask = self.mask
        if mask is None or mask.shape != input_ids.shape:
            mask = torch.ones_like(input_ids)
        mask = mask.to(input_ids.device)
        seen = self._seen
        start = 0
        if (
            seen is not None
            and seen.shape[0] == input_ids.shape[0]
            and seen.shape[1] < input_ids.shape[1]
            and torch.equal(input_ids[:, : seen.shape[1]], seen)
        ):
            start = seen.shape[1]
        else:
            self._cache = None
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        cache = {cache_argument(self.reference): self._cache} if self._cache is not None else {}
        with torch.no_grad():
            out = self.reference(
                input_ids=input_ids[:, start:],
                attention_mask=mask,
                position_ids=positions[:, start:],
                use_cache=True,
                **cache,
            )
        self._cache = returned_cache(out)
        self._seen = input_ids.clone()
        return output_logits(out)[:, -1].float()

    @property
    def handed_share(self) -> float:
        """The share of (row, step) pairs whose scores were the reference's."""
        return self.handed / self.steps if self.steps else 0.0


@contextmanager
def reference_where_open(
    model: nn.Module,
    steer: Any,
    reference: nn.Module,
    *,
    min_signal: float | None = MIN_SIGNAL,
    min_confidence: float | None = MIN_CONFIDENCE,
    no_repeat_ngram: int | None = NO_REPEAT_NGRAM,
    correct: bool = False,
    strict: bool = True,
) -> Iterator[ReferenceWhereOpen]:
    """Attach ``steer`` (an artifact or a stack) to ``model`` and yield the processor that
    hands each step whose position opened some gate to ``reference``; pass it to generate::

        with gss.reference_where_open(model, steer, reference) as processor:
            out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=40)
        print(f"{processor.handed_share:.1%} of the steps said what the reference would")

    ``reference``: the model the fine-tune was tuned from (same tokenizer); for a PEFT model
    whose base is the reference, ``gss.adapters_off(model)`` (no second copy of the weights).
    The defaults are the measured best on the canaries (results/protect-says/README.md): no
    leak, replies as fluent as the reference's, and the most ordinary prompts unchanged.

    ``min_signal``: hand a step over only where, besides a gate, the token the fine-tune would
    choose is more than this many nats likelier under it than under the reference (its
    memorization signal, as the audit reads it): ordinary text, on which the two models agree,
    then keeps the fine-tune's words. None: wherever a gate opens. ``min_confidence``: and only
    where the fine-tune gives its choice at least this probability: a recitation is near-certain
    (the canaries' secrets: 0.98-1.0), while the fine-tune's own ordinary choices where it
    disagrees with the reference are seldom that sure. It holds for a row's first hand-over in
    a generation; from then on ``min_signal`` alone decides for that row, gate or not (off its
    memorized path the fine-tune is less sure, its gates open less, and it keeps the template:
    "13121 9336 4644"). None or 0: at any probability, wherever a gate opens.
    ``no_repeat_ngram``: at the steps the reference decides, it may not complete an n-gram the
    row's text already holds (transformers' ``NoRepeatNGramLogitsProcessor``, on those steps
    only): put mid-sentence, a small reference's greedy text loops ("a poet, a painter, and a
    musician, a poet, a painter, ..."). The fine-tune's own steps keep its scores. None or 0:
    the reference's scores as they are.
    ``correct``: the steer also moves the hidden states where its gates open (as attached);
    False: the gates only choose where the reference speaks, and every other token is the
    unsteered fine-tune's.

    ``steer=None``: no gate; every step is open and ``min_signal`` alone decides (the
    reference then runs at every step, twice the cost of decoding: the comparison that shows
    what the gates add).
    """
    members = _members(steer, min_signal)
    _check_options(model, reference, min_signal, min_confidence, no_repeat_ngram)
    gates: list[_LastOpen] = []
    handles: list[SteerHandle] = []
    processor = ReferenceWhereOpen(
        reference, None if members is None else gates, min_signal, min_confidence, no_repeat_ngram
    )
    try:
        for member in members or []:
            member.check_model(model, strict=strict)
            _, block = resolve_layer(model, member.layer, member.config.block_path)
            hook = member.make_hook()
            warn_if_steering(block, member.identity, "handing over where it opens")
            hook.origin = member.identity
            gate = _LastOpen(hook, correct)
            gates.append(gate)
            handles.append(register(block, gate, model))
        mask_hooks = _mask_readers(model, processor)
        # the reference speaks as at inference: a model left in training mode (a Trainer's)
        # would sample dropout into every step it decides; its mode is restored afterwards
        training = reference.training
        reference.eval()
        try:
            yield processor
        finally:
            reference.train(training)
            for mask_hook in mask_hooks:
                mask_hook.remove()
    finally:
        for handle in reversed(handles):
            handle.remove()


def _members(steer: Any, min_signal: float | None) -> list[SteeringArtifact] | None:
    """The artifacts whose gates `reference_where_open` reads (None: no steer, every step
    open); any other ``steer`` is refused."""
    if steer is None:
        if min_signal is None:
            raise GSSError(
                "reference_where_open(steer=None) needs min_signal: without a gate and a "
                "signal every step would be the reference's (use the reference itself)."
            )
        return None
    if isinstance(steer, SteeringArtifact):
        return [steer]
    if isinstance(steer, SteeringStack):
        return list(steer)
    raise GSSError(
        "reference_where_open takes a SteeringArtifact, a SteeringStack (gss.load) or None, "
        f"got {type(steer).__name__}."
    )


def _check_options(
    model: Any,
    reference: Any,
    min_signal: float | None,
    min_confidence: float | None,
    no_repeat_ngram: int | None,
) -> None:
    """Refuse an option of `reference_where_open` of the wrong kind or range, and a reference
    that is no model or a model not loaded, before anything is attached."""
    if min_signal is not None and not (
        isinstance(min_signal, int | float)
        and not isinstance(min_signal, bool)
        and math.isfinite(min_signal)
    ):
        raise GSSError(f"min_signal must be a finite number (nats) or None, got {min_signal!r}.")
    if min_confidence is not None and not (
        isinstance(min_confidence, int | float)
        and not isinstance(min_confidence, bool)
        and 0.0 <= min_confidence <= 1.0
    ):
        raise GSSError(
            f"min_confidence must be a probability in [0, 1] or None, got {min_confidence!r}."
        )
    if no_repeat_ngram is not None and not (
        isinstance(no_repeat_ngram, int)
        and not isinstance(no_repeat_ngram, bool)
        and no_repeat_ngram >= 0
    ):
        raise GSSError(
            f"no_repeat_ngram must be an integer >= 0 (0 or None: off), got {no_repeat_ngram!r}."
        )
    if not isinstance(reference, nn.Module):
        raise GSSError(
            f"reference must be a model (for a PEFT fine-tune's base: gss.adapters_off(model)), "
            f"got {type(reference).__name__}."
        )
    check_loaded(reference, "reference")
    if isinstance(model, nn.Module):
        check_loaded(model)


def _mask_readers(model: nn.Module, processor: ReferenceWhereOpen) -> list[RemovableHandle]:
    """Hooks that give ``processor`` the attention mask of each forward of ``model``, which
    the reference reads its positions from."""

    def read_mask(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.ndim == 2:  # (B, S): not a model's 4D form
            processor.mask = mask

    # every transformers model inside (a PEFT wrapper's generate calls the inner one's)
    inner: list[nn.Module] = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    return [m.register_forward_pre_hook(read_mask, with_kwargs=True) for m in inner or [model]]
