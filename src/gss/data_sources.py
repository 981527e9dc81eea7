"""Where rows come from: a ``.txt`` or ``.jsonl`` file, a table file (parquet, csv, json,
arrow), a saved dataset, a dataset folder or a dataset on the Hugging Face Hub.

`read_data` is what every data option of the command line reads through (``--data``,
``--gen-data``, ``--memorized``, ...), and what a script can call for the same result. ``.txt``
and ``.jsonl`` are read here, as they always were, without ``datasets``; everything else goes
through the ``datasets`` library (an optional extra: ``pip install
'gated-subspace-steering[datasets]'``), imported only then. A table is not loaded into memory:
`datasets` keeps it as a memory-mapped Arrow file (a file or a Hub dataset is converted once into
its cache, ``HF_DATASETS_CACHE``), and gss reads it a chunk of rows at a time
(`gss.data.DatasetRows`), keeping only each row's token ids.

The column options say which column holds the text when it is not one of the usual ones
(`gss.data.FORMATS`): the text, a conversation, or a prompt and its completion.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gss.artifact.files import holds_weights
from gss.data import FORMATS, DatasetRows, numbered_rows, texts_of
from gss.errors import GSSError

__all__ = ["Columns", "read_data"]

# the table formats read through `datasets`, by suffix: the name of its packaged loader
TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow"}
LINE_FORMATS = (".txt", ".jsonl", "")  # read here, without `datasets` ("": as .txt)
# the columns gss reads (`gss.data.record_text`, rows of token ids), and what `gss evaluate`
# reads beside them (the secrets a row holds)
READ_COLUMNS = ("text", "messages", "prompt", "completion", "input_ids", "labels")
KEPT_COLUMNS = (*READ_COLUMNS, "secrets")
INSTALL = "pip install 'gated-subspace-steering[datasets]'"


@dataclass(frozen=True)
class Columns:
    """Which columns of a table hold the text, when they are not named as gss reads them
    (``text``, ``messages``, ``prompt`` and ``completion``): one text column, one conversation
    column, or a prompt column and a completion column."""

    text: str | None = None
    messages: str | None = None
    prompt: str | None = None
    completion: str | None = None

    def __post_init__(self) -> None:
        for name, value in self.named.items():
            if not isinstance(value, str) or not value:
                raise GSSError(f"the {name} column must be a column name, got {value!r}.")
        if (self.prompt is None) != (self.completion is None):
            raise GSSError(
                "a prompt column needs a completion column, and the other way round: name both "
                "(--prompt-column and --completion-column)."
            )
        kinds = [k for k in ("text", "messages", "prompt") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise GSSError(
                "name one kind of column: a text column, a messages column, or a prompt and a "
                f"completion column; got {' and '.join(kinds)} columns."
            )

    @property
    def named(self) -> dict[str, str]:
        """{the name gss reads: the column named for it}."""
        fields = ("text", "messages", "prompt", "completion")
        return {k: v for k in fields if (v := getattr(self, k)) is not None}

    def flag(self, column: str) -> str:
        """The command-line option that named `column`."""
        return next(f"--{k}-column" for k, v in self.named.items() if v == column)

    def rename(self, row: dict[str, Any], where: str, strict: bool) -> dict[str, Any]:
        """A ``.jsonl`` row with the named columns under the names gss reads (the usual ones it
        had are dropped, so that the named ones are read; the others, e.g. ``secrets``, stay);
        `strict`: a row without them is an error, else it is read as it is."""
        named = self.named
        missing = [c for c in named.values() if c not in row]
        if missing:
            if strict and "input_ids" not in row:  # token ids need no text column
                raise GSSError(
                    f"{where} has no column {missing[0]!r} ({self.flag(missing[0])}); its keys "
                    f"are {list(row)[:12]}."
                )
            return row
        skip = {*READ_COLUMNS, *named.values()}  # the named ones come back under their names
        kept = {k: v for k, v in row.items() if k not in skip}
        return {**kept, **{name: row[column] for name, column in named.items()}}


def read_data(
    source: str | Path,
    *,
    split: str | None = None,
    text_column: str | None = None,
    messages_column: str | None = None,
    prompt_column: str | None = None,
    completion_column: str | None = None,
    strict: bool = True,
    keep_rows: bool = True,
    progress: bool = True,
) -> Sequence[Any]:
    """The rows of `source`, in a form every gss function takes as texts.

    `source` is a ``.txt`` file (one sequence a line) or ``.jsonl`` file (one row a line),
    read as `gss.data.read_texts` reads them, without ``datasets``; a ``.parquet``, ``.csv``,
    ``.json`` or ``.arrow`` file; a directory `datasets.Dataset.save_to_disk` wrote; another
    directory of data files (a dataset repository's layout); or a dataset id on the Hub
    (``owner/name``, loaded with `datasets.load_dataset`, through your cache: with
    ``HF_HUB_OFFLINE=1`` nothing is downloaded).

    Args:
        split: the split of a Hub dataset, a dataset folder or a saved `DatasetDict`
            (default ``"train"``; a Hub dataset or folder also takes datasets' slices, e.g.
            ``"train[:1000]"``). A file or a saved `Dataset` is one table, read whole.
        text_column, messages_column, prompt_column, completion_column: the columns holding
            the text (a string), the conversation (a list of ``{"role", "content"}``), or a
            prompt and its completion, when they are not named ``text``, ``messages``,
            ``prompt``, ``completion``.
        strict: the named columns must exist (else an error listing the columns), unless
            the rows are token ids (``input_ids``, e.g. `gss audit`'s ``extractable.jsonl``);
            False: a table without them is read by its usual columns, as the command line
            reads its data options other than ``--data``.
        keep_rows: ``.jsonl`` rows stay dicts (`gss.data.read_texts`); a table's rows always do.
        progress: the progress bars of `datasets` while it converts a file.

    Returns a list for ``.txt`` and ``.jsonl``; for anything else a `gss.data.DatasetRows`, a
    sequence over the memory-mapped table that reads a chunk of rows when iterated, with the
    columns gss reads alone (``secrets`` too, for `gss evaluate`).
    """
    columns = Columns(text_column, messages_column, prompt_column, completion_column)
    name, path, stream = _checked_source(source, split, columns, strict)
    if stream or (path.is_file() and path.suffix.lower() in LINE_FORMATS):
        rows = numbered_rows(path)
        if columns.named:
            rows = [
                (where, columns.rename(row, where, strict) if isinstance(row, dict) else row)
                for where, row in rows
            ]
        return texts_of(rows, keep_rows)
    return _read_table(name, path, split, columns, strict, progress)


def _checked_source(
    source: str | Path, split: str | None, columns: Columns, strict: bool
) -> tuple[str, Path, bool]:
    """`read_data`'s source as a name, a path and whether it is a stream (a pipe, a device),
    refused where the options cannot apply to it, before anything is read."""
    if split is not None and (not isinstance(split, str) or not split.strip()):
        raise GSSError(f"split must be a split's name (e.g. 'train'), got {split!r}.")
    name = str(source)
    if not name.strip():
        raise GSSError(
            "the data path is empty: give a .txt or .jsonl file, a table file, a saved dataset "
            "directory or a dataset id on the Hub."
        )
    path = Path("/dev/stdin" if name == "-" else source).expanduser()  # -: lines piped in
    stream = path.exists() and not path.is_dir() and not path.is_file()  # a pipe, a device
    if path.is_dir() and holds_weights(path):
        raise GSSError(
            f"{name} holds weights (a model's or a steering artifact's directory), not data: "
            "give the data file (.txt, .jsonl, ...) or a saved dataset directory."
        )
    if strict and path.is_file() and split is not None:
        raise GSSError(
            f"{name} is one file, read whole: --split (split=) names a split of a Hub dataset or "
            "a dataset folder. Leave it out."
        )
    if strict and path.is_file() and path.suffix in (".txt", "") and columns.named:
        raise GSSError(
            f"{name} is a text file, one sequence a line: it has no columns to name "
            "(--text-column, ...). Leave them out, or give a .jsonl or table file."
        )
    return name, path, stream


def _read_table(
    name: str, path: Path, split: str | None, columns: Columns, strict: bool, progress: bool
) -> DatasetRows:
    """A table file, a dataset folder or a Hub dataset, through ``datasets``, as the rows of
    its text columns; an unknown file format or a missing file is refused first."""
    if path.is_file() and path.suffix.lower() not in TABLE_FORMATS:
        known = ", ".join((".txt", ".jsonl", *TABLE_FORMATS))
        raise GSSError(
            f"{name}: unsupported data format {path.suffix!r}; use {known}, a saved dataset "
            "directory or a dataset id on the Hub."
        )
    if not path.exists() and not _looks_like_hub_id(name):
        raise GSSError(f"data file {name} does not exist.")
    what = f"reading {name}" if path.exists() else f"{name} is no file here; as a Hub dataset, it"
    datasets = import_datasets(what)
    with _progress_bars(datasets, progress):
        table = _load(datasets, name, path, split, strict)
    table = select_columns(table, columns, name, strict)
    check_text_columns(table, columns, name, datasets)
    if table.num_rows == 0:
        raise GSSError(f"{name} contains no sequences (its split has no rows).")
    return DatasetRows(table)


def import_datasets(what: str = "reading this data") -> Any:
    """The ``datasets`` library, or an error saying that `what` needs it and how to install
    it."""
    try:
        import datasets
    except ImportError:
        raise GSSError(
            f"{what} needs the datasets library, which is not installed ({INSTALL}); .txt and "
            ".jsonl files are read without it."
        ) from None
    return datasets


def select_columns(table: Any, columns: Columns, source: str, strict: bool) -> Any:
    """`table` (a `datasets.Dataset` or `IterableDataset`) with the columns gss reads alone,
    the named ones renamed to the names gss reads; an error naming its columns when it has
    none gss can read."""
    names = list(table.column_names or ())
    named = columns.named
    missing = [c for c in named.values() if c not in names]
    if named and not missing:
        extra = [c for c in ("secrets",) if c in names and c not in named.values()]
        table = table.select_columns([*named.values(), *extra])
        renames = {column: name for name, column in named.items() if column != name}
        return table.rename_columns(renames) if renames else table
    if missing and strict and "input_ids" not in names:  # token ids need no text column
        raise GSSError(
            f"{source} has no column {missing[0]!r} ({columns.flag(missing[0])}); its columns "
            f"are {names}."
        )
    readable = (
        "text" in names
        or "messages" in names
        or {"prompt", "completion"} <= set(names)
        or "input_ids" in names
    )
    if not readable:
        asked = f"no column {missing[0]!r} ({columns.flag(missing[0])}) and " if missing else ""
        raise GSSError(
            f"{source} has {asked}no columns in a format gss reads ({FORMATS}, or 'input_ids'); "
            f"its columns are {names}: name the one with the text (--text-column, "
            "--messages-column, or --prompt-column and --completion-column)."
        )
    return table.select_columns([c for c in KEPT_COLUMNS if c in names])


def check_text_columns(table: Any, columns: Columns, source: str, datasets: Any) -> None:
    """A text column (``text``, ``prompt``, ``completion``, or the one named for it) that holds
    something other than strings, or nulls, refused now, from the table's schema, rather than
    at its first row once the models have loaded."""
    features = getattr(table, "features", None) or {}
    # a Dataset's Arrow table, when its rows are all of it (a slice or filter keeps indices into
    # it: its nulls are found at their rows instead); an IterableDataset has none
    arrow = getattr(table, "data", None) if getattr(table, "_indices", None) is None else None
    for read_as in ("text", "prompt", "completion"):
        feature = features.get(read_as)
        if not isinstance(feature, datasets.Value):  # absent, or conversations (lists)
            continue
        column = columns.named.get(read_as, read_as)
        flag = f" ({columns.flag(column)})" if read_as in columns.named else ""
        if feature.dtype not in ("string", "large_string"):
            raise GSSError(
                f"{source}: column {column!r}{flag} holds {feature.dtype} values, not text: name "
                "the column that holds the text."
            )
        nulls = arrow.column(read_as).null_count if arrow is not None else 0
        if nulls:
            raise GSSError(
                f"{source}: column {column!r}{flag} has {nulls} null value(s): drop those rows "
                "(dataset.filter(lambda row: row[...] is not None)) or fill them."
            )


def _looks_like_hub_id(name: str) -> bool:
    """``name`` or ``owner/name``, not a path: a missing path gets a missing-file error."""
    if name.startswith(".") or Path(name).suffix.lower() in (*LINE_FORMATS[:2], *TABLE_FORMATS):
        return False
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None


def _load(datasets: Any, name: str, path: Path, split: str | None, strict: bool) -> Any:
    """The `datasets.Dataset` at `path` (a table file, a saved dataset, a folder) or on the
    Hub (`name`), its `split` for those that have splits (`strict`: a split given for a saved
    `Dataset`, which has none, is an error)."""
    if path.is_file():
        # a single file is one table: datasets names it "train"
        return _call(
            datasets.load_dataset,
            name,
            TABLE_FORMATS[path.suffix.lower()],
            data_files=str(path),
            split="train",
        )
    if any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):  # save_to_disk
        loaded = _call(datasets.load_from_disk, name, str(path))
        if not isinstance(loaded, Mapping):  # a Dataset: one table
            if strict and split is not None:
                raise GSSError(
                    f"{name} is a saved Dataset, one table read whole: --split (split=) names a "
                    "split of a saved DatasetDict, a dataset folder or a Hub dataset. Leave it out."
                )
            return loaded
        wanted = split or "train"
        if wanted not in loaded:
            raise GSSError(
                f"{name} has no split {wanted!r}: its splits are {list(loaded)} (--split)."
            )
        return loaded[wanted]
    if not path.is_dir():
        from gss.hf.hub import check_dataset

        check_dataset(name)
    return _call(
        datasets.load_dataset, name, str(path) if path.is_dir() else name, split=split or "train"
    )


def _call(load: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """`load(*args, **kwargs)`, its failures as one `GSSError` that says what to change."""
    logger = logging.getLogger("datasets")  # it logs a broken file's error before raising it
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return load(*args, **kwargs)
    except GSSError:
        raise
    except ValueError as err:  # datasets: 'Unknown split "x". Should be one of [...]'
        text = str(err)
        if "corresponds to no data" in text:  # a table file without rows
            raise GSSError(f"{name} contains no sequences (the table has no rows).") from err
        found = re.search(r"one of (\[[^\]]*\])", text)
        if "split" in text.lower() and found:
            split = kwargs.get("split")
            raise GSSError(
                f"{name} has no split {split!r}: its splits are {found.group(1)} (--split)."
            ) from err
        raise GSSError(f"datasets could not read {name}: {_brief(text)}") from err
    except OSError as err:
        local = Path(name).expanduser().exists()  # else a Hub id
        if isinstance(err, ConnectionError) and not local:
            raise GSSError(
                f"{name} is neither a local file nor a directory, and datasets could not reach "
                f"it on the Hub ({err}); with HF_HUB_OFFLINE=1 only datasets in your cache load."
            ) from err
        if isinstance(err, FileNotFoundError) and not local:
            raise GSSError(
                f"{name} is neither a local file nor a directory, nor a dataset on the Hub that "
                f"datasets can load ({err})."
            ) from err
        raise GSSError(
            f"datasets could not read {name}: {type(err).__name__}: {_brief(str(err))}"
        ) from err
    except Exception as err:  # datasets and pyarrow raise their own errors on a broken file
        cause = err.__cause__ or err.__context__  # datasets wraps the parser's error
        why = f"{type(cause).__name__}: {_brief(str(cause))}" if cause is not None else ""
        raise GSSError(
            f"datasets could not read {name}: {type(err).__name__}: {_brief(str(err))}"
            + (f" ({why.strip()})" if why.strip() else "")
        ) from err
    finally:
        logger.setLevel(level)


def _brief(text: str, limit: int = 300) -> str:
    """The first line of a library's error, at most ``limit`` characters: an Arrow error
    prints whole schemas (89 lines for a folder of mixed files), and gss says one line."""
    lines = text.strip().splitlines() or [""]
    first = lines[0]
    cut = len(first) > limit or len(lines) > 1
    return (first[:limit].rstrip() + " ...") if cut else first


@contextlib.contextmanager
def _progress_bars(datasets: Any, on: bool) -> Iterator[None]:
    """`datasets`' progress bars off inside when not `on`, as they were after."""
    was_off = datasets.are_progress_bars_disabled()
    if not on and not was_off:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not on and not was_off:
            datasets.enable_progress_bars()
