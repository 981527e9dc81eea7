"""Data through `datasets`: table files, saved datasets and Hub ids on the command line
(`gss.data_sources.read_data`), and `datasets.Dataset` / `IterableDataset` objects in the API,
built here. Each gives what the equivalent .jsonl or list gives, bit for bit; nothing touches
the network (a Hub id goes through a stand-in `load_dataset` whose arguments are checked)."""

import json
import re
import socket
import sys

import pytest
import torch

import gss
from gss import GSSError
from gss.cli import main
from gss.data import DatasetRows, encode, encode_compact, encode_replies, read_texts
from gss.data_sources import read_data
from gss.signal.tokens import encode_trained

from .helpers import tiny_model, word_tokenizer
from .test_data import TEMPLATE
from .test_docs import GUIDE, section

datasets = pytest.importorskip("datasets")
huggingface_hub = pytest.importorskip("huggingface_hub")

LINES = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
GENERAL = [" ".join(f"w{(i * 5 + j * 11) % 44}" for j in range(10)) for i in range(16)]
CHATS = [
    [
        {"role": "user", "content": f"w{i} w{i + 1}"},
        {"role": "assistant", "content": f"w{i + 2} w{i + 3} w{i + 4}"},
    ]
    for i in range(3, 23)
]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network (offline mode, and a socket that refuses to connect), and datasets' cache
    (where it converts files) inside the test's folder."""

    def refuse(*args, **kwargs):
        raise OSError("tests/test_data_sources.py: no network")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    for name, seed in (("model", 0), ("reference", 1)):
        tiny_model("llama", seed=seed).save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _table(extra: bool = True):
    """The lines in a column named body, beside columns gss does not read."""
    columns = {"body": LINES}
    if extra:
        columns |= {"id": list(range(len(LINES))), "source": ["forum"] * len(LINES)}
    return datasets.Dataset.from_dict(columns)


def _write(table, path):
    """`table` written in the format `path`'s suffix names, with the datasets API."""
    suffix = path.suffix
    if suffix == ".parquet":
        table.to_parquet(str(path))
    elif suffix == ".csv":
        table.to_csv(str(path), index=False)
    elif suffix == ".json":
        table.to_json(str(path))
    elif suffix == ".arrow":  # the Arrow file save_to_disk writes, on its own
        table.save_to_disk(str(path.with_suffix(".saved")))
        next(path.with_suffix(".saved").glob("*.arrow")).rename(path)
    else:  # a directory: save_to_disk
        table.save_to_disk(str(path))
    return path


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", ["rows.parquet", "rows.csv", "rows.json", "rows.arrow", "saved"])
def test_a_table_reads_as_the_jsonl_of_its_column(tmp_path, name):
    path = _write(_table(), tmp_path / name)
    rows = read_data(path, text_column="body", progress=False)
    assert isinstance(rows, DatasetRows)  # not a list: read from the table as it is iterated
    expected = read_texts(_jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in LINES]), True)
    assert list(rows) == expected
    assert rows[3] == expected[3] and rows[-1] == expected[-1] and rows[2:5] == expected[2:5]
    assert rows.column_names == ["text"]  # the columns gss does not read are left out
    if name == "saved":  # a saved Dataset has no splits: --split is refused, not ignored
        with pytest.raises(GSSError, match="is a saved Dataset, one table read whole"):
            read_data(path, split="test", text_column="body", progress=False)
        lenient = read_data(path, split="test", text_column="body", strict=False, progress=False)
        assert len(lenient) == len(LINES)


def test_split_and_columns_of_a_saved_dataset_dict(tmp_path, chat_tokenizer):
    splits = {
        "train": datasets.Dataset.from_dict({"conv": CHATS[:4], "text": ["w1"] * 4}),
        "test": datasets.Dataset.from_dict({"conv": CHATS[4:6], "text": ["w2"] * 2}),
    }
    path = tmp_path / "dict"
    datasets.DatasetDict(splits).save_to_disk(str(path))
    rows = read_data(path, split="test", messages_column="conv", progress=False)
    # the named column wins over the usual one it shares the table with
    assert list(rows) == [{"messages": c} for c in CHATS[4:6]]
    assert encode(rows, chat_tokenizer) == encode(CHATS[4:6], chat_tokenizer)
    with pytest.raises(GSSError, match=r"no split 'valid'.*splits are \['train', 'test'\]"):
        read_data(path, split="valid", progress=False)
    with pytest.raises(
        GSSError, match=r"no column 'chat' \(--messages-column\).*\['conv', 'text'\]"
    ):
        read_data(path, messages_column="chat", progress=False)
    # not strict (the command's other data options): the usual columns instead
    lenient = read_data(path, messages_column="chat", strict=False, progress=False)
    assert lenient[0] == {"text": "w1"}


