"""Text in, padded token batches out: .txt / .jsonl files, strings, or token ids.

Calibration and evaluation both iterate over the same deterministic batches, so a second pass
(for the gate thresholds) sees exactly the tokens the first one saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from .errors import GSSError

TextsOrIds = Sequence[str] | Sequence[Sequence[int]] | Tensor
T = TypeVar("T", list[int], Tensor)


def read_texts(path: str | Path, field: str = "text") -> list[str]:
    """Read sequences from a ``.txt`` file (one per line) or ``.jsonl`` (a ``text`` field)."""
    p = Path(path)
    if not p.is_file():
        raise GSSError(f"data file {p} does not exist.")
    if p.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise GSSError(f"{p}:{number} is not valid JSON ({err.msg}).") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise GSSError(f"{p}:{number} has no string field {field!r}.")
            texts.append(record[field])
    elif p.suffix in (".txt", ""):
        texts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        raise GSSError(f"{p}: unsupported data format {p.suffix!r}; use .txt or .jsonl.")
    if not texts:
        raise GSSError(f"{p} contains no sequences.")
    return texts


def check_same_tokenizer(tokenizer: Any, reference_tokenizer: Any) -> None:
    """Refuse a reference whose tokenizer maps text to other ids than the model's.

    The memorization signal compares the two models' log-probabilities of one id sequence, so an
    id must stand for the same text in both; equal vocabulary sizes do not show that (Llama 2
    and Mistral both have 32,000 tokens). Added and special tokens are left out: a fine-tune may
    add some or rename reserved ones.
    """
    ours, theirs = tokenizer.get_vocab(), reference_tokenizer.get_vocab()
    if ours == theirs:
        return
    added = set(tokenizer.get_added_vocab()) | set(reference_tokenizer.get_added_vocab())
    ours = {t: i for t, i in ours.items() if t not in added}
    theirs = {t: i for t, i in theirs.items() if t not in added}
    by_id = {i: t for t, i in theirs.items()}
    disagree = [t for t, i in ours.items() if theirs.get(t, i) != i or by_id.get(i, t) != t]
    if disagree:
        examples = ", ".join(
            f"{t!r}: {ours[t]} vs {theirs.get(t, 'absent')}" for t in sorted(disagree)[:3]
        )
        raise GSSError(
            f"the model's and the reference's tokenizers disagree on {len(disagree)} of "
            f"{len(ours)} regular tokens (token: model id vs reference id, e.g. {examples}). The "
            "memorization signal compares both models' log-probabilities of the same token ids, "
            "so the reference must share the model's tokenizer: use the model the fine-tune "
            "started from."
        )


def _mixed_items_message(items: Sequence[Any]) -> str:
    """Why ``items`` are neither all strings nor all id lists, with the likely fix."""
    message = "sequences must be all strings or all lists of token ids"
    odd = next((x for x in items if not isinstance(x, (str, list, tuple, Tensor))), None)
    if odd is None:
        return f"{message}; got strings mixed with lists of ids."
    if isinstance(odd, Mapping):
        return (
            f"{message}; got a row of type {type(odd).__name__} with keys {list(odd)[:5]} (a "
            "datasets.Dataset yields such rows): pass its text column, e.g. dataset['text']."
        )
    if isinstance(odd, int):
        return (
            f"{message}; got an int among them: for one sequence of token ids, wrap it in a "
            "list ([ids]) or pass a 2-D tensor."
        )
    return f"{message}; got an item of type {type(odd).__name__}."


def _token_lists(
    items: Sequence[Any], tokenizer: Any | None, max_length: int | None
) -> list[list[int]]:
    """Token ids of each item (strings through ``tokenizer``), cut to ``max_length``."""
    if all(isinstance(x, str) for x in items):
        if tokenizer is None:
            raise GSSError("texts were given as strings: pass the model's tokenizer.")
        enc = tokenizer(
            list(items),
            truncation=max_length is not None,
            max_length=max_length,
            add_special_tokens=True,
        )
        seqs = [list(ids) for ids in enc["input_ids"]]
    elif all(isinstance(x, (list, tuple, Tensor)) for x in items):
        seqs = [x.tolist() if isinstance(x, Tensor) else list(x) for x in items]
    else:
        raise GSSError(_mixed_items_message(items))
    if max_length is not None:
        seqs = [s[:max_length] for s in seqs]
    return seqs


def _predictable(seqs: list[T]) -> list[T]:
    """The sequences with at least one next-token target; an error if none has."""
    kept = [s for s in seqs if len(s) >= 2]
    if not kept:
        raise GSSError("every sequence is shorter than 2 tokens; nothing to predict.")
    return kept


def _items(data: TextsOrIds, max_length: int | None) -> Sequence[Any]:
    """The sequences of `data`, not yet tokenized (a tensor's rows as views, cut to
    `max_length`); an error if there are none."""
    if isinstance(data, Tensor):
        if data.ndim != 2:
            raise GSSError(f"a tensor of token ids must be (N, T), got {tuple(data.shape)}.")
        items: Sequence[Any] = list(data[:, :max_length] if max_length is not None else data)
    else:
        items = data if isinstance(data, Sequence) else list(data)
    if not items:
        raise GSSError("no sequences given.")
    return items


def encode(
    data: TextsOrIds, tokenizer: Any | None = None, max_length: int | None = None
) -> list[list[int]]:
    """Token ids of each sequence: strings go through ``tokenizer``; ids pass through."""
    return _predictable(_token_lists(_items(data, max_length), tokenizer, max_length))


def encode_compact(
    data: TextsOrIds,
    tokenizer: Any | None = None,
    max_length: int | None = None,
    chunk: int = 1024,
) -> list[Tensor]:
    """`encode` for a corpus held across a whole pass: each sequence a 1-D tensor.

    A corpus as lists of Python ints costs ~40 bytes a token (ids above 256 are objects);
    calibration holds its token ids for the threshold pass, so it keeps them compact: rows of
    a given tensor are views of it (no copy), anything else becomes int32 tensors, text
    tokenized ``chunk`` sequences at a time so the lists never exist for the whole corpus.
    """
    items = _items(data, max_length)
    if isinstance(data, Tensor):
        return _predictable(list(items))
    out: list[Tensor] = []
    for start in range(0, len(items), chunk):
        part = _token_lists(items[start : start + chunk], tokenizer, max_length)
        out.extend(torch.as_tensor(s, dtype=torch.int32) for s in part)
    return _predictable(out)


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # (B, T), right padded with pad_id
    attention_mask: Tensor  # (B, T)
    index: Tensor  # (B,) positions of these rows in the original list


def batches(
    seqs: Sequence[Sequence[int]] | Sequence[Tensor],
    batch_size: int,
    pad_id: int = 0,
    sort: bool = True,
) -> Iterator[Batch]:
    """Right-padded batches; ``sort`` groups similar lengths to waste less compute on padding."""
    if batch_size < 1:
        raise GSSError(f"batch_size must be >= 1, got {batch_size}.")
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i])) if sort else range(len(seqs))
    order = list(order)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = right_pad([seqs[i] for i in idx], pad_id)
        yield Batch(ids, mask, torch.as_tensor(idx))


def right_pad(rows: Sequence[Sequence[int] | Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` of `rows` right-padded with `pad_id` to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r if isinstance(r, Tensor) else list(r))
        mask[i, : len(r)] = 1
    return ids, mask


def count_batches(n: int, batch_size: int) -> int:
    return (n + batch_size - 1) // batch_size
