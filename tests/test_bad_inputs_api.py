"""Bad and edge inputs to the library, one table row each (issue 42): a `GSSError` that names
the problem (raised before any forward pass where the problem can be known then), a
`GSSWarning`, or a correct result. The command line's cases are in ``test_bad_inputs_cli.py``.

Each row is ``(name, call, outcome)``: ``call(c)`` runs one input against the shared tiny
models of `Ctx`; the outcome is `Err` (the message matched; ``early``: neither model ran a
forward pass first), `Warns` (a GSSWarning matched, and no error) or `Ok` (no error; ``call``
asserts what a correct result is).
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import gss
from gss import GSSError, GSSWarning
from gss.artifact.files import sha256_of
from gss.artifact.steering_artifact import content_sha256
from gss.evaluate.decoding import forced_argmax, greedy_generate
from gss.file_names import CONFIG_NAME, TENSORS_NAME
from gss.signal.omega import memorization_signal
from gss.solve.thresholds import thresholds_from_responses

from .helpers import random_ids, tiny_model, word_tokenizer

LINES = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(16)]


@dataclass
class Ctx:
    """The shared tiny models (built once), their artifact, and a fresh folder per case."""

    model: nn.Module
    ref: nn.Module
    tok: Any
    ids: torch.Tensor
    art: Any
    saved: Path
    forwards: list[int]
    tmp: Path = Path()
    cache: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, build: Callable[[], Any]) -> Any:
        if name not in self.cache:
            self.cache[name] = build()
        return self.cache[name]

    def calibrate(self, texts: Any = None, **kw: Any) -> Any:
        kw = {"layer": 1, "rank": 2, "progress": False, **kw}
        return gss.calibrate(self.model, self.ref, self.ids if texts is None else texts, **kw)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    forwards = [0]

    def count(*_: Any) -> None:
        forwards[0] += 1

    model.register_forward_pre_hook(count)
    ref.register_forward_pre_hook(count)
    ids = random_ids(16, 14, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GSSWarning)
        art = gss.calibrate(model, ref, ids, layer=1, rank=2, progress=False)
    saved = art.save_pretrained(tmp_path_factory.mktemp("catalogue_api") / "art")
    return Ctx(model, ref, word_tokenizer(), ids, art, saved, forwards)


@dataclass(frozen=True)
class Err:
    match: str
    early: bool = True  # raised before either shared model ran a forward pass


@dataclass(frozen=True)
class Warns:
    match: str


@dataclass(frozen=True)
class Ok:
    pass


# ---- helpers the rows use ------------------------------------------------------------------


def _copy(c: Ctx) -> Path:
    out = c.tmp / "copy"
    shutil.copytree(c.saved, out)
    return out


def _edit_config(c: Ctx, edit: Callable[[dict[str, Any]], Any]) -> Path:
    out = _copy(c)
    raw = json.loads((out / CONFIG_NAME).read_text())
    raw = edit(raw) or raw
    (out / CONFIG_NAME).write_text(json.dumps(_resealed(raw)))
    return out


def _resealed(raw: Any) -> Any:
    """A config file edited and sealed again, as a forger would: the checks of what it says
    are tested, not its checksum (`tests/artifact/test_steering_artifact_integrity.py` tests
    that)."""
    if isinstance(raw, dict) and "content_sha256" in raw:
        raw["content_sha256"] = content_sha256(raw)
    return raw


def _edit_tensors(c: Ctx, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy whose tensors are edited and saved again with a matching SHA-256 (so only the
    values are wrong)."""
    out = _copy(c)
    tensors = load_file(str(out / TENSORS_NAME))
    edit(tensors)
    save_file(tensors, str(out / TENSORS_NAME), metadata={"format": "gss"})
    raw = json.loads((out / CONFIG_NAME).read_text())
    raw["tensors_sha256"] = sha256_of(out / TENSORS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(_resealed(raw)))
    return out


def _set(name: str, value: Any) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        if callable(value):
            t[name] = value(t[name])
        else:
            t[name] = value

    return edit


