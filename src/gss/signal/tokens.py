"""Which tokens a fine-tune computed its loss on: only those can have been memorized.

A chat or instruction fine-tune is often trained on the replies alone (``trl``'s
``assistant_only_loss`` for conversations, ``completion_only_loss`` for prompt-completion rows,
or any pipeline whose ``labels`` are -100 outside the replies). Calibrating on every token then
counts the chat template, the user's turns and the system prompt among the memorized tokens
wherever the fine-tune moved them, and the steer aims partly at the prompt. So calibration can
restrict the memorized set to the trained tokens, read from:

- rows with ``input_ids`` and ``labels`` (the tokenized training data): labels of -100 were not
  trained on, as in Hugging Face's loss;
- with ``replies_only``, conversations (every assistant message, its end-of-turn marker
  included) and prompt-completion rows (the completion), located by rendering each reply's
  prefix with the chat template and checking that it tokenizes as the start of the whole row.

Tokens outside the set are never memorized; they count as general tokens (when Sigma_gen comes
from the calibration text).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

import torch
from torch import Tensor

from gss.data import (
    Batch,
    DatasetRows,
    TextsOrIds,
    chunks,
    compact_rows,
    dataset_kind,
    is_conversation,
    predictable,
    prompt_end,
    render,
    right_pad,
    sequence_items,
    template_ids,
    token_chunks,
)
from gss.errors import GSSError

IGNORE_INDEX = -100  # a label the loss skips (torch's cross_entropy default, HF's convention)
REPLY_ROWS = 512  # the rows `reply_masks` reads

__all__ = ["IGNORE_INDEX", "encode_trained", "reply_masks", "trained_targets"]


def encode_trained(
    data: TextsOrIds,
    tokenizer: Any | None = None,
    max_length: int | None = None,
    *,
    replies_only: bool = False,
    chunk: int = 1024,
    head: list[Any] | None = None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """`gss.data.encode_compact`'s token ids, and for each sequence which of its tokens were
    trained on (bool, one per token): from the rows' ``labels`` where they have them, the
    replies with `replies_only`, every token otherwise. None when no row says (no labels, not
    `replies_only`): every token counts.

    The rows are read once, ``chunk`` at a time (a `datasets.IterableDataset` streams), and
    only each row's ids and mask are kept; and the first `REPLY_ROWS` rows in `head`, when
    given, for `reply_masks` to read without reading a stream again."""
    items = sequence_items(data, max_length)
    if isinstance(data, Tensor):  # the rows are views of it, already token ids
        parts: Iterable[tuple[list[Any], Sequence[Tensor]]] = ((p, p) for p in chunks(items, chunk))
    else:
        parts = (
            (part, [torch.as_tensor(s, dtype=torch.int32) for s in seqs])
            for part, seqs in token_chunks(items, tokenizer, max_length, chunk)
        )
    ids: list[Tensor] = []
    masks: list[Tensor] | None = [] if replies_only else None
    for part, rows in parts:
        for x, row in zip(part, rows, strict=True):
            if masks is None and isinstance(x, Mapping) and "labels" in x:
                # the first row with labels: the rows before it were trained on every token
                masks = [torch.ones(len(r), dtype=torch.bool) for r in ids]
            if masks is not None:
                masks.append(_trained(x, len(ids), row, tokenizer, replies_only))
            if head is not None and len(head) < REPLY_ROWS:
                head.append(x)
            ids.append(row)
    if masks is None:
        return predictable(ids), None
    kept = [(row, mask) for row, mask in zip(ids, masks, strict=True) if len(row) >= 2]
    return predictable([row for row, _ in kept]), [mask for _, mask in kept]


def trained_targets(trained: Sequence[Tensor] | None, batch: Batch, valid: Tensor) -> Tensor:
    """`valid`, a batch's next-token targets (B, T-1), less those training skipped: `trained`
    holds a mask for each sequence the batches index (None: none skipped)."""
    if trained is None:
        return valid
    mask = right_pad([trained[i] for i in batch.index.tolist()], 0)[0]
    return valid & mask[:, 1:].bool().to(valid.device)


def _trained(x: Any, index: int, ids: Tensor, tokenizer: Any, replies_only: bool) -> Tensor:
    """Which of sequence `index`'s tokens `ids` (item `x`, cut as `ids` is) were trained on."""
    if isinstance(x, Mapping) and "labels" in x:
        return labels_mask(x["labels"], index, len(x["input_ids"]))[: len(ids)]
    if not replies_only:
        return torch.ones(len(ids), dtype=torch.bool)
    return _span_mask(_reply_spans(x, index, ids, tokenizer), len(ids))


def _may_reply(x: Any) -> bool:
    """Whether `x` is a row that may hold a reply: a conversation, or a row with one."""
    return is_conversation(x) or (isinstance(x, Mapping) and ("messages" in x or "prompt" in x))


def _span_mask(spans: Sequence[tuple[int, int]], length: int) -> Tensor:
    mask = torch.zeros(length, dtype=torch.bool)
    for start, end in spans:
        mask[start:end] = True
    return mask


