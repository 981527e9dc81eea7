"""Text in, padded token batches out: .txt / .jsonl files, strings, conversations, dataset
rows (a `datasets.Dataset` or `IterableDataset` too), or token ids.

Calibration and evaluation both iterate over the same deterministic batches, so a second pass
(for the gate thresholds) sees exactly the tokens the first one saw. A fine-tune learned its data
in the form it was trained on, chat template included, so conversations and prompt-completion
rows (the formats of ``trl``'s SFT data) are turned into the token ids that training saw.

A `datasets.Dataset` is read a chunk of rows at a time (`DatasetRows`) and an `IterableDataset`
once, as it streams: each chunk is tokenized as it comes and only its token ids are kept, never
the table. Other formats (parquet, csv, saved datasets, Hub ids) are read by `gss.data_sources`.
"""

from __future__ import annotations

import json
import operator
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, TypeGuard, TypeVar, overload

import torch
from torch import Tensor

from gss.errors import GSSError

Conversation = Sequence[Mapping[str, Any]]  # [{"role": "user", "content": "..."}, ...]
Text = str | Conversation
# the last: rows read as they come (a `datasets.Dataset` or `IterableDataset`, a generator)
TextsOrIds = (
    Sequence[Text]
    | Sequence[Mapping[str, Any]]
    | Sequence[Sequence[int]]
    | Tensor
    | Iterable[Mapping[str, Any]]
)
T = TypeVar("T", list[int], Tensor)

FORMATS = (
    "'text' (a string), 'messages' (a conversation: a list of {'role', 'content'} dicts, "
    "rendered with the tokenizer's chat template) or 'prompt' and 'completion' (two strings, "
    "joined, or two conversations)"
)


def is_conversation(x: Any) -> TypeGuard[Conversation]:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(m, Mapping) for m in x)


def record_text(record: Mapping[str, Any], where: str = "a row") -> Text:
    """The text of one dataset row in a usual fine-tuning format (`FORMATS`): a string, or a
    conversation for the tokenizer's chat template."""
    given = [k for k in ("text", "messages", "prompt") if record.get(k) is not None]
    if len(given) > 1:  # which one the model was tuned on is not ours to guess
        raise GSSError(
            f"{where} has both {given[0]!r} and {given[1]!r}: a row gives its text one way. "
            "Keep one key, or name the column to read (--text-column / --messages-column; "
            "dataset.select_columns)."
        )
    text = record.get("text")
    if isinstance(text, str):
        return text
    messages = record.get("messages")
    if is_conversation(messages):
        return list(messages)
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt + completion
    if is_conversation(prompt) and is_conversation(completion):
        return [*prompt, *completion]
    present = [k for k in ("text", "messages", "prompt", "completion") if k in record]
    if present in (["prompt"], ["completion"]):  # one of a pair
        other = "completion" if present == ["prompt"] else "prompt"
        raise GSSError(
            f"{where} has {present[0]!r} but no {other!r}: a prompt-completion row needs both "
            "(or give the whole text as 'text')."
        )
    if present:  # the right key, the wrong kind of value
        kinds = ", ".join(f"{k!r} is {_short(record[k])}" for k in present)
        raise GSSError(f"{where}: {kinds}, not in a format gss reads: {FORMATS}.")
    raise GSSError(
        f"{where} has keys {list(record)[:8]}, none in a format gss reads: {FORMATS}. For "
        "another column, pass its strings (e.g. dataset['column']) or name it (--text-column "
        "/ --messages-column; dataset.rename_column(name, 'text'))."
    )