def test_a_folder_of_data_files_has_its_splits(tmp_path):
    """A folder laid out as a dataset repository (train.csv, test.csv): its files' splits."""
    folder = tmp_path / "repo"
    folder.mkdir()
    datasets.Dataset.from_dict({"body": LINES[:5]}).to_csv(str(folder / "train.csv"), index=False)
    datasets.Dataset.from_dict({"body": LINES[5:8]}).to_csv(str(folder / "test.csv"), index=False)
    rows = read_data(folder, split="test", text_column="body", progress=False)
    assert list(rows) == [{"text": t} for t in LINES[5:8]]
    assert len(read_data(folder, text_column="body", progress=False)) == 5  # train
    with pytest.raises(GSSError, match=r"no split 'valid': its splits are \['train', 'test'\]"):
        read_data(folder, split="valid", text_column="body", progress=False)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(GSSError, match=r"datasets could not read .*broken\.parquet"):
        read_data(broken, progress=False)


def test_column_errors_say_what_there_is(tmp_path):
    path = _write(_table(), tmp_path / "rows.parquet")
    with pytest.raises(
        GSSError, match=r"no columns in a format gss reads.*\['body', 'id', 'source'\]"
    ):
        read_data(path, progress=False)
    with pytest.raises(GSSError, match=r"no column 'bdy' \(--text-column\); its columns are"):
        read_data(path, text_column="bdy", progress=False)
    with pytest.raises(GSSError, match="name one kind of column"):
        read_data(path, text_column="body", messages_column="body", progress=False)
    with pytest.raises(GSSError, match="a prompt column needs a completion column"):
        read_data(path, prompt_column="body", progress=False)
    # a column without text, or with nulls, is said from the schema (before any model loads)
    with pytest.raises(GSSError, match=r"column 'id' \(--text-column\) holds int64 values"):
        read_data(path, text_column="id", progress=False)
    nulls = _write(datasets.Dataset.from_dict({"text": ["w1 w2", None]}), tmp_path / "n.parquet")
    with pytest.raises(GSSError, match=r"column 'text' has 1 null value\(s\)"):
        read_data(nulls, progress=False)
    with pytest.raises(GSSError, match=r"split must be a split's name \(e\.g\. 'train'\), got 0"):
        read_data(path, split=0, progress=False)  # type: ignore[arg-type]
    empty = _write(datasets.Dataset.from_dict({"text": []}), tmp_path / "e.parquet")
    with pytest.raises(GSSError, match=r"e\.parquet contains no sequences \(the table has no rows"):
        read_data(empty, progress=False)
    (tmp_path / "bad.csv").write_text('text,other\n"w1 w2,1\nw3\n')  # the parser's reason said
    with pytest.raises(GSSError, match=r"bad\.csv: DatasetGenerationError: .* \(ParserError: "):
        read_data(tmp_path / "bad.csv", progress=False)
    # a .jsonl row without the column named
    rows = _jsonl(tmp_path / "rows.jsonl", [{"body": "w1 w2"}, {"text": "w3"}])
    assert read_data(rows, text_column="body", strict=False)[1] == {"text": "w3"}
    with pytest.raises(GSSError, match=r"rows\.jsonl:2 has no column 'body'.*keys are \['text'\]"):
        read_data(rows, text_column="body")
    (tmp_path / "rows.xlsx").write_text("x")
    with pytest.raises(GSSError, match=r"unsupported data format '\.xlsx'"):
        read_data(tmp_path / "rows.xlsx")
    with pytest.raises(GSSError, match=r"data file .*missing\.parquet does not exist"):
        read_data(tmp_path / "missing.parquet")