def labels_mask(labels: Any, index: int, length: int) -> Tensor:
    """The tokens sequence ``index``'s labels mark trained on; refused unless one integer a
    token (``length``)."""
    try:
        t = torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError):
        raise GSSError(f"the labels of sequence {index} are not a list of integers.") from None
    if t.ndim != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise GSSError(
            f"the labels of sequence {index} are a {t.ndim}-d {t.dtype} array; labels are one "
            f"integer a token (the token's id, or {IGNORE_INDEX} where training skipped it)."
        )
    if len(t) != length:
        raise GSSError(
            f"sequence {index} has {length} input_ids but {len(t)} labels: give one label a "
            "token, aligned with input_ids (as Hugging Face's data collators do)."
        )
    return t != IGNORE_INDEX


def _reply_spans(x: Any, index: int, ids: Tensor, tokenizer: Any) -> list[tuple[int, int]]:
    """[start, end) token spans of the replies in sequence `index`."""
    name = f"sequence {index}"
    if isinstance(x, Mapping) and is_conversation(x.get("messages")):
        x = list(x["messages"])
    if is_conversation(x):
        return _turn_spans(list(x), name, ids, tokenizer)
    if isinstance(x, Mapping):
        prompt, completion = x.get("prompt"), x.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return [(prompt_end(tokenizer(prompt)["input_ids"], ids.tolist()), len(ids))]
        if is_conversation(prompt) and is_conversation(completion):
            head = template_ids(render(prompt, tokenizer, name, True), tokenizer)
            _check_prefix(head, ids, name, "its prompt")
            return [(len(head), len(ids))]
    raise GSSError(
        f"{name} ({type(x).__name__}) has no reply to train on: with replies_only, give "
        "conversations (rows with 'messages'), 'prompt' and 'completion' rows, or rows with "
        "'input_ids' and 'labels' (-100 where training skipped the token)."
    )


def _turn_spans(
    conversation: list[Mapping[str, Any]], name: str, ids: Tensor, tokenizer: Any
) -> list[tuple[int, int]]:
    """The spans of a conversation's assistant messages: from the end of the conversation
    before it rendered with the generation prompt to the end of the conversation through it."""
    spans = []
    for j, message in enumerate(conversation):
        if message.get("role") != "assistant":
            continue
        head = template_ids(render(conversation[:j], tokenizer, name, True), tokenizer) if j else []
        through = template_ids(render(conversation[: j + 1], tokenizer, name), tokenizer)
        _check_prefix(through, ids, name, f"its messages through reply {j}")
        if through[: len(head)] != head:
            raise GSSError(
                f"the chat template renders {name} up to its message {j} differently with "
                "the generation prompt than with the reply, so the reply's tokens cannot be "
                "told apart: pass rows with 'input_ids' and 'labels' instead."
            )
        spans.append((len(head), len(through)))
    if not spans:
        raise GSSError(
            f"{name} is a conversation without an assistant message: nothing to train on."
        )
    return spans


def _check_prefix(part: Sequence[int], ids: Tensor, name: str, what: str) -> None:
    """That `part` (cut to the row's length) starts the row `ids`, else a clear error."""
    width = min(len(part), len(ids))
    if list(part[:width]) != ids[:width].tolist():
        raise GSSError(
            f"the chat template renders {what} of {name} as tokens that do not start the "
            "whole conversation's (the template renders a turn differently when a later one "
            "follows), so the replies cannot be located: pass rows with 'input_ids' and "
            "'labels' instead."
        )


def reply_masks(
    data: TextsOrIds, tokenizer: Any | None, max_length: int | None, rows: int = REPLY_ROWS
) -> list[Tensor | None] | None:
    """For the first `rows` of `encode_trained`'s sequences (without labels or
    `replies_only`), which tokens are replies: None for a row without any (plain text, token
    ids, a conversation whose template cannot place them), and None in all when no row has
    any. What `gss.signal.replies` compares; never an error."""
    if isinstance(data, Tensor):  # token ids: no replies to find
        return None
    if dataset_kind(data) in ("table", "stream") or isinstance(data, DatasetRows):
        names = data.column_names  # type: ignore[union-attr]
        if names is not None and not {"messages", "prompt"} & set(names):
            return None  # no conversations: a stream is not read again for nothing
    # the first rows alone (a `datasets.Dataset` is iterated, not listed whole; an
    # `IterableDataset` is read again from its start, for these rows alone)
    items = data[:rows] if isinstance(data, Sequence) else list(islice(data, rows))
    if not any(_may_reply(x) for x in items):
        return None
    ids = compact_rows(items, tokenizer, max_length)
    masks: list[Tensor | None] = []
    for i, (x, row) in enumerate(zip(items, ids, strict=True)):
        if len(row) < 2:  # dropped from the sequences, as `predictable` drops it
            continue
        try:
            masks.append(_span_mask(_reply_spans(x, i, row, tokenizer), len(row)))
        except GSSError:
            masks.append(None)
    return masks if any(m is not None for m in masks) else None