def _truncate(c: Ctx) -> Path:
    out = _copy(c)
    data = (out / TENSORS_NAME).read_bytes()
    (out / TENSORS_NAME).write_bytes(data[: len(data) // 2])
    return out


def _other_save(c: Ctx) -> Path:
    """A copy whose tensors come from another save of another artifact."""
    out = _copy(c)
    other = c.art.with_options(rank=1).save_pretrained(c.tmp / "other")
    shutil.copy(other / TENSORS_NAME, out / TENSORS_NAME)
    return out


def _save_into_foreign(c: Ctx) -> None:
    folder = c.tmp / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    try:
        c.art.save_pretrained(folder)
    finally:
        assert (folder / "notes.txt").read_text() == "mine"  # untouched
        assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def _save_twice(c: Ctx, overwrite: bool) -> None:
    c.art.save_pretrained(c.tmp / "a")
    small = c.art.with_options(rank=1)
    try:
        small.save_pretrained(c.tmp / "a", overwrite=overwrite)
    finally:
        assert gss.load(c.tmp / "a").rank == (1 if overwrite else 2)


def _save_onto_file(c: Ctx) -> None:
    (c.tmp / "f").write_text("mine")
    try:
        c.art.save_pretrained(c.tmp / "f")
    finally:
        assert (c.tmp / "f").read_text() == "mine"


def _nested_steer(c: Ctx) -> None:
    with gss.steer(c.model, c.art), gss.steer(c.model, c.art):
        pass


def _padded(c: Ctx, vocab: int, seed: int) -> nn.Module:
    return c.get(f"llama-{vocab}-{seed}", lambda: tiny_model("llama", seed=seed, vocab=vocab))


def _padded_pair(c: Ctx, ref_vocab: int, tokenizer: bool, **kw: Any) -> Any:
    """A model with 64 logits for the 48-token tokenizer against a reference with
    `ref_vocab`: calibrated, steered, its omega and audit taken."""
    model, ref = _padded(c, 64, 0), _padded(c, ref_vocab, 1)
    if tokenizer:
        texts, extra = LINES, {"tokenizer": c.tok}
    else:
        texts, extra = random_ids(16, 14, seed=2), {}
    art = gss.calibrate(model, ref, texts, layer=1, rank=2, progress=False, **extra, **kw)
    with gss.steer(model, art):
        model(torch.tensor([[3, 4, 5]]))
    omega = memorization_signal(model, ref, c.ids[:2], **extra)
    assert bool(torch.isfinite(omega).all())
    assert len(gss.audit(model, ref, texts, k=4, n=8, progress=False, **extra).rows) == 16
    return art


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class NoMaskLM(nn.Module):
    """A plain causal LM whose forward takes the token ids alone (each position sees only
    itself, which is causal)."""

    def __init__(self, seed: int, vocab: int = 48, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def get_input_embeddings(self) -> nn.Module:
        return self.emb

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for block in self.layers:
            h = block(h)
        return self.head(h)


class PlainLM(nn.Module):
    """A causal LM that is no transformers model: no config, and its forward returns the
    logits tensor itself (each position sees only itself, which is causal)."""

    def __init__(self, seed: int, vocab: int = 48, d: int = 16, head: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, vocab) if head else None
        self.vocab = vocab

    def get_input_embeddings(self) -> nn.Module:
        return self.emb

    def get_output_embeddings(self) -> nn.Module | None:
        return self.head

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        h = self.emb(input_ids)
        for block in self.layers:
            h = block(h)
        return self.head(h) if self.head is not None else h @ self.emb.weight.T


def _plain_lm(c: Ctx, head: bool = True) -> Any:
    model, ref = PlainLM(0, head=head), PlainLM(1, head=head)
    art = gss.calibrate(model, ref, c.ids, layer=1, rank=2, progress=False)
    omega = memorization_signal(model, ref, c.ids[:2])
    assert omega.shape == (2, 13) and bool(torch.isfinite(omega).all())
    with gss.steer(model, art):
        steered = model(c.ids[:2])
    assert steered.shape == (2, 14, 48)
    return art


def _plain_greedy(c: Ctx) -> None:
    """Greedy decoding of a model that returns no KV cache reads the whole sequence at every
    step: its continuation is the one teacher forcing confirms token by token."""
    model = c.get("plain", lambda: PlainLM(0))
    prompts = [c.ids[0, :5].tolist(), c.ids[1, :3].tolist()]
    out = greedy_generate(model, prompts, 6, pad_id=0)
    assert forced_argmax(model, prompts, out, pad_id=0) == out


def _no_mask_lm(c: Ctx) -> None:
    model, ref = NoMaskLM(0), NoMaskLM(1)
    art = gss.calibrate(model, ref, c.ids, layer=1, rank=2, progress=False)
    with gss.steer(model, art):
        model(c.ids[:2])
    ids = torch.tensor([[0, 3, 4, 5]])
    memorization_signal(model, ref, ids, torch.tensor([[0, 1, 1, 1]]))


def _short_rows_dropped(c: Ctx) -> None:
    rows = c.ids.tolist()
    plain = c.calibrate(rows)
    mixed = c.calibrate([[5], *rows[:8], [], [7], *rows[8:]])
    assert torch.allclose(plain.probe, mixed.probe, atol=1e-5)
    assert torch.equal(plain.thresholds, mixed.thresholds)


def _left_padding_exact(c: Ctx) -> None:
    rows = [c.ids[0, :14], c.ids[1, :9], c.ids[2, :5]]
    ids = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros(3, 14, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 14 - len(r) :] = r
        mask[i, 14 - len(r) :] = 1
    batch = memorization_signal(c.model, c.ref, ids, mask)
    for i, r in enumerate(rows):
        alone = memorization_signal(c.model, c.ref, r[None])
        assert torch.allclose(batch[i, 14 - len(r) :], alone[0], atol=1e-5)
        assert bool(batch[i, : 14 - len(r)].isnan().all())


def _one_row(c: Ctx) -> None:
    art = c.calibrate(random_ids(1, 40, seed=5), rank=1)
    assert art.rank == 1 and art.provenance.token_counts["sequences"] == 1


def _rank_is_width(c: Ctx) -> None:
    art = c.calibrate(random_ids(48, 20, seed=6), rank=32)
    assert art.probe.shape == (32, 32)
    assert torch.allclose(art.steer.norm(dim=-1), torch.ones(32), atol=1e-4)


def _generator_of_rows(c: Ctx) -> None:
    art = c.calibrate(row for row in c.ids.tolist())
    assert torch.allclose(art.probe, c.art.probe, atol=1e-5)


def _tuple_of_tensors(c: Ctx) -> None:
    art = c.calibrate(tuple(c.ids))
    assert torch.allclose(art.probe, c.art.probe, atol=1e-5)


def _narrow_reference(c: Ctx) -> None:
    # the reference only gives log-probabilities: its width plays no part
    narrow = c.get("narrow", lambda: tiny_model("llama", seed=1, hidden=16))
    art = gss.calibrate(c.model, narrow, c.ids, layer=1, rank=2, progress=False)
    assert art.probe.shape == (2, 32)


def _thresholds_reset(c: Ctx, **kw: Any) -> Any:
    return gss.calibrate_thresholds(c.model, c.art, c.ids[:4], **kw)


def _with_options(c: Ctx, **kw: Any) -> Any:
    return c.art.with_options(**kw)


def _attach(c: Ctx, model: nn.Module, **kw: Any) -> None:
    handle = c.art.attach(model, **kw)
    handle.remove()


def _steer_run(c: Ctx, model: nn.Module, **kw: Any) -> None:
    with gss.steer(model, c.art, **kw):
        model(torch.tensor([[3, 4, 5]]))


def _audit(c: Ctx, **kw: Any) -> Any:
    return gss.audit(c.model, c.ref, c.ids, progress=False, **kw)


def _scan(c: Ctx, **kw: Any) -> Any:
    return gss.scan_layers(c.model, c.ref, c.ids, progress=False, **kw)


def _signal(c: Ctx, ids: Any, mask: Any = None) -> Any:
    return memorization_signal(c.model, c.ref, ids, mask)


def _unwritten_dir(c: Ctx) -> None:
    assert not (c.tmp / "never").exists()
    gss.load(c.tmp / "never")


def _only_config(c: Ctx) -> Path:
    out = _copy(c)
    (out / TENSORS_NAME).unlink()
    return out


def _bad_json(c: Ctx) -> Path:
    out = _copy(c)
    (out / CONFIG_NAME).write_text('{"format_version": 2,')
    return out


def _on_meta(seed: int = 1) -> nn.Module:
    """A tiny model built under ``torch.device("meta")``: shapes, no weights."""
    with torch.device("meta"):
        return tiny_model("llama", seed=seed)


def _unknown_entry(raw: dict[str, Any]) -> None:
    raw["from_the_future"] = 1


def _drop_sha(raw: dict[str, Any]) -> None:
    del raw["tensors_sha256"]


def _truncated_unrecorded(c: Ctx) -> Path:
    out = _truncate(c)
    raw = json.loads((out / CONFIG_NAME).read_text())
    del raw["tensors_sha256"]
    (out / CONFIG_NAME).write_text(json.dumps(_resealed(raw)))
    return out


def _stretch_steer(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _nan_probe(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _neg_thresholds(t: torch.Tensor) -> torch.Tensor:
    return -t.abs() - 1


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t[name]

    return edit


def _one_layer(c: Ctx) -> nn.Module:
    return c.get("one-layer", lambda: tiny_model("llama", seed=0, layers=1))


NAN = float("nan")
INF = float("inf")
W = "w1 w2 w3"


def _padded_rows_calibrate_as_unpadded(c: Ctx) -> None:
    rows = c.ids[:, :10].tolist()
    padded = [
        {"input_ids": r + [0] * 4, "attention_mask": [1] * 10 + [0] * 4} for r in rows
    ]  # right padding, then left padding
    left = [{"input_ids": [0] * 4 + r, "attention_mask": [0] * 4 + [1] * 10} for r in rows]
    plain = c.calibrate(rows)
    for version in (padded, left):
        art = c.calibrate(version)
        assert art.provenance.token_counts == plain.provenance.token_counts
        assert torch.equal(art.thresholds, plain.thresholds)


def _np_int(value: int) -> Any:
    import numpy as np

    return np.int64(value)


def _numpy_options(c: Ctx) -> None:
    import numpy as np

    art = c.calibrate(layer=np.int64(1), rank=np.int64(2), delta=np.float32(2.0))
    assert (art.layer, art.rank, art.config.delta) == (1, 2, 2.0)
    assert type(art.config.layer) is int and type(art.config.delta) is float
    json.dumps(art.config.to_dict())  # saved as JSON


def _config_none(c: Ctx) -> None:
    assert gss.calibrate(c.model, c.ref, c.ids, None, layer=1, rank=2, progress=False).config == (
        c.calibrate().config
    )


def _sweep(c: Ctx, artifact: Any, **grid: Any) -> Any:
    from gss.evaluate.sweep import steering_sweep

    return steering_sweep(c.model, artifact, c.ids[:4].tolist(), c.ids[4:8].tolist(), **grid)


def _thresholds_under_a_steer(c: Ctx) -> None:
    with gss.steer(c.model, c.art):
        gss.calibrate_thresholds(c.model, c.art, c.ids[:4])


def _save_into_cwd(c: Ctx) -> None:
    import os

    here = Path.cwd()
    (c.tmp / "empty").mkdir()
    os.chdir(c.tmp / "empty")
    try:
        with pytest.raises(GSSError, match="is the current directory"):
            c.art.save_pretrained("../empty")  # the same directory by another path
        c.art.save_pretrained(".")
    finally:
        os.chdir(here)


CASES: list[tuple[str, Callable[[Ctx], Any], Err | Warns | Ok]] = [
    # -- gss.calibrate: the config's fields -----------------------------------------------------
    ("rank 0", lambda c: c.calibrate(rank=0), Err(r"rank must be an integer >= 1, got 0")),
    ("rank 2.5", lambda c: c.calibrate(rank=2.5), Err(r"rank must be an integer >= 1, got 2\.5")),
    ("rank '4'", lambda c: c.calibrate(rank="4"), Err(r"rank must be an integer >= 1, got '4'")),
    ("rank True", lambda c: c.calibrate(rank=True), Err(r"rank must be an integer >= 1, got True")),
    (
        "rank past the width",
        lambda c: c.calibrate(rank=33),
        Err(r"rank must be an integer in 1\.\.32 \(the model's hidden size\), got 33"),
    ),
    ("delta 0", lambda c: c.calibrate(delta=0), Err(r"delta must be > 0, got 0")),
    ("delta -1", lambda c: c.calibrate(delta=-1.0), Err(r"delta must be > 0")),
    ("delta nan", lambda c: c.calibrate(delta=NAN), Err(r"delta must be a finite number, got nan")),
    ("delta inf", lambda c: c.calibrate(delta=INF), Err(r"delta must be a finite number, got inf")),
    ("delta '1'", lambda c: c.calibrate(delta="1"), Err(r"delta must be a finite number, got '1'")),
    ("delta True", lambda c: c.calibrate(delta=True), Err(r"delta must be a finite number")),
    (
        "percentile 0",
        lambda c: c.calibrate(threshold_percentile=0),
        Err(r"threshold_percentile must be in \(0, 100\)"),
    ),
    (
        "percentile 100",
        lambda c: c.calibrate(threshold_percentile=100),
        Err(r"threshold_percentile must be in \(0, 100\)"),
    ),
    (
        "percentile '95'",
        lambda c: c.calibrate(threshold_percentile="95"),
        Err(r"threshold_percentile must be a finite number"),
    ),
    ("gate share 0", lambda c: c.calibrate(gate_share=0), Err(r"gate_share must be in \(0, 1\)")),
    (
        "gate share 1.5",
        lambda c: c.calibrate(gate_share=1.5),
        Err(r"gate_share must be in \(0, 1\)"),
    ),
    (
        "gate share nan",
        lambda c: c.calibrate(gate_share=NAN),
        Err(r"gate_share must be a finite number"),
    ),
    (
        "quantile 0",
        lambda c: c.calibrate(memorized_quantile=0),
        Err(r"memorized_quantile must be in \(0, 1\)"),
    ),
    (
        "quantile 1",
        lambda c: c.calibrate(memorized_quantile=1),
        Err(r"memorized_quantile must be in \(0, 1\)"),
    ),
    ("ridge delta 0", lambda c: c.calibrate(ridge_delta=0), Err(r"ridge_delta must be > 0")),
    ("ridge delta -2", lambda c: c.calibrate(ridge_delta=-2), Err(r"ridge_delta must be > 0")),
    ("jitter -1e-3", lambda c: c.calibrate(jitter=-1e-3), Err(r"jitter must be >= 0")),
    ("jitter nan", lambda c: c.calibrate(jitter=NAN), Err(r"jitter must be a finite number")),
    (
        "omega threshold inf",
        lambda c: c.calibrate(omega_threshold=INF),
        Err(r"omega_threshold must be a finite number"),
    ),
    ("layer 5", lambda c: c.calibrate(layer=5), Err(r"layer 5 is out of range: the model has 2")),
    ("layer -3", lambda c: c.calibrate(layer=-3), Err(r"layer -3 is out of range")),
    ("layer 1.0", lambda c: c.calibrate(layer=1.0), Err(r"layer must be an integer")),
    ("layer '1'", lambda c: c.calibrate(layer="1"), Err(r"layer must be an integer")),
    ("no layer", lambda c: c.calibrate(layer=None), Err(r"no layer given: pass layer=N")),
    (
        "unknown option",
        lambda c: c.calibrate(learning_rate=1e-3),
        Err(r"unknown calibration option\(s\) \['learning_rate'\]"),
    ),
    ("gate 'soft'", lambda c: c.calibrate(gate="soft"), Err(r"gate must be one of")),
    ("coefficient", lambda c: c.calibrate(coefficient="x"), Err(r"coefficient must be one of")),
    ("target", lambda c: c.calibrate(target="x"), Err(r"target must be one of")),
    ("gradient", lambda c: c.calibrate(gradient="x"), Err(r"gradient must be one of")),
    ("centering", lambda c: c.calibrate(centering="x"), Err(r"centering must be one of")),
    ("solve method", lambda c: c.calibrate(solve_method="x"), Err(r"solve_method must be one")),
    ("max length 1", lambda c: c.calibrate(max_length=1), Err(r"max_length must be an integer")),
    ("seed -1", lambda c: c.calibrate(seed=-1), Err(r"seed must be an integer >= 0")),
    (
        "threshold samples 0",
        lambda c: c.calibrate(max_threshold_samples=0),
        Err(r"max_threshold_samples must be an integer >= 1"),
    ),
    ("batch size 0", lambda c: c.calibrate(batch_size=0), Err(r"batch_size must be an integer")),
    (
        "keep general -1",
        lambda c: c.calibrate(keep_general=-1),
        Err(r"keep_general must be an integer >= 0"),
    ),
    (
        "replies only 'yes'",
        lambda c: c.calibrate(replies_only="yes"),
        Err(r"replies_only must be True or False"),
    ),
    (
        "block path wrong",
        lambda c: c.calibrate(block_path="model.blocks"),
        Err(r"block path 'model.blocks' does not name a torch.nn.ModuleList"),
    ),
    (
        "unknown preset",
        lambda c: gss.calibrate(c.model, c.ref, c.ids, "gss-xx", layer=1),
        Err(r"unknown preset 'gss-xx'; known: gss, gss-tr"),
    ),
    (
        "config of another type",
        lambda c: gss.calibrate(c.model, c.ref, c.ids, 42, layer=1),
        Err(r"config must be a CalibrationConfig or a preset name"),
    ),
    # -- gss.calibrate: the texts ---------------------------------------------------------------
    ("no texts", lambda c: c.calibrate([]), Err(r"no sequences given")),
    (
        "empty strings",
        lambda c: c.calibrate(["", " "], tokenizer=c.tok),
        Err(r"every sequence is shorter than 2 tokens"),
    ),
    (
        "one-token rows",
        lambda c: c.calibrate([[5], [6]]),
        Err(r"every sequence is shorter than 2 tokens"),
    ),
    (
        "id past the vocabulary",
        lambda c: c.calibrate([[3, 4, 99]]),
        Err(r"token id 99 is outside the model's vocabulary \(ids 0 to 47\)"),
    ),
    (
        "negative id",
        lambda c: c.calibrate([[3, -1, 4]]),
        Err(r"token id -1 is outside the model's vocabulary"),
    ),
    (
        "ids nested too deep",
        lambda c: c.calibrate([[[3, 4]]]),
        Err(r"sequence 0 holds a list \(\[3, 4\]\) among its token ids"),
    ),
    ("one string", lambda c: c.calibrate("w1 w2", tokenizer=c.tok), Err(r"the texts are one str")),
    ("bytes", lambda c: c.calibrate(b"w1 w2"), Err(r"the texts are one bytes")),
    ("one dict", lambda c: c.calibrate({"text": W}), Err(r"the texts are one dict")),
    ("texts None", lambda c: c.calibrate([None]), Err(r"sequence 0 is of type NoneType")),
    (
        "texts not a collection",
        lambda c: gss.calibrate(c.model, c.ref, None, layer=1),
        Err(r"the texts are None: pass a list of texts"),
    ),
    (
        "texts an int",
        lambda c: gss.calibrate(c.model, c.ref, 5, layer=1),
        Err(r"the texts are one int: pass a list of texts"),
    ),
    ("ids as one flat list", lambda c: c.calibrate([3, 4, 5]), Err(r"wrap it in a list")),
    (
        "1-d tensor",
        lambda c: c.calibrate(torch.arange(3, 10)),
        Err(r"a tensor of token ids must be \(N, T\), got \(7,\)"),
    ),
    (
        "float tensor",
        lambda c: c.calibrate(c.ids.float()),
        Err(r"a tensor of token ids must hold integers, got torch.float32"),
    ),
    (
        "tokenizer a path",
        lambda c: c.calibrate([W], tokenizer="models/fine-tune"),
        Err(r"tokenizer must be a tokenizer, got str"),
    ),
    ("batch size True", lambda c: c.calibrate(batch_size=True), Err(r"batch_size must be")),
    (
        "strings without tokenizer",
        lambda c: c.calibrate([W]),
        Err(r"texts were given .*: pass the model's tokenizer"),
    ),
    (
        "texts and ids mixed",
        lambda c: c.calibrate([W, [3, 4]], tokenizer=c.tok),
        Err(r"all texts or all token ids; sequence 1 is a list among texts"),
    ),
    (
        "conversation without chat template",
        lambda c: c.calibrate([[{"role": "user", "content": W}]], tokenizer=c.tok),
        Err(r"sequence 0 is a conversation, but the tokenizer has no chat template"),
    ),
    (
        "row in no known format",
        lambda c: c.calibrate([{"body": W}], tokenizer=c.tok),
        Err(r"has keys \['body'\], none in a format gss reads"),
    ),
    (
        "rows past the context",
        lambda c: c.calibrate(random_ids(2, 130)),
        Err(r"sequence 0 has 130 tokens, more than the 128 positions the model takes"),
    ),
    ("empty gen_texts", lambda c: c.calibrate(gen_texts=[]), Err(r"no sequences given")),
    ("gen_texts is texts", lambda c: c.calibrate(gen_texts=c.ids), Warns(r"gen_texts is texts")),
    (
        "gen_texts equal to texts",
        lambda c: c.calibrate(c.ids.tolist(), gen_texts=c.ids.tolist()),
        Warns(r"gen_texts is texts: the general statistics and the gates would be set"),
    ),
    (
        "gen_texts past the vocabulary",
        lambda c: c.calibrate(gen_texts=[[3, 48]]),
        Err(r"gen_texts: token id 48 is outside"),
    ),
    (
        "labels all -100",
        lambda c: c.calibrate([{"input_ids": r, "labels": [-100] * 14} for r in c.ids.tolist()]),
        Err(r"none of the .* calibration tokens was trained on", early=False),
    ),
    # -- gss.calibrate: the two models ----------------------------------------------------------
    (
        "reference of another vocabulary",
        lambda c: gss.calibrate(c.model, tiny_model("llama", vocab=100), c.ids, layer=1),
        Err(r"the model's vocabulary has 48 logits but the reference's has 100"),
    ),
    (
        "model as its own reference",
        lambda c: gss.calibrate(c.model, c.model, c.ids, layer=1, progress=False),
        Err(r"omega = 0 everywhere", early=False),
    ),
    (
        "reference a path",
        lambda c: gss.calibrate(c.model, "models/base", c.ids, layer=1),
        Err(r"the reference must be a torch.nn.Module .*, got str"),
    ),
    (
        "model None",
        lambda c: gss.calibrate(None, c.ref, c.ids, layer=1),
        Err(r"the model must be a torch.nn.Module .*, got NoneType"),
    ),
    (
        "nothing passes the rule",
        lambda c: c.calibrate(omega_threshold=1e9),
        Err(r"nothing to steer against", early=False),
    ),
    (
        "fewer memorized tokens than the rank",
        lambda c: c.calibrate(c.ids[:2], rank=20, gen_texts=c.ids),
        Err(r"only \d+ memorized tokens for rank 20: M has rank < K", early=False),
    ),
    ("reference of another width", _narrow_reference, Ok()),
    ("embeddings padded past the tokenizer", lambda c: _padded_pair(c, 64, True), Ok()),
    ("model padded, reference not", lambda c: _padded_pair(c, 48, True), Ok()),
    (
        "model padded, reference not, gss-tr",
        lambda c: _padded_pair(c, 48, True, target="toward-reference"),
        Ok(),
    ),
    (
        "model padded, reference not, per-position gradients",
        lambda c: _padded_pair(c, 48, True, target="toward-reference", gradient="per-position"),
        Ok(),
    ),
    (
        "reference padded, model not",
        lambda c: gss.calibrate(
            _padded(c, 48, 0),
            _padded(c, 64, 1),
            LINES,
            tokenizer=c.tok,
            layer=1,
            rank=2,
            target="toward-reference",
            progress=False,
        ),
        Ok(),
    ),
    (
        "model padded, reference not, no tokenizer",
        lambda c: _padded_pair(c, 48, False),
        Err(r"the model's vocabulary has 64 logits but the reference's has 48.*tokenizer="),
    ),
    (
        "tokenizer past the reference's logits",
        lambda c: gss.calibrate(
            _padded(c, 64, 0), _padded(c, 40, 1), LINES, tokenizer=c.tok, layer=1
        ),
        Err(r"the tokenizer has 48 tokens but the reference has only 40 logits"),
    ),
    ("a forward that returns the logits tensor", _plain_lm, Ok()),
    ("greedy decoding without a KV cache", _plain_greedy, Ok()),
    (
        "a forward without attention_mask, left padding",
        _no_mask_lm,
        Err(r"the model's forward takes no attention_mask, so it would read the padding"),
    ),
    (
        "a model with no vocabulary size",
        lambda c: _plain_lm(c, head=False),
        Err(r"cannot tell the vocabulary size of PlainLM"),
    ),
    # -- gss.calibrate: edge inputs that must work ---------------------------------------------
    ("one row", _one_row, Ok()),
    ("rows shorter than 2 tokens among others", _short_rows_dropped, Ok()),
    ("rank equal to the width", _rank_is_width, Ok()),
    ("a generator of rows", _generator_of_rows, Ok()),
    ("a tuple of 1-d tensors", _tuple_of_tensors, Ok()),
    ("left padding is exact", _left_padding_exact, Ok()),
    # -- gss.load ------------------------------------------------------------------------------
    ("load a missing folder", _unwritten_dir, Err(r"is not a gss artifact directory")),
    (
        "load a file",
        lambda c: gss.load(c.saved / CONFIG_NAME),
        Err(r"is not a gss artifact directory"),
    ),
    ("load config alone", lambda c: gss.load(_only_config(c)), Err(r"expected gss_config.json")),
    ("load corrupted JSON", lambda c: gss.load(_bad_json(c)), Err(r"is not valid JSON")),
    (
        "load a JSON array",
        lambda c: gss.load(_edit_config(c, lambda raw: [raw])),
        Err(r"does not hold a JSON object: the artifact is damaged"),
    ),
    (
        "load format version 99",
        lambda c: gss.load(_edit_config(c, lambda raw: {**raw, "format_version": 99})),
        Err(r"has artifact format version 99, this gss reads versions 1 to 3"),
    ),
    (
        "load tensors of another save",
        lambda c: gss.load(_other_save(c)),
        Err(r"the two files come from different saves"),
    ),
    (
        "load truncated tensors",
        lambda c: gss.load(_truncate(c)),
        Err(r"gss_tensors.safetensors does not load \(.*\): the artifact is damaged"),
    ),
    (
        "load truncated tensors, no checksum",
        lambda c: gss.load(_truncated_unrecorded(c)),
        Err(r"gss_tensors.safetensors does not load \(.*\): the artifact is damaged"),
    ),
    (
        "load NaN probes",
        lambda c: gss.load(_edit_tensors(c, _set("probe", _nan_probe))),
        Err(r"the artifact's probe holds NaN or infinite values"),
    ),
    (
        "load steers not unit",
        lambda c: gss.load(_edit_tensors(c, _set("steer", _stretch_steer))),
        Err(r"steer directions must be unit vectors"),
    ),
    (
        "load negative thresholds",
        lambda c: gss.load(_edit_tensors(c, _set("thresholds", _neg_thresholds))),
        Err(r"negative gate thresholds"),
    ),
    (
        "load a missing tensor",
        lambda c: gss.load(_edit_tensors(c, _drop("offset"))),
        Err(r"lacks the tensors \['offset'\]"),
    ),
    (
        "load misshapen tensors",
        lambda c: gss.load(_edit_tensors(c, _set("thresholds", torch.zeros(3)))),
        Err(r"the artifact's thresholds has shape \(3,\); expected \(2,\)"),
    ),
    (
        "load a config with an unknown option",
        lambda c: gss.load(_edit_config(c, lambda raw: raw["config"].update(lr=1) or raw)),
        Err(r"its config does not load: unknown calibration option\(s\) \['lr'\]"),
    ),
    (
        "load a config with rank 0",
        lambda c: gss.load(_edit_config(c, lambda raw: raw["config"].update(rank=0) or raw)),
        Err(r"its config does not load: rank must be an integer >= 1"),
    ),
    (
        "load an unknown entry",
        lambda c: gss.load(_edit_config(c, _unknown_entry)),
        Warns(r"ignored unknown artifact entries \['from_the_future'\]"),
    ),
    (
        "load without a checksum",  # nothing would tie the tensors to the config (issue 69)
        lambda c: gss.load(_edit_config(c, _drop_sha)),
        Err(r"records no SHA-256 of gss_tensors.safetensors"),
    ),
    # -- attach, with_options, steer -----------------------------------------------------------
    (
        "attach to another model",
        lambda c: _attach(c, c.ref),
        Err(r"calibrated for another model: .*weights of decoder block\(s\) \[0, 1\] differ"),
    ),
    (
        "attach to another model, strict=False",
        lambda c: _attach(c, c.ref, strict=False),
        Warns(r"calibrated for another model"),
    ),
    (
        "attach to a model with fewer blocks",
        lambda c: _attach(c, _one_layer(c)),
        Err(r"num_layers: artifact 2, model 1"),
    ),
    (
        "attach to a model of another width",
        lambda c: _attach(c, c.get("narrow", lambda: tiny_model("llama", seed=1, hidden=16))),
        Err(r"hidden_size: artifact 32, model 16"),
    ),
    (
        "steer a model of another width, strict=False",
        lambda c: _steer_run(
            c, c.get("narrow", lambda: tiny_model("llama", seed=1, hidden=16)), strict=False
        ),
        Err(r"the hooked block outputs hidden size 16 but the steer was calibrated for 32"),
    ),
    (
        "steer a model with fewer blocks, strict=False",
        lambda c: _steer_run(c, _one_layer(c), strict=False),
        Err(r"layer 1 is out of range: the model has 1 decoder blocks"),
    ),
    (
        "attach to a path",
        lambda c: _attach(c, "models/fine-tune"),
        Err(r"the model must be a torch.nn.Module .*, got str"),
    ),
    ("attach with delta 0", lambda c: _attach(c, c.model, delta=0), Err(r"delta must be > 0")),
    (
        "attach with an unknown option",
        lambda c: _attach(c, c.model, layer=0),
        Err(r"unknown option\(s\) \['layer'\]; allowed"),
    ),
    (
        "with_options unknown",
        lambda c: _with_options(c, strength=2),
        Err(r"unknown option\(s\) \['strength'\]"),
    ),
    ("with_options rank 0", lambda c: _with_options(c, rank=0), Err(r"rank must be in 1\.\.2")),
    ("with_options rank 3", lambda c: _with_options(c, rank=3), Err(r"rank must be in 1\.\.2")),
    (
        "with_options rank 1.5",
        lambda c: _with_options(c, rank=1.5),
        Err(r"rank must be an integer >= 1, got 1\.5"),
    ),
    ("with_options delta 0", lambda c: _with_options(c, delta=0), Err(r"delta must be > 0")),
    ("with_options delta -1", lambda c: _with_options(c, delta=-1), Err(r"delta must be > 0")),
    (
        "with_options delta nan",
        lambda c: _with_options(c, delta=NAN),
        Err(r"delta must be a finite number, got nan"),
    ),
    (
        "with_options delta inf",
        lambda c: _with_options(c, delta=INF),
        Err(r"delta must be a finite number, got inf"),
    ),
    (
        "with_options delta 'abc'",
        lambda c: _with_options(c, delta="abc"),
        Err(r"delta must be a finite number, got 'abc'"),
    ),
    ("with_options gate", lambda c: _with_options(c, gate="soft"), Err(r"gate must be one of")),
    (
        "with_options ridge delta 0",
        lambda c: _with_options(c, ridge_delta=0),
        Err(r"ridge_delta must be > 0"),
    ),
    ("nested steer", _nested_steer, Warns(r"this artifact already steers this block")),
    (
        "with_thresholds of another shape",
        lambda c: c.art.with_thresholds(torch.zeros(3), {}),
        Err(r"thresholds must have shape \(2,\)"),
    ),
    # -- save_pretrained -----------------------------------------------------------------------
    ("save into a foreign folder", _save_into_foreign, Err(r"holds files that are not a gss")),
    (
        "save over an artifact",
        lambda c: _save_twice(c, overwrite=False),
        Err(r"already holds a gss artifact: pass overwrite=True"),
    ),
    ("save over an artifact, overwrite", lambda c: _save_twice(c, overwrite=True), Ok()),
    ("save onto a file", _save_onto_file, Err(r"is a file, not a directory")),
    # -- gss.audit, gss.scan_layers, calibrate_thresholds, the signal -------------------------
    ("audit k 0", lambda c: _audit(c, k=0, n=8), Err(r"k must be an integer >= 1, got 0")),
    ("audit k -1", lambda c: _audit(c, k=-1, n=8), Err(r"k must be an integer >= 1")),
    ("audit n == k", lambda c: _audit(c, k=8, n=8), Err(r"n must be an integer > k = 8, got 8")),
    ("audit n < k", lambda c: _audit(c, k=8, n=4), Err(r"n must be an integer > k = 8, got 4")),
    ("audit k 2.5", lambda c: _audit(c, k=2.5, n=8), Err(r"k must be an integer >= 1, got 2\.5")),
    ("audit batch size 0", lambda c: _audit(c, k=4, n=8, batch_size=0), Err(r"batch_size must")),
    ("scan no layers", lambda c: _scan(c, layers=[]), Err(r"no layer to read")),
    ("scan layer 7", lambda c: _scan(c, layers=[0, 7]), Err(r"layer 7 is out of range")),
    ("scan layer 'a'", lambda c: _scan(c, layers=["a"]), Err(r"layer must be an int block index")),
    (
        "scan per-position gradients",
        lambda c: _scan(c, gradient="per-position"),
        Err(r"gradient='per-position' reads one block at a time"),
    ),
    (
        "thresholds percentile 100",
        lambda c: _thresholds_reset(c, threshold_percentile=100),
        Err(r"threshold_percentile must be in \(0, 100\), got 100"),
    ),
    (
        "thresholds percentile '95'",
        lambda c: _thresholds_reset(c, threshold_percentile="95"),
        Err(r"threshold_percentile must be a finite number, got '95'"),
    ),
    (
        "thresholds by both rules",
        lambda c: _thresholds_reset(c, threshold_percentile=50.0, gate_share=0.05),
        Err(r"gate_share replaces threshold_percentile's rule, and both were given"),
    ),
    (
        "thresholds gate share 2",
        lambda c: _thresholds_reset(c, gate_share=2.0),
        Err(r"gate_share must be in \(0, 1\), got 2\.0"),
    ),
    (
        "thresholds on another model",
        lambda c: gss.calibrate_thresholds(c.ref, c.art, c.ids[:4]),
        Err(r"calibrated for another model"),
    ),
    (
        "thresholds from no responses",
        lambda c: thresholds_from_responses(torch.zeros(0, 2)),
        Err(r"no probe responses on general tokens"),
    ),
    ("signal 1-d ids", lambda c: _signal(c, c.ids[0]), Err(r"input_ids must be \(batch, seq\)")),
    ("signal one token", lambda c: _signal(c, c.ids[:, :1]), Err(r"at least 2 tokens")),
    (
        "signal mask of another shape",
        lambda c: _signal(c, c.ids, torch.ones(16, 5)),
        Err(r"attention_mask \(16, 5\) does not match input_ids \(16, 14\)"),
    ),
    (
        "signal statistics of padding only",
        lambda c: gss.signal_statistics(torch.full((2, 3), NAN)),
        Err(r"omega has no finite values"),
    ),
    # -- found by a reliability pass (2026-11-27) ---------------------------------------------
    ("padding masked out of input_ids rows", _padded_rows_calibrate_as_unpadded, Ok()),
    (
        "a mask with holes",
        lambda c: c.calibrate([{"input_ids": [5, 6, 7], "attention_mask": [1, 0, 1]}] * 4),
        Err(r"masks tokens inside the sequence"),
    ),
    (
        "a mask of another length",
        lambda c: c.calibrate([{"input_ids": [5, 6, 7], "attention_mask": [1, 1]}] * 4),
        Err(r"is not 3 0s and 1s, one per input_id"),
    ),
    ("NumPy scalars as options", _numpy_options, Ok()),
    (
        "progress a string",
        lambda c: c.calibrate(progress="no"),
        Err(r"progress must be True or False"),
    ),
    ("seed past 2^63", lambda c: c.calibrate(seed=2**64), Err(r"seed must be below 2\^63")),
    ("config None is the default preset", _config_none, Ok()),
    (
        "reference None",
        lambda c: gss.calibrate(c.model, None, c.ids, layer=1),
        Err(r"the reference must be a torch.nn.Module"),
    ),
    (
        "audit, a reference on the meta device",
        lambda c: gss.audit(c.model, _on_meta(), c.ids, progress=False),
        Err(r"the reference's weights are on the meta device, not loaded \(model\.embed_tokens"),
    ),
    (
        "calibrate, a reference on the meta device",
        lambda c: gss.calibrate(c.model, _on_meta(), c.ids, layer=1, progress=False),
        Err(r"the reference's weights are on the meta device.*load it with from_pretrained"),
    ),
    (
        "calibrate, a model on the meta device",
        lambda c: gss.calibrate(_on_meta(0), c.ref, c.ids, layer=1, progress=False),
        Err(r"the model's weights are on the meta device.*\.to_empty\(device=\.\.\.\)"),
    ),
    (
        "protect, a reference on the meta device",
        lambda c: gss.protect(c.model, _on_meta(), c.ids, progress=False),
        Err(r"the reference's weights are on the meta device"),
    ),
    (
        "handoff to a reference on the meta device",
        lambda c: gss.reference_where_open(c.model, c.art, _on_meta()).__enter__(),
        Err(r"the reference's weights are on the meta device"),
    ),
    (
        "steer None",
        lambda c: gss.steer(c.model, None).__enter__(),
        Err(r"gss.protect found no steer"),
    ),
    (
        "steer a path",
        lambda c: gss.steer(c.model, str(c.saved)).__enter__(),
        Err(r"expected a SteeringArtifact or SteeringStack, got str"),
    ),
    (
        "explain None",
        lambda c: gss.explain(c.model, None, [3, 4]),
        Err(r"explain takes a SteeringArtifact"),
    ),
    (
        "attach to a Linear",
        lambda c: c.art.attach(nn.Linear(3, 3)),
        Err(r"a steer attaches to a causal language model"),
    ),
    (
        "sweep a stack",
        lambda c: _sweep(c, gss.SteeringStack((c.art,))),
        Err(r"a strength sweep takes one SteeringArtifact, got SteeringStack"),
    ),
    (
        "sweep deltas a number",
        lambda c: _sweep(c, c.art, deltas=2.0),
        Err(r"deltas is a list of values"),
    ),
    (
        "thresholds of a stack",
        lambda c: gss.calibrate_thresholds(c.model, gss.SteeringStack((c.art,)), c.ids[:4]),
        Err(r"calibrate_thresholds takes one SteeringArtifact"),
    ),
    (
        "thresholds under a steer",
        _thresholds_under_a_steer,
        Warns(r"reads the steered hidden states"),
    ),
    (
        "scan layers a number",
        lambda c: _scan(c, layers=1),
        Err(r"layers is a list of block indices"),
    ),
    (
        "perplexity of an id past the vocabulary",
        lambda c: gss.evaluate.perplexity(c.model, [[99, 3]]),
        Err(r"token id 99 is outside the model's vocabulary"),
    ),
    (
        "perplexity of strings",
        lambda c: gss.evaluate.perplexity(c.model, ["w1 w2"]),
        Err(r"holds a str"),
    ),
    (
        "perplexity of nothing",
        lambda c: gss.evaluate.perplexity(c.model, []),
        Err(r"no row has a next-token target"),
    ),
    ("save into the working directory", _save_into_cwd, Err(r"is the current directory")),
    # a fresh catalogue (issue 69): a traceback, or a misdiagnosis, once each
    (
        "a lone surrogate among the texts",
        lambda c: c.calibrate([*LINES[:4], "w1 \ud800 w2"], tokenizer=c.tok),
        Err(r"sequence 4 holds '\\ud800' at character 3, a lone surrogate"),
    ),
    (
        "a lone surrogate in gen_texts",
        lambda c: c.calibrate(LINES, tokenizer=c.tok, gen_texts=["w1 \udcff"] * 4),
        Err(r"a lone surrogate"),
    ),
    (
        "explain a prompt with a lone surrogate",
        lambda c: gss.explain(c.model, c.art, "w1 \udcff", tokenizer=c.tok),
        Err(r"explain: the prompt holds '\\udcff'"),
    ),
    (
        "a row whose text and input_ids disagree",
        lambda c: c.calibrate(
            [{"text": t, "input_ids": c.tok(LINES[0])["input_ids"]} for t in LINES[::-1]],
            tokenizer=c.tok,
        ),
        Err(r"sequence 0 has 'text' and 'input_ids' that disagree"),
    ),
    (
        "rows whose input_ids are their text's, cut short",
        lambda c: c.calibrate(
            [{"text": t, "input_ids": c.tok(t)["input_ids"][:9]} for t in LINES], tokenizer=c.tok
        ),
        Ok(),
    ),
    (
        "id past int32",
        lambda c: c.calibrate([[3, 4, 2**31]]),
        Err(r"holds the token id 2147483648, past any model's vocabulary"),
    ),
    (
        "id past int64",
        lambda c: c.calibrate([[3, 4, 2**70]]),
        Err(r"holds the token id 1180591620717411303424, past any"),
    ),
    (
        "audit k and n as NumPy integers",
        lambda c: gss.audit(c.model, c.ref, c.ids, k=_np_int(4), n=_np_int(8), progress=False),
        Ok(),
    ),
    (
        "load a fingerprint entry of the wrong type",
        lambda c: gss.load(
            _edit_config(c, lambda raw: raw["provenance"]["fingerprint"].update(vocab_size="48"))
        ),
        Err(r"fingerprint entry 'vocab_size' is not an int: the artifact is damaged"),
    ),
    (
        "load a fingerprint sample that is text",
        lambda c: gss.load(
            _edit_config(
                c, lambda raw: raw["provenance"]["fingerprint"].update(embedding_sample="x")
            )
        ),
        Err(r"fingerprint entry 'embedding_sample' is not a list of numbers"),
    ),
    (
        "load fingerprint block weights of the wrong shape",
        lambda c: gss.load(
            _edit_config(c, lambda raw: raw["provenance"]["fingerprint"].update(block_weights=[1]))
        ),
        Err(r"fingerprint entry 'block_weights' is not a list of"),
    ),
    (
        "a figure into a folder",
        lambda c: gss.report.save_figure(None, c.tmp),
        Err(r"is a directory: give the figure a file name"),
    ),
]


@pytest.mark.parametrize(("name", "call", "outcome"), CASES, ids=[name for name, _, _ in CASES])
def test_case(ctx, tmp_path, name, call, outcome):
    ctx.tmp = tmp_path
    before = ctx.forwards[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if isinstance(outcome, Err):
            with pytest.raises(GSSError, match=outcome.match) as info:
                call(ctx)
            assert "\n" not in str(info.value)  # one line
            if outcome.early:
                assert ctx.forwards[0] == before, "a forward pass ran before the error"
        else:
            call(ctx)
    said = [str(w.message) for w in caught if issubclass(w.category, GSSWarning)]
    if isinstance(outcome, Warns):
        assert any(re.search(outcome.match, s) for s in said), said


def test_the_catalogue_is_large():
    assert len(CASES) >= 100
    assert len({name for name, _, _ in CASES}) == len(CASES)