def test_without_datasets_txt_and_jsonl_still_read_and_the_rest_says_what_to_install(
    tmp_path, monkeypatch
):
    text = tmp_path / "rows.txt"
    text.write_text("\n".join(LINES) + "\n")
    jsonl = _jsonl(tmp_path / "rows.jsonl", [{"body": t} for t in LINES])
    parquet = _write(_table(), tmp_path / "rows.parquet")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    assert read_data(text) == LINES
    assert read_data(jsonl, text_column="body") == [{"text": t} for t in LINES]
    install = r"needs the datasets library.*pip install 'gated-subspace-steering\[datasets\]'"
    with pytest.raises(GSSError, match=install):
        read_data(parquet, text_column="body")
    with pytest.raises(
        GSSError, match="owner/rows is no file here; as a Hub dataset, it " + install
    ):
        read_data("owner/rows")


def test_a_hub_id_loads_with_its_split_through_load_dataset(tmp_path, monkeypatch):
    calls = []

    def load_dataset(path, *args, **kwargs):
        calls.append((path, args, kwargs))
        if kwargs.get("split") == "nope":
            raise ValueError("Unknown split \"nope\". Should be one of ['train', 'validation'].")
        return _table()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows = read_data("someone/forum-posts", split="validation", text_column="body", progress=False)
    assert calls == [("someone/forum-posts", (), {"split": "validation"})]
    assert list(rows) == [{"text": t} for t in LINES]
    read_data("someone/forum-posts", text_column="body", progress=False)
    assert calls[-1] == ("someone/forum-posts", (), {"split": "train"})  # the default split
    with pytest.raises(
        GSSError, match=r"no split 'nope': its splits are \['train', 'validation'\]"
    ):
        read_data("someone/forum-posts", split="nope", progress=False)


def test_a_hub_id_not_in_the_cache_offline_says_so():
    # the real load_dataset, offline (the fixture): it cannot reach the Hub, and says so
    with pytest.raises(GSSError, match="HF_HUB_OFFLINE=1 only datasets in your cache load"):
        read_data("gss-tests/no-such-dataset", progress=False)


@pytest.fixture
def online(monkeypatch, tmp_path):
    """Offline mode off (the socket still refuses to connect), an empty Hub cache, and a
    stand-in `load_dataset` that records its calls."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    calls = []

    def load_dataset(path, *args, **kwargs):
        calls.append(path)
        return _table()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_a_hub_id_without_a_network_fails_at_once_without_datasets_retries(online):
    # datasets retries a Hub id that does not resolve for ~25 s; one request says it at once
    with pytest.raises(GSSError, match="the Hub cannot be reached to look for it as a dataset"):
        read_data("gss-tests/no-such-dataset", progress=False)
    assert online == []


def test_a_hub_id_the_hub_does_not_have_is_said_before_datasets_loads(online, monkeypatch):
    from types import SimpleNamespace

    from huggingface_hub.errors import RepositoryNotFoundError

    def dataset_info(self, name, **kwargs):
        response = SimpleNamespace(headers={}, request=None, status_code=404)
        raise RepositoryNotFoundError("the Hub said no", response=response)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    with pytest.raises(GSSError, match="nope is neither a local file or directory nor a Hub"):
        read_data("nope", progress=False)
    assert online == []


def test_a_hub_dataset_in_the_cache_goes_to_datasets_unasked(online, tmp_path, monkeypatch):
    # datasets loads a cached dataset when the Hub is down: no request may stop it first
    (tmp_path / "hub" / "datasets--someone--forum-posts").mkdir(parents=True)
    read_data("someone/forum-posts", text_column="body", progress=False)
    assert online == ["someone/forum-posts"]
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # datasets' own offline switch: nothing asked
    read_data("someone/other-posts", text_column="body", progress=False)
    assert online == ["someone/forum-posts", "someone/other-posts"]


def test_cli_signal_on_a_parquet_column_prints_what_the_jsonl_gives(tmp_path, models, capsys):
    """--data rows.parquet --text-column body is --data rows.jsonl with a text column; the
    columns apply to --normal-data where it has them (a saved dataset here), not to a .txt."""
    parquet = _write(_table(), tmp_path / "rows.parquet")
    jsonl = _jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in LINES])
    saved = _write(datasets.Dataset.from_dict({"body": GENERAL}), tmp_path / "general")
    (tmp_path / "general.txt").write_text("\n".join(GENERAL) + "\n")
    base = ["signal", "--model", str(models / "model"), "--reference", str(models / "reference")]
    base += ["--no-progress"]

    def report(*args):
        capsys.readouterr()
        assert main([*base, *args]) == 0
        return json.loads(capsys.readouterr().out)

    expected = report("--data", str(jsonl), "--normal-data", str(tmp_path / "general.txt"))
    given = report("--data", str(parquet), "--text-column", "body", "--normal-data", str(saved))
    assert given == expected
    mixed = ["--data", str(parquet), "--text-column", "body"]
    assert report(*mixed, "--normal-data", str(tmp_path / "general.txt")) == expected
    assert main([*base, "--data", str(parquet), "--text-column", "bdy"]) == 2
    assert "no column 'bdy' (--text-column); its columns are ['body', 'id', 'source']" in (
        capsys.readouterr().err
    )


def test_cli_audit_of_a_saved_dataset_writes_what_the_jsonl_gives(tmp_path, models):
    saved = _write(_table(), tmp_path / "saved")
    jsonl = _jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in LINES])
    base = ["audit", "--model", str(models / "model"), "--reference", str(models / "reference")]
    base += ["--k", "4", "--n", "10", "--no-progress"]
    assert main([*base, "--data", str(jsonl), "--out", str(tmp_path / "a")]) == 0
    given = ["--data", str(saved), "--text-column", "body", "--out", str(tmp_path / "b")]
    assert main([*base, *given]) == 0
    assert (tmp_path / "b" / "extractable.jsonl").read_bytes() == (
        tmp_path / "a" / "extractable.jsonl"
    ).read_bytes()
    assert _audited(tmp_path / "b") == _audited(tmp_path / "a")


def _audited(out):
    """audit.jsonl's rows without where they came from (a line of a file; not of a table)."""
    rows = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    assert all(
        r.get("source", f"rows.jsonl:{r['row'] + 1}").endswith(f"rows.jsonl:{r['row'] + 1}")
        for r in rows
    )
    return [{k: v for k, v in r.items() if k != "source"} for r in rows]


