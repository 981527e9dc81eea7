"""Per-token evidence of one steered generation: which tokens opened which gate, and how far
the steer moved the hidden state there (`explain`, ``gss generate --explain``).

`explain` generates greedily with the steer attached, with the same call `gss generate` makes,
and records at the steered block, for every position the model reads (the prompt in one pass,
then one position per decode step with the KV cache), the probe response of each direction,
which gates opened and the norm of the change the steer made to the block's output. The steer
runs exactly as ``attach(..., track_gates=True)`` runs it (the checked path, which
tests/steering/test_gated_paths.py shows gives the bits of every other path); a recorder around it
only reads what goes in and comes out, so recording never changes what is generated.

The steer at a position acts on that token's hidden state, so on the choice of the next token
(and, through the KV cache of the blocks after it, on every later one): a generated token is
marked as steered when a gate opened at the position that chose it. The last generated token is
never read by the model, so it has no evidence of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gss.artifact.steering_artifact import SteeringArtifact
from gss.data import check_text, id_row
from gss.errors import GSSError
from gss.hf.blocks import resolve_layer
from gss.hf.forward import check_sequences, model_device
from gss.steering.attach import SteerHandle, register, split_block_output, warn_if_steering
from gss.steering.gated import GatedSteer

__all__ = ["BlockEvidence", "Explanation", "TokenEvidence", "combined_gate_stats", "explain"]


def _number(x: float) -> float | str:
    """A float as JSON takes it: infinities and NaN as strings ("inf", "-inf", "nan")."""
    return x if math.isfinite(x) else str(x)


@dataclass(frozen=True)
class BlockEvidence:
    """What the steer of one block did at one position.

    `responses`: the probe response s_k of each direction; `thresholds`: each gate's eps_k;
    `opened`: the directions whose gate opened; `change`: the norm of the change the steer made
    to the block's output there (exactly 0 where every gate stayed closed); `hidden_norm`: the
    norm of the block's output before the steer.
    """

    layer: int
    responses: tuple[float, ...]
    thresholds: tuple[float, ...]
    opened: tuple[int, ...]
    change: float
    hidden_norm: float

    @property
    def relative_change(self) -> float:
        """``change / hidden_norm``: how far the steer moved the hidden state, relatively."""
        if self.hidden_norm > 0:
            return self.change / self.hidden_norm
        return 0.0 if self.change == 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "responses": [_number(s) for s in self.responses],
            "thresholds": [_number(t) for t in self.thresholds],
            "opened": list(self.opened),
            "change": _number(self.change),
            "hidden_norm": _number(self.hidden_norm),
            "relative_change": _number(self.relative_change),
        }


@dataclass(frozen=True)
class TokenEvidence:
    """One token of the prompt or of the generation, and what the steer did at its position.

    `token`: its text (None without a tokenizer); `generated`: False for prompt tokens;
    `next_token_id` / `next_token`: the token after it (for the last prompt token and every
    generated one but the last: the token chosen from this position's steered state; None for
    the last token); `blocks`: one `BlockEvidence` per steered block, empty for the last
    generated token, which the model never reads.
    """

    position: int
    token_id: int
    token: str | None
    generated: bool
    next_token_id: int | None
    next_token: str | None
    blocks: tuple[BlockEvidence, ...]

    @property
    def read(self) -> bool:
        """Whether the steered block ran on this position (all but the last generated token)."""
        return bool(self.blocks)

    @property
    def steered(self) -> bool:
        """Whether some gate opened here (so the steer changed this token's hidden state)."""
        return any(b.opened for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "token_id": self.token_id,
            "token": self.token,
            "source": "generated" if self.generated else "prompt",
            "next_token_id": self.next_token_id,
            "next_token": self.next_token,
            "read": self.read,
            "steered": self.steered,
            "blocks": [b.to_dict() for b in self.blocks],
        }


@dataclass(frozen=True)
class Explanation:
    """A steered greedy generation and, token by token, what the steer did (`explain`).

    `prompt_ids`, `generated_ids`: the token ids; `text`: the generated text as `gss generate`
    prints it (special tokens skipped; None without a tokenizer); `tokens`: one `TokenEvidence`
    per token of the prompt and the generation, in order; `steers`: each steered block's
    settings (layer, rank, delta, gate, coefficient, thresholds).
    """

    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    text: str | None
    tokens: tuple[TokenEvidence, ...]
    steers: tuple[dict[str, Any], ...]

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per token (`TokenEvidence.to_dict`): what ``gss generate
        --explain-out`` writes, one line each."""
        return [t.to_dict() for t in self.tokens]

    def to_dict(self) -> dict[str, Any]:
        """The whole explanation as JSON-ready data: the ids, the text, the steers, the rows."""
        steers = [{**s, "thresholds": [_number(t) for t in s["thresholds"]]} for s in self.steers]
        return {
            "prompt_ids": list(self.prompt_ids),
            "generated_ids": list(self.generated_ids),
            "text": self.text,
            "steers": steers,
            "gate_stats": self.gate_stats(),
            "tokens": self.rows(),
        }

    def steered_tokens(self) -> list[TokenEvidence]:
        """The generated tokens chosen at a position where some gate opened."""
        start = len(self.prompt_ids)
        return [t for t in self.tokens[start:] if self.tokens[t.position - 1].steered]

    def gate_counts(self) -> tuple[int, list[int]]:
        """Positions read, and for each steered block the positions where any gate opened."""
        read = [t for t in self.tokens if t.read]
        opened = [sum(bool(t.blocks[b].opened) for t in read) for b in range(len(self.steers))]
        return len(read), opened

    def gate_stats(self) -> dict[str, Any]:
        """As `SteerHandle.gate_stats` counts them over this generation: the positions read
        and the share of them on which any gate opened (with several blocks, the largest
        block's share, as a stack's handle reports it)."""
        return combined_gate_stats([self])

    def render(self) -> str:
        """A report for a person: the generated text with ``[token]`` around each token chosen
        where a gate opened, then one line per token: the gates that opened, the responses
        (``*``: past the threshold), and how far the steer moved the hidden state."""
        pieces = []
        start = len(self.prompt_ids)
        for t in self.tokens[start:]:
            piece = t.token if t.token is not None else f" {t.token_id}"
            if self.tokens[t.position - 1].steered:
                body = piece.lstrip()
                piece = piece[: len(piece) - len(body)] + f"[{body}]"
            pieces.append(piece)
        settings = "; ".join(
            f"block {s['layer']}: K = {s['rank']}, delta {s['delta']:g}, gate {s['gate']}, "
            f"thresholds {' '.join(f'{t:.3g}' for t in s['thresholds'])}"
            for s in self.steers
        )
        many = len(self.steers) > 1
        header = [
            "pos",
            "from",
            "token",
            "next",
            "gates open",
            "responses (* open)",
            "|dh|",
            "|dh|/|h|",
        ]
        table = [header]
        for t in self.tokens:
            line = [
                str(t.position),
                "gen" if t.generated else "prompt",
                _shown(t.token, t.token_id),
                "" if t.next_token_id is None else _shown(t.next_token, t.next_token_id),
            ]
            if not t.read:
                table.append([*line, "", "(the last token: never read)", "", ""])
                continue
            gates, responses, change, relative = [], [], [], []
            for b in t.blocks:
                opened = ",".join(map(str, b.opened)) or "-"
                gates.append(f"b{b.layer}:{opened}" if many else opened)
                responses.append(
                    " ".join(
                        f"{s:+.3g}" + ("*" if k in b.opened else "")
                        for k, s in enumerate(b.responses)
                    )
                )
                change.append(f"{b.change:.3g}")
                relative.append(f"{100 * b.relative_change:.1f}%")
            table.append(
                [
                    *line,
                    " ".join(gates),
                    " | ".join(responses),
                    *map(" | ".join, (change, relative)),
                ]
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in table
        ]
        stats = self.gate_stats()
        return "\n".join(
            [
                "explained: " + "".join(pieces).strip(),
                f"  ([token]: chosen where a gate opened; {settings})",
                f"  (a gate opened at the steps that chose {len(self.steered_tokens())} of the "
                f"{len(self.generated_ids)} generated tokens; at "
                f"{100 * stats['any_open_share']:.1f}% of the {stats['tokens']} positions read)",
                *lines,
                "  |dh|: norm of the change the steer made to the block's output; |dh|/|h|: "
                "relative to the output's norm before it",
            ]
        )

    def __str__(self) -> str:
        return self.render()


def _shown(token: str | None, token_id: int) -> str:
    return repr(token) if token is not None else str(token_id)


def combined_gate_stats(explanations: Sequence[Explanation]) -> dict[str, Any]:
    """The gate counts of several explained generations together, as one handle attached
    through all of them would count them (`SteerHandle.gate_stats`'s ``tokens`` and
    ``any_open_share``; with several blocks the largest block's share)."""
    tokens = 0
    opened: list[int] = []
    for e in explanations:
        read, per_block = e.gate_counts()
        tokens += read
        opened = [a + b for a, b in zip(opened, per_block, strict=True)] if opened else per_block
    share = max(opened, default=0) / tokens if tokens else 0.0
    return {"tokens": tokens, "any_open_share": share}


class _Recorder:
    """The steer's own call on a block's output, and what it did at each position.

    The steer runs as attached with ``track_gates=True`` (its checked path, gates counted);
    the recorder reads the output before and after it and asks the steer which gates that same
    arithmetic opened (`GatedSteer.steer_hidden`, deterministic) and what the responses were.
    """

    def __init__(self, steer: GatedSteer) -> None:
        self.steer = steer
        self.origin = steer.origin  # a later attach of the same artifact then warns
        # per block call: (responses (T, K), open (T, K), change (T,), hidden norm (T,))
        self.calls: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        steered = self.steer(module, args, output)
        before = split_block_output(output)[0]
        after = split_block_output(steered)[0]
        with torch.no_grad():
            _, is_open = self.steer.steer_hidden(before)
            assert is_open is not None  # tracked: the mask is always returned
            width = before.shape[-1]
            h = before.detach().float().reshape(-1, width)
            change = (after.detach().float().reshape(-1, width) - h).norm(dim=-1)
            responses = self.steer.responses(before.detach()).reshape(h.shape[0], -1)
            self.calls.append(
                (
                    responses.cpu(),
                    is_open.reshape(h.shape[0], -1).cpu(),
                    change.cpu(),
                    h.norm(dim=-1).cpu(),
                )
            )
        return steered


def _prompt_ids(given: str | Sequence[int] | Tensor, tokenizer: Any | None) -> list[int]:
    prompt: Any = given
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GSSError("explain: a prompt given as text needs tokenizer=...; or pass ids.")
        prompt = tokenizer(check_text(prompt, "explain: the prompt"))["input_ids"]
    elif isinstance(prompt, Tensor) or hasattr(prompt, "__array__"):
        shape = tuple(getattr(prompt, "shape", ()))
        if len(shape) == 2 and shape[0] == 1:
            prompt = prompt[0]
        elif len(shape) != 1:
            raise GSSError(
                f"explain takes one prompt: ids of shape (T,) or (1, T), got {shape}. Explain "
                "each prompt on its own."
            )
    ids = id_row(prompt, 0, "explain: the prompt")
    if not ids:
        raise GSSError("explain: the prompt has no tokens: give the text to continue.")
    return ids


def _pieces(ids: Sequence[int], tokenizer: Any | None) -> list[str | None]:
    """Each token's text as it reads in place: the growth of the decoded prefix (so
    word-initial spaces show as the tokenizer writes them), or the token alone where a prefix
    does not decode to the start of the next one (an incomplete character)."""
    if tokenizer is None:
        return [None] * len(ids)
    out: list[str | None] = []
    before = ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        if text.startswith(before):
            out.append(text[len(before) :])
        else:
            out.append(tokenizer.decode(ids[i : i + 1], skip_special_tokens=False))
        before = text
    return out


def explain(
    model: nn.Module,
    artifact: SteeringArtifact | Iterable[SteeringArtifact],
    prompt: str | Sequence[int] | Tensor,
    *,
    max_new_tokens: int = 40,
    tokenizer: Any | None = None,
    pad_token_id: int | None = None,
    strict: bool = True,
    **options: Any,
) -> Explanation:
    """Generate greedily from ``prompt`` with ``artifact`` attached and record, for every
    position, the probe responses, which gates opened and how far the steer moved the hidden
    state (`Explanation`; ``print(explanation)`` shows it).

    ``prompt``: token ids (a list, or a (T,) or (1, T) tensor) or, with ``tokenizer``, a
    string. The generation is ``model.generate(..., do_sample=False)`` as ``gss generate``
    calls it, with the KV cache: the tokens are those the steer attached without recording
    gives. ``artifact`` may also be a steering stack (several blocks, recorded each);
    ``options`` (delta, rank, gate, coefficient, ridge_delta) apply to a single artifact as in
    `SteeringArtifact.attach`. ``pad_token_id``: as ``generate`` takes it (default: the
    tokenizer's pad token, else its end-of-sequence token).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise GSSError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if max_new_tokens < 1:
        raise GSSError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    single = isinstance(artifact, SteeringArtifact)
    members = (
        [artifact]
        if isinstance(artifact, SteeringArtifact)
        else list(artifact)
        if isinstance(artifact, Iterable)
        else []
    )
    if not members or not all(isinstance(m, SteeringArtifact) for m in members):
        raise GSSError("explain takes a SteeringArtifact, or a stack of them (gss.load).")
    if options and not single:
        raise GSSError(
            f"a steering stack takes no options ({', '.join(sorted(options))}): its blocks' "
            "strengths were chosen together. Change one block with "
            "stack.with_member(i, delta=...), or explain a single artifact."
        )
    ids = _prompt_ids(prompt, tokenizer)
    check_sequences([model], [ids], "the prompt", new_tokens=max_new_tokens)
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    configured = [m.with_options(**options) if options else m for m in members]
    handles: list[SteerHandle] = []
    recorders: list[_Recorder] = []
    training = model.training  # greedy decoding is deterministic only without dropout
    try:
        model.eval()
        for original, member in zip(members, configured, strict=True):
            member.check_model(model, strict=strict)
            _, block = resolve_layer(model, member.layer, member.config.block_path)
            warn_if_steering(block, original.identity, "explaining it")
            steer = member.make_hook(track_gates=True)
            steer.origin = original.identity
            recorder = _Recorder(steer)
            handles.append(register(block, recorder, model))
            recorders.append(recorder)
        input_ids = torch.tensor([ids], dtype=torch.long, device=model_device(model))
        with torch.no_grad():
            out = model.generate(  # type: ignore[operator]  # as gss generate calls it
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_token_id,
            )
    finally:
        for handle in reversed(handles):
            handle.remove()
        model.train(training)
    generated = [int(i) for i in out[0, len(ids) :].tolist()]
    return _explanation(ids, generated, configured, recorders, tokenizer)


def _explanation(
    prompt: list[int],
    generated: list[int],
    members: list[SteeringArtifact],
    recorders: list[_Recorder],
    tokenizer: Any | None,
) -> Explanation:
    """Put the recorded block calls in token order: the call that chose generated token i
    (the prefill for i = 0, decode step i after it) ends at position len(prompt) + i - 1, and
    covers as many positions before that as it read (1 with the KV cache; all, without)."""
    everything = [*prompt, *generated]
    read = len(everything) - 1
    per_block: list[list[tuple[Tensor, Tensor, Tensor, Tensor] | None]] = []
    for member, recorder in zip(members, recorders, strict=True):
        if len(recorder.calls) != len(generated):
            raise GSSError(
                f"block {member.layer} ran {len(recorder.calls)} times for {len(generated)} "
                "generated tokens: this model's generate does not decode one step per token, "
                "so its tokens cannot be matched to what the steer did."
            )
        rows: list[tuple[Tensor, Tensor, Tensor, Tensor] | None] = [None] * read
        for i, call in enumerate(recorder.calls):
            end = len(prompt) + i
            width = call[0].shape[0]
            if width > end:
                raise GSSError(
                    f"block {member.layer} read {width} positions at step {i}, more than the "
                    f"{end} there are: its calls cannot be matched to the tokens."
                )
            for j in range(width):
                rows[end - width + j] = tuple(part[j] for part in call)  # type: ignore[assignment]
        per_block.append(rows)
    pieces = _pieces(everything, tokenizer)
    tokens = []
    for pos, token_id in enumerate(everything):
        blocks: list[BlockEvidence] = []
        for member, rows in zip(members, per_block, strict=True):
            row = rows[pos] if pos < read else None
            if row is None:
                continue
            responses, is_open, change, norm = row
            blocks.append(
                BlockEvidence(
                    layer=member.layer,
                    responses=tuple(float(s) for s in responses.tolist()),
                    thresholds=tuple(float(t) for t in member.thresholds.tolist()),
                    opened=tuple(k for k, o in enumerate(is_open.tolist()) if o),
                    change=float(change),
                    hidden_norm=float(norm),
                )
            )
        nxt = pos + 1 if pos + 1 < len(everything) else None
        tokens.append(
            TokenEvidence(
                position=pos,
                token_id=token_id,
                token=pieces[pos],
                generated=pos >= len(prompt),
                next_token_id=None if nxt is None else everything[nxt],
                next_token=None if nxt is None else pieces[nxt],
                blocks=tuple(blocks),
            )
        )
    steers = tuple(
        {
            "layer": m.layer,
            "rank": m.rank,
            "delta": m.config.delta,
            "gate": m.config.gate,
            "coefficient": m.config.coefficient,
            "thresholds": [float(t) for t in m.thresholds.tolist()],
        }
        for m in members
    )
    text = None if tokenizer is None else tokenizer.decode(generated, skip_special_tokens=True)
    return Explanation(tuple(prompt), tuple(generated), text, tuple(tokens), steers)