def check_text(text: str, name: str) -> str:
    """``text``, refused where it holds a lone surrogate (a JSON ``"\\ud800"`` escape, or bytes
    that are no UTF-8 decoded with ``errors="surrogateescape"``, as Python decodes a command
    line): no tokenizer encodes one, and transformers' error says nothing of where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise GSSError(
            f"{name} holds {text[err.start]!r} at character {err.start}, a lone surrogate "
            "that is no Unicode text (a JSON '\\ud800' escape, or bytes that are not UTF-8): "
            "no tokenizer encodes it. Fix or drop that text."
        ) from None
    return text


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_rows(path: str | Path) -> list[str | dict[str, Any]]:
    """The rows of a ``.txt`` file (one string a line) or ``.jsonl`` file (one JSON object a
    line), as they are: `read_texts` turns them into texts, `encode_replies` into prompts and
    replies."""
    return [row for _, row in numbered_rows(path)]


def numbered_rows(path: str | Path) -> list[tuple[str, str | dict[str, Any]]]:
    """`read_rows` with each row's place ("file:line") for error messages."""
    p = Path(path)
    if not p.exists() or p.is_dir():  # a pipe or /dev/stdin is read as a .txt file
        raise GSSError(f"data file {p} does not exist.")
    rows: list[tuple[str, str | dict[str, Any]]]
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark is not text
    except UnicodeDecodeError as err:
        raise GSSError(
            f"{p} is not UTF-8 text (byte {err.start} cannot be decoded): convert it, e.g. "
            f"iconv -f latin1 -t utf-8 {p.name}."
        ) from None
    suffix = p.suffix.lower() if p.is_file() else ""
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise GSSError(f"{p}:{number} is not valid JSON ({err.msg}).") from None
            except RecursionError:  # nested past Python's limit: no row of text
                raise GSSError(f"{p}:{number} is not valid JSON (nested too deeply).") from None
            if not isinstance(record, dict):
                raise GSSError(f"{p}:{number} is not a JSON object; expected {FORMATS}.")
            rows.append((f"{p}:{number}", record))
    elif suffix in (".txt", ""):
        lines = text.splitlines()
        rows = [(f"{p}:{n}", line) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        raise GSSError(f"{p}: unsupported data format {p.suffix!r}; use .txt or .jsonl.")
    if not rows:
        raise GSSError(f"{p} contains no sequences.")
    return rows


def read_texts(path: str | Path, keep_rows: bool = False) -> list[Any]:
    """Read sequences from a ``.txt`` file (one per line) or ``.jsonl`` (one row a line, in a
    format of `record_text`: a text, a conversation, or a prompt and its completion).

    `keep_rows`: ``.jsonl`` rows stay dicts once their format is checked, so that what only the
    row says survives (which part is the completion; ``input_ids`` and ``labels``, which
    tokens training computed a loss on: `gss.signal.tokens`)."""
    return texts_of(numbered_rows(path), keep_rows)


def texts_of(rows: Iterable[tuple[str, str | dict[str, Any]]], keep_rows: bool) -> list[Any]:
    """`read_texts` of rows already read, each with its place ("file:line")."""
    out: list[Any] = []
    for where, row in rows:
        if isinstance(row, str):
            out.append(row)
        elif "input_ids" in row:  # token ids have no text: the row is kept as it is
            id_row(row, 0, where)
            out.append(row)
        else:
            text = record_text(row, where)
            out.append(row if keep_rows else text)
    return out


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


def _as_text(x: Any, index: int) -> Text | None:
    """`x` as a text (a string or a conversation), None if it is not one (token ids, or a row
    with ``input_ids``)."""
    if isinstance(x, str):
        return x
    if isinstance(x, Mapping) and "input_ids" in x:
        return None
    if isinstance(x, Mapping):
        return record_text(x, f"sequence {index} (a {type(x).__name__})")
    if is_conversation(x):
        return list(x)
    return None


def render(
    conversation: Conversation, tokenizer: Any, name: str, generation_prompt: bool = False
) -> str:
    """A conversation (`name` names it in errors) as the text the model was trained on: its
    tokenizer's chat template (then the header of the assistant's turn, for
    `generation_prompt`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise GSSError(
            f"{name} is a conversation, but the tokenizer has no chat template to "
            "render it with: pass the tokenizer the model was fine-tuned with (its "
            "tokenizer_config.json holds the template), or pass the texts as strings."
        )
    for m in conversation:
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise GSSError(
                f"{name} is a conversation with a message without 'role' and "
                f"'content' (keys {list(m)[:5]}); every message needs both."
            )
    try:
        rendered = tokenizer.apply_chat_template(
            list(conversation), tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as err:  # jinja raises its own errors (raise_exception in templates)
        raise GSSError(f"the tokenizer's chat template could not render {name}: {err}") from None
    return str(rendered)


def chat_prompt(prompt: str, tokenizer: Any) -> str:
    """`prompt` as a user's message, rendered by the chat template up to the assistant's
    reply: how a chat fine-tune is prompted."""
    if not getattr(tokenizer, "chat_template", None):
        raise GSSError(
            "a chat prompt needs the tokenizer's chat template, and this tokenizer has none: "
            "drop --chat to send the prompt as plain text."
        )
    return render([{"role": "user", "content": prompt}], tokenizer, "the prompt", True)


def _unpadded(ids: list[int], mask: Any, name: str) -> list[int]:
    """The tokens of ``ids`` its ``attention_mask`` keeps: padding on the left or on the right
    is dropped; a mask with holes, of another length, or not of 0s and 1s is refused (the
    rows gss reads are whole sequences)."""
    keep = id_row(mask, 0, f"the attention_mask of {name}")
    if len(keep) != len(ids) or set(keep) - {0, 1}:
        raise GSSError(
            f"the attention_mask of {name} is not {len(ids)} 0s and 1s, one per input_id: "
            "give the row's own mask, or leave it out."
        )
    first = keep.index(1) if 1 in keep else len(keep)
    last = len(keep) - keep[::-1].index(1) if 1 in keep else first
    if 0 in keep[first:last]:
        raise GSSError(
            f"the attention_mask of {name} masks tokens inside the sequence, not only padding at "
            "its start or end: pass the tokens the model reads, one sequence per row."
        )
    return ids[first:last]


def holds_ids(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` can hold token ids (an integer type; bool is a mask)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def id_row(x: Any, index: int, where: str | None = None) -> list[int]:
    """One sequence of token ids (or a row's ``input_ids``) as a list of ints; a GSSError for
    anything else, naming `where` it is (default: sequence `index`)."""
    if isinstance(x, Mapping):
        ids = id_row(x["input_ids"], index, where or f"the input_ids of sequence {index}")
        if x.get("attention_mask") is None:
            return ids
        return _unpadded(ids, x["attention_mask"], where or f"sequence {index}")
    name = where or f"sequence {index}"
    if isinstance(x, Tensor) or hasattr(x, "__array__"):
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):
            raise GSSError(
                f"{name} is an array of {getattr(x, 'dtype', 'objects')}, not of token ids."
            ) from None
        if t.ndim != 1 or not holds_ids(t.dtype):
            raise GSSError(
                f"{name} is a {t.ndim}-d {t.dtype} array; a sequence of token ids "
                "is 1-d and of an integer type."
            )
        return _in_id_range(t.long().tolist(), name)
    if isinstance(x, (list, tuple)):
        try:
            if any(v.__class__ is bool for v in x):  # True is an int to Python, not an id
                raise TypeError
            return _in_id_range([operator.index(v) for v in x], name)
        except TypeError:
            odd = next(v for v in x if not hasattr(v, "__index__") or v.__class__ is bool)
            raise GSSError(
                f"{name} holds a {type(odd).__name__} ({odd!r:.40}) among its token "
                "ids; ids are integers (texts are strings, conversations lists of "
                "{'role', 'content'} dicts)."
            ) from None
    if isinstance(x, int):
        raise GSSError(
            "sequences must be texts or lists of token ids; got an int among them: for one "
            "sequence of token ids, wrap it in a list ([ids]) or pass a 2-D tensor."
        )
    raise GSSError(
        f"{name} is of type {type(x).__name__}; pass strings, conversations (lists "
        f"of {{'role', 'content'}} dicts), dataset rows ({FORMATS}) or lists of token ids."
    )


MAX_ID = 2**31 - 1  # token ids are kept as int32 (`gss.signal.tokens`); no vocabulary is larger


def _in_id_range(ids: list[int], name: str) -> list[int]:
    """``ids``, refused where one is past any vocabulary (it would overflow the int32 the
    rows are kept in, a traceback, before the model's own vocabulary is checked)."""
    if ids and (min(ids) < -MAX_ID or max(ids) > MAX_ID):  # in C: every row passes here
        odd = next(v for v in ids if not -MAX_ID <= v <= MAX_ID)
        raise GSSError(
            f"{name} holds the token id {odd}, past any model's vocabulary: token ids are "
            "the tokenizer's (0 to its size - 1). Tokenize with the model's own tokenizer."
        )
    return ids


def _token_lists(
    items: Sequence[Any], tokenizer: Any | None, max_length: int | None, offset: int = 0
) -> list[list[int]]:
    """Token ids of each item (texts through ``tokenizer``, conversations through its chat
    template), cut to ``max_length``; errors count the items from ``offset``."""
    texts = [_as_text(x, offset + i) for i, x in enumerate(items)]
    if all(t is None for t in texts):
        seqs = [id_row(x, offset + i) for i, x in enumerate(items)]
        if tokenizer is not None and callable(tokenizer):
            _check_ids_are_the_text(items, seqs, tokenizer, offset)
    elif any(t is None for t in texts):
        i = next(i for i, t in enumerate(texts) if t is None)
        kind = type(items[i]).__name__
        i += offset
        raise GSSError(
            f"sequences must be all texts or all token ids; sequence {i} is a {kind} among texts."
        )
    else:
        if tokenizer is None:
            raise GSSError(
                "texts were given (strings, conversations or dataset rows): pass the model's "
                "tokenizer."
            )
        if not callable(tokenizer):
            raise GSSError(
                f"tokenizer must be a tokenizer, got {type(tokenizer).__name__}: load it, e.g. "
                "AutoTokenizer.from_pretrained(path) or gss.hf.loading.load_tokenizer(path)."
            )
        plain = {
            i: check_text(t, f"sequence {offset + i}")
            for i, t in enumerate(texts)
            if isinstance(t, str)
        }
        chats = {
            i: check_text(render(t, tokenizer, f"sequence {offset + i}"), f"sequence {offset + i}")
            for i, t in enumerate(texts)
            if t is not None and not isinstance(t, str)
        }
        seqs = [[] for _ in items]
        # a rendered template holds its own special tokens (BOS included): none are added
        for group, special in ((plain, True), (chats, False)):
            if not group:
                continue
            enc = tokenizer(
                list(group.values()),
                truncation=max_length is not None,
                max_length=max_length,
                add_special_tokens=special,
            )
            for i, ids in zip(group, enc["input_ids"], strict=True):
                seqs[i] = list(ids)
    if max_length is not None:
        seqs = [s[:max_length] for s in seqs]
    return seqs


def _check_ids_are_the_text(
    items: Sequence[Any], seqs: list[list[int]], tokenizer: Any, offset: int
) -> None:
    """Rows holding both ``input_ids`` and a ``text`` are read by their ids (what training
    saw): refused where the ids are not the tokenizer's of the text, special tokens aside (the
    whole text, or its start where the ids were cut), since which one the model was tuned on
    is not ours to guess."""
    both = [(i, x.get("text")) for i, x in enumerate(items) if isinstance(x, Mapping)]
    both = [(i, t) for i, t in both if isinstance(t, str)]
    if not both:
        return
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    encoded = tokenizer([t for _, t in both], add_special_tokens=False)["input_ids"]
    for (i, _), ids in zip(both, encoded, strict=True):
        given = [t for t in seqs[i] if t not in special]
        if list(ids[: len(given)]) != given:
            raise GSSError(
                f"sequence {offset + i} has 'text' and 'input_ids' that disagree (the ids are "
                "not the tokenizer's of the text): gss reads the ids, which may not be what the "
                "text says. Keep one of the two (dataset.remove_columns('text'), or tokenize "
                "the text again with the model's tokenizer)."
            )


def predictable(seqs: list[T]) -> list[T]:
    """The sequences with at least one next-token target; an error if none has."""
    kept = [s for s in seqs if len(s) >= 2]
    if not kept:
        longest = max(map(len, seqs), default=0)
        raise GSSError(
            f"every sequence is shorter than 2 tokens (the longest of {len(seqs)} has "
            f"{longest}); nothing to predict. Check that the rows hold text, that max_length is "
            "at least 2, and that the tokenizer makes tokens of the text."
        )
    return kept


class DatasetRows(Sequence[dict[str, Any]]):
    """A `datasets.Dataset` as a sequence of row dicts, read from its (memory-mapped) table only
    when iterated (``chunk`` rows at a time) or indexed: every list-taking path of gss reads it,
    while the rows exist only as the slices asked for (`datasets.Dataset` is not a `Sequence`,
    and ``dataset[a:b]`` is a dict of columns)."""

    def __init__(self, dataset: Any, chunk: int = 256) -> None:
        self.dataset = dataset
        self.chunk = chunk

    def __len__(self) -> int:
        return int(self.dataset.num_rows)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return _row_dicts(self.dataset[start:stop]) if stop > start else []
            return [self[i] for i in range(start, stop, step)]
        n = len(self)
        i = operator.index(index)
        if not -n <= i < n:
            raise IndexError(f"row {index} of a dataset of {n} rows")
        return dict(self.dataset[i % n])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for columns in self.dataset.iter(batch_size=self.chunk):
            yield from _row_dicts(columns)

    @property
    def column_names(self) -> list[str]:
        return list(self.dataset.column_names)

    def __repr__(self) -> str:
        return f"DatasetRows({len(self)} rows, columns {self.column_names})"


def _row_dicts(columns: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A batch of a dataset (a dict of equally long columns) as its rows."""
    names = list(columns)
    if not names:
        return []
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def dataset_kind(data: Any) -> str | None:
    """``"table"`` for a `datasets.Dataset`, ``"stream"`` for an `IterableDataset`, ``"splits"``
    for a `DatasetDict` / `IterableDatasetDict`, None for anything else. Never imports
    ``datasets``: an object of it exists only once it is imported."""
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return None
    kinds = {
        "table": ("Dataset",),
        "stream": ("IterableDataset",),
        "splits": ("DatasetDict", "IterableDatasetDict"),
    }
    for kind, names in kinds.items():
        types = tuple(t for name in names if isinstance(t := getattr(datasets, name, None), type))
        if types and isinstance(data, types):
            return kind
    return None


def sequence_items(data: TextsOrIds, max_length: int | None) -> Iterable[Any]:
    """The sequences of `data`, not yet tokenized (a tensor's rows as views, cut to
    `max_length`; a `datasets.Dataset` as `DatasetRows`; an `IterableDataset` as it is, to be
    read once); an error if there are none (for a stream: once it has been read,
    `token_chunks`)."""
    kind = dataset_kind(data)
    if kind == "splits":
        splits = list(data)
        raise GSSError(
            f"the texts are a DatasetDict of splits {splits}: pass one split, e.g. "
            f"dataset[{splits[0] if splits else 'train'!r}]."
        )
    if kind == "table":
        rows = DatasetRows(data)
        if not rows:
            raise GSSError("no sequences given (the dataset has no rows).")
        return rows
    if kind == "stream":
        return data
    if isinstance(data, (str, bytes, Path)):
        raise GSSError(
            f"the texts are one {type(data).__name__}, which would be read item by item (a "
            "character a sequence): pass a list of texts, e.g. [text] or "
            "gss.data.read_texts(path)."
        )
    if isinstance(data, Mapping):
        if "input_ids" in data:  # a tokenizer's batch (BatchEncoding): its rows, padding dropped
            return _row_dicts(data)
        raise GSSError(
            f"the texts are one {type(data).__name__}: pass a list of rows (dicts with 'text', "
            "'messages', 'prompt' and 'completion', or 'input_ids'), or a tokenizer's batch."
        )
    if isinstance(data, Tensor):
        if data.ndim != 2:
            raise GSSError(f"a tensor of token ids must be (N, T), got {tuple(data.shape)}.")
        if not holds_ids(data.dtype):
            raise GSSError(f"a tensor of token ids must hold integers, got {data.dtype}.")
        items: Sequence[Any] = list(data[:, :max_length] if max_length is not None else data)
    elif isinstance(data, Sequence):
        items = data
    else:
        try:
            items = list(data)  # a generator, a dataset column
        except TypeError:
            what = "None" if data is None else f"one {type(data).__name__}"
            raise GSSError(
                f"the texts are {what}: pass a list of texts (strings, conversations or dataset "
                "rows) or of token id lists, or a 2-D tensor of token ids."
            ) from None
    if not items:
        raise GSSError("no sequences given.")
    return items


def chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """``items`` as lists of ``size`` (the last shorter): slices of a sequence, else read from
    one iterator, so a stream is read once."""
    if isinstance(items, Sequence):
        for start in range(0, len(items), size):
            yield list(items[start : start + size])
        return
    stream = iter(items)
    while part := list(islice(stream, size)):
        yield part


def token_chunks(
    items: Iterable[Any], tokenizer: Any | None, max_length: int | None, chunk: int = 1024
) -> Iterator[tuple[list[Any], list[list[int]]]]:
    """``items`` (`sequence_items`) ``chunk`` at a time, each chunk with its token ids
    (`_token_lists`): a dataset is tokenized as it is read, and a chunk's rows can be let go
    once the caller has what it needs of them. All items must be texts, or all token ids."""
    texts: bool | None = None  # whether the items seen so far are texts
    start = 0
    for part in chunks(items, chunk):
        seqs = _token_lists(part, tokenizer, max_length, start)
        these = _as_text(part[0], start) is not None
        if texts is not None and these != texts:
            kind = type(part[0]).__name__
            among = "texts" if texts else "token ids"
            raise GSSError(
                f"sequences must be all texts or all token ids; sequence {start} is a {kind} "
                f"among {among}."
            )
        texts = these
        yield part, seqs
        start += len(part)
    if start == 0:
        raise GSSError("no sequences given (the dataset yielded no rows).")


def encode(
    data: TextsOrIds, tokenizer: Any | None = None, max_length: int | None = None
) -> list[list[int]]:
    """Token ids of each sequence: strings go through ``tokenizer``; ids pass through. The
    sequences under 2 tokens are left out (`encode_every` keeps them)."""
    return predictable(encode_every(data, tokenizer, max_length))


def encode_every(
    data: TextsOrIds, tokenizer: Any | None = None, max_length: int | None = None
) -> list[list[int]]:
    """`encode` without leaving any sequence out: one per item, in order."""
    items = sequence_items(data, max_length)
    return [s for _, part in token_chunks(items, tokenizer, max_length) for s in part]


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
    items = sequence_items(data, max_length)
    return predictable(compact_rows(items, tokenizer, max_length, chunk, isinstance(data, Tensor)))


def compact_rows(
    items: Iterable[Any],
    tokenizer: Any | None,
    max_length: int | None,
    chunk: int = 1024,
    views: bool = False,
) -> list[Tensor]:
    """`encode_compact` of every item (`sequence_items`), the short ones kept: one tensor an
    item, in order; `views`: the items are a tensor's rows, kept as they are."""
    if views:
        return list(items)
    out: list[Tensor] = []
    for _, part in token_chunks(items, tokenizer, max_length, chunk):
        out.extend(torch.as_tensor(s, dtype=torch.int32) for s in part)
    return out


def template_ids(rendered: str, tokenizer: Any) -> list[int]:
    """A rendered chat template's token ids: it holds its own special tokens, so none is added."""
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def prompt_end(prompt: Sequence[int], row: Sequence[int]) -> int:
    """Where a row's reply starts: the first position at which the separately tokenized prompt
    stops matching the row (a token may straddle the join, a tokenizer may end a text with EOS),
    else the prompt's length."""
    return next(
        (j for j, (a, b) in enumerate(zip(prompt, row, strict=False)) if a != b), len(prompt)
    )


def _prompt_and_full(x: Any, index: int) -> tuple[Text, Text]:
    """A row's prompt and the whole row (prompt and reply), as texts."""
    where = f"sequence {index}"
    if isinstance(x, Mapping) and is_conversation(x.get("messages")):
        x = list(x["messages"])
    if is_conversation(x):
        if not x or x[-1].get("role") != "assistant":
            role = x[-1].get("role") if x else None
            raise GSSError(
                f"{where} is a conversation ending with a {role!r} message: a reply is the "
                "last message, from the assistant."
            )
        return list(x[:-1]), list(x)
    if isinstance(x, Mapping):
        prompt, completion = x.get("prompt"), x.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, prompt + completion
        if is_conversation(prompt) and is_conversation(completion):
            return list(prompt), [*prompt, *completion]
    raise GSSError(
        f"{where} ({type(x).__name__}) has no reply to separate: give conversations (the last "
        "message the assistant's) or rows with 'messages', or 'prompt' and 'completion'."
    )


def check_replies(rows: Sequence[Any]) -> None:
    """Refuse a row with no reply to separate, before a tokenizer or a model is needed."""
    for i, x in enumerate(rows):
        _prompt_and_full(x, i)


def encode_replies(
    data: Sequence[Any] | Iterable[Mapping[str, Any]], tokenizer: Any, max_reply: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """Each row as (prompt ids, reply ids): what a chat fine-tune was asked, and what it
    answered in training.

    A conversation's (or a ``messages`` row's) reply is its last message, the assistant's; the
    prompt is the messages before it rendered up to the assistant's turn, as the model is
    prompted at inference. A ``prompt`` / ``completion`` row's reply is the completion. Both
    come from the tokenized whole row, split where the separately tokenized prompt stops
    matching it, so the reply is the token ids training saw. `max_reply` cuts the replies.
    A `datasets.Dataset` or `IterableDataset` is read row by row.
    """
    if isinstance(data, Tensor) or not (dataset_kind(data) or isinstance(data, Sequence)):
        raise GSSError("no sequences given: pass a list of conversations or rows.")
    out = []
    for i, x in enumerate(sequence_items(data, None)):
        prompt, full = _prompt_and_full(x, i)
        if isinstance(prompt, str) or isinstance(full, str):
            ids = [_token_lists([t], tokenizer, None)[0] for t in (prompt, full)]
        else:
            name = f"sequence {i}"
            texts = (render(prompt, tokenizer, name, True), render(full, tokenizer, name))
            ids = [template_ids(t, tokenizer) for t in texts]
        p, whole = ids
        cut = prompt_end(p, whole)
        if cut == 0 or cut >= len(whole):
            raise GSSError(f"sequence {i} has an empty prompt or an empty reply once tokenized.")
        out.append((whole[:cut], whole[cut:][:max_reply]))
    if not out:
        raise GSSError("no sequences given.")
    return out


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