def test_cli_audit_reads_a_hub_id_with_split_and_columns(tmp_path, models, monkeypatch):
    calls = []

    def load_dataset(path, *args, **kwargs):
        calls.append((path, kwargs))
        return _table()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    jsonl = _jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in LINES])
    base = ["audit", "--model", str(models / "model"), "--reference", str(models / "reference")]
    base += ["--k", "4", "--n", "10", "--no-progress"]
    assert main([*base, "--data", str(jsonl), "--out", str(tmp_path / "a")]) == 0
    hub = ["--data", "someone/forum-posts", "--split", "test", "--text-column", "body"]
    assert main([*base, *hub, "--out", str(tmp_path / "b")]) == 0
    assert calls == [("someone/forum-posts", {"split": "test"})]
    assert _audited(tmp_path / "b") == _audited(tmp_path / "a")


def _tensors(artifact):
    return {name: getattr(artifact, name) for name in ("probe", "steer", "thresholds", "offset")}


def _same(a, b):
    ta, tb = _tensors(a), _tensors(b)
    assert all(torch.equal(ta[n], tb[n]) for n in ta), "the artifacts' tensors differ"
    assert a.provenance.token_counts == b.provenance.token_counts


def test_cli_calibrate_on_a_csv_and_a_saved_gen_data_equals_the_jsonl(tmp_path, models):
    csv = _write(_table(), tmp_path / "rows.csv")
    general = _write(datasets.Dataset.from_dict({"body": GENERAL}), tmp_path / "general")
    jsonl = _jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in LINES])
    (tmp_path / "general.txt").write_text("\n".join(GENERAL) + "\n")
    base = ["calibrate", "--model", str(models / "model"), "--reference", str(models / "reference")]
    base += ["--layer", "1", "--rank", "2", "--no-progress"]
    args = ["--data", str(jsonl), "--gen-data", str(tmp_path / "general.txt")]
    assert main([*base, *args, "--out", str(tmp_path / "a")]) == 0
    args = ["--data", str(csv), "--gen-data", str(general), "--text-column", "body"]
    assert main([*base, *args, "--out", str(tmp_path / "b")]) == 0
    _same(gss.load(tmp_path / "a"), gss.load(tmp_path / "b"))


@pytest.fixture(scope="module")
def loaded():
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1), word_tokenizer()


def test_calibrate_on_a_dataset_and_a_stream_equals_the_list(loaded, monkeypatch):
    model, reference, tok = loaded
    options = {"tokenizer": tok, "layer": 1, "rank": 2, "progress": False}
    expected = gss.calibrate(model, reference, LINES, gen_texts=GENERAL, **options)
    table = datasets.Dataset.from_dict({"text": LINES, "id": list(range(len(LINES)))})
    general = datasets.Dataset.from_dict({"text": GENERAL})
    # the table is read a chunk of rows at a time, never turned whole into Python objects
    for whole in ("to_list", "to_dict", "to_pandas"):
        monkeypatch.setattr(datasets.Dataset, whole, lambda *a, **k: pytest.fail("read whole"))
    _same(gss.calibrate(model, reference, table, gen_texts=general, **options), expected)
    stream, gen_stream = table.to_iterable_dataset(), general.to_iterable_dataset()
    _same(gss.calibrate(model, reference, stream, gen_texts=gen_stream, **options), expected)
    # the layer scan and the audit too
    scan = gss.scan_layers(model, reference, stream, tokenizer=tok, progress=False)
    assert (
        scan.strengths
        == gss.scan_layers(model, reference, LINES, tokenizer=tok, progress=False).strengths
    )
    audit = gss.audit(model, reference, table, tokenizer=tok, k=4, n=10, progress=False)
    assert (
        audit.rows
        == gss.audit(model, reference, LINES, tokenizer=tok, k=4, n=10, progress=False).rows
    )


def test_a_stream_is_read_once(loaded, chat_tokenizer):
    """An IterableDataset (here from a generator, which may be unbounded: `.take(n)` bounds it)
    is read once, in order, by calibration: conversations too, whose replies check reads the
    first rows calibration kept, not the stream again."""
    model, reference, tok = loaded
    read = []

    def rows(texts):
        def gen():
            for i, text in enumerate(texts * 10):  # no further than take() asks
                read.append(i)
                yield text

        return datasets.IterableDataset.from_generator(gen).take(len(LINES))

    options = {"layer": 1, "rank": 2, "progress": False}
    expected = gss.calibrate(model, reference, LINES, tokenizer=tok, gen_texts=GENERAL, **options)
    stream = rows([{"text": t} for t in LINES])
    given = gss.calibrate(model, reference, stream, tokenizer=tok, gen_texts=GENERAL, **options)
    _same(given, expected)
    assert read[: len(LINES)] == list(range(len(LINES)))  # in order
    assert len(set(read)) == len(read) <= len(LINES) + 1  # each once (take may look one ahead)
    read.clear()
    chats = [{"messages": c} for c in CHATS]
    stream = rows(chats)
    chat = {"tokenizer": chat_tokenizer, "gen_texts": GENERAL, **options}
    _same(
        gss.calibrate(model, reference, stream, **chat),
        gss.calibrate(model, reference, chats, **chat),
    )
    assert read[: len(LINES)] == list(range(len(LINES)))
    assert len(set(read)) == len(read) <= len(LINES) + 1


def test_conversations_labels_and_replies_from_a_dataset(chat_tokenizer):
    tok = chat_tokenizer
    table = datasets.Dataset.from_list([{"messages": c} for c in CHATS])
    assert encode(table, tok) == encode(CHATS, tok)
    assert encode(table.to_iterable_dataset(), tok) == encode(CHATS, tok)
    assert encode_replies(table, tok) == encode_replies(CHATS, tok)
    assert encode_replies(table.to_iterable_dataset(), tok) == encode_replies(CHATS, tok)
    ids, masks = encode_trained(table, tok, replies_only=True)
    ids_list, masks_list = encode_trained(CHATS, tok, replies_only=True)
    assert [i.tolist() for i in ids] == [i.tolist() for i in ids_list]
    assert [m.tolist() for m in masks] == [m.tolist() for m in masks_list]
    # rows of token ids and labels; labels first met in a later chunk still mark the rows before
    rows = [{"input_ids": [1, 9, 10]}, {"input_ids": [1, 5, 6], "labels": [-100, 5, 6]}]
    _, masks = encode_trained(rows, tok, chunk=1)
    assert [m.tolist() for m in masks] == [[True] * 3, [False, True, True]]
    labelled = datasets.Dataset.from_list(
        [{"input_ids": [1, 5, 6, 7], "labels": [-100, 5, -100, 7]}]
    )
    (row,), (mask,) = encode_trained(labelled, tok)
    assert row.tolist() == [1, 5, 6, 7] and mask.tolist() == [False, True, False, True]


def test_a_dataset_dict_or_an_empty_dataset_is_refused():
    tok = word_tokenizer()
    table = datasets.Dataset.from_dict({"text": LINES})
    with pytest.raises(GSSError, match=r"a DatasetDict of splits \['train'\]: pass one split"):
        encode(datasets.DatasetDict({"train": table}), tok)
    with pytest.raises(GSSError, match="no sequences given"):
        encode(table.select([]), tok)
    with pytest.raises(GSSError, match="no sequences given"):
        encode(table.to_iterable_dataset().take(0), tok)
    # all texts or all token ids, across the chunks a dataset is read in
    with pytest.raises(GSSError, match="sequence 2 is a str among token ids"):
        encode_compact([[1, 2, 3], [1, 2], "w1 w2"], tok, chunk=2)
    with pytest.raises(GSSError, match="sequence 2 is a list among texts"):
        encode_compact(["w1 w2", "w3 w4", [1, 2]], tok, chunk=2)


def test_cli_evaluate_reads_token_id_rows_and_a_saved_heldout(tmp_path, models):
    """--memorized rows of token ids (as `gss audit` writes extractable.jsonl: no text column
    to name) beside --heldout, a saved dataset whose text is in the column --text-column
    names: what --heldout general.txt gives."""
    tok = word_tokenizer()
    ids = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": tok(t)["input_ids"]} for t in LINES])
    saved = _write(datasets.Dataset.from_dict({"body": GENERAL}), tmp_path / "general")
    (tmp_path / "general.txt").write_text("\n".join(GENERAL) + "\n")
    base = ["evaluate", "--model", str(models / "model"), "--memorized", str(ids)]
    base += ["--k", "4", "--n", "10", "--no-progress"]
    args = ["--heldout", str(tmp_path / "general.txt"), "--out", str(tmp_path / "a")]
    assert main([*base, *args]) == 0
    args = ["--heldout", str(saved), "--text-column", "body", "--out", str(tmp_path / "b")]
    assert main([*base, *args]) == 0
    a, b = (json.loads((tmp_path / d / "evaluation.json").read_text()) for d in "ab")
    for record in (a, b):
        del record["unsteered"]["seconds"]
    assert a == b and a["unsteered"]["rows"] == len(LINES)


def test_your_model_data_example_runs(tmp_path, monkeypatch, capsys):
    """docs/your-model.md's "Your data" example, on tiny stand-ins for the user's models."""
    block = re.search(r"```python\n(.*?)```", section(GUIDE, "## Your data"), re.S)
    assert block is not None
    for name, seed in (("ft", 0), ("base", 1)):
        tiny_model("llama", seed=seed).save_pretrained(tmp_path / name)
        word_tokenizer().save_pretrained(tmp_path / name)
    rows = [" ".join(f"w{(i * 7 + j * 3) % 40}" for j in range(40)) for i in range(12)]
    posts = {"body": rows, "id": list(range(len(rows)))}
    datasets.Dataset.from_dict(posts).to_parquet(str(tmp_path / "posts.parquet"))
    datasets.Dataset.from_dict({"text": GENERAL}).to_parquet(str(tmp_path / "heldout.parquet"))
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "your-model.md", "exec"), {})
    assert (tmp_path / "gss-artifact" / "gss_config.json").is_file()
    assert "of 12 rows extractable" in capsys.readouterr().out


@pytest.mark.parametrize("error", [ValueError, OSError, RuntimeError])
def test_a_librarys_long_error_is_said_in_one_line(error):
    """datasets / Arrow errors can print whole schemas (89 lines for a folder of mixed files):
    gss says the first line, cut at 300 characters."""
    from gss.data_sources import _call

    def fails(*_, **__):
        raise error("could not cast the schema\n" + "column: string\n" * 80)

    with pytest.raises(GSSError) as caught:
        _call(fails, "folder/")
    said = str(caught.value)
    assert "\n" not in said and "could not cast the schema ..." in said, said
