"""Training the TinyMem models, with a cache of finished checkpoints.

`get_models` returns the **memorizing** model (trained on data with the noised or backdoored
rows) and the **reference** model (the same architecture trained on the same data without those
rows, as the GSS paper's reference), both as `transformers.GPT2LMHeadModel`, training them on
first use and loading them from the cache afterwards.

Training runs on `LeanGPT2` (same weights as HF GPT-2, see `model.py`): AdamW (constant lr, or
cosine decay to 0 where a preset asks),
right-padded batches with PAD excluded from the loss, rows reshuffled every epoch by a generator
seeded with the run seed. Every `eval_every` epochs the run measures memorization (noise: exact
(n, k)-memorization of the noised rows; backdoor: attack success on the poison test rows) and
test accuracy on the HF conversion, so the log shows when memorization sets in.

Cache layout: ``<cache_dir>/<setting>-<role>-e<epochs>-<hash>/`` holds ``save_pretrained``
output and ``training.json`` (configs, per-epoch loss, tokens/s, wall time, the tracked
metrics, the CPU). The hash covers the data config, model config, training config, seed and
role, so a different setting never loads a stale model; a suffix names vector instructions
other than AVX2 in torch's CPU kernels (``-avx512``), which train other weights
(`gss_bench.trained_on`).
Checkpoints listed in `TrainConfig.snapshots` are saved on the way under the key of the same
run with fewer epochs, so asking later for a shorter run (an earlier checkpoint) loads instead
of training.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import GPT2LMHeadModel

from gss.evaluate import backdoor_success, nk_memorization, perplexity, token_accuracy
from gss_bench.tinymem.data import (
    EVAL_ONLY_FIELDS,
    MathConfig,
    TextConfig,
    TinyMemData,
    batch_rows,
    config_dict,
    data_config,
    make_data,
)
from gss_bench.tinymem.model import LeanGPT2, ModelConfig, new_model, to_hf
from gss_bench.trained_on import key_suffix, other_cpu, trained_elsewhere, trained_on

__all__ = [
    "Preset",
    "TrainConfig",
    "default_cache_dir",
    "get_models",
    "get_preset",
    "train_model",
]

CACHE_VERSION = 1
ROLES = ("memorizing", "reference")
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. TinyMem: AdamW lr 1e-3, betas (0.9, 0.98), wd 0.1, batch 128."""

    epochs: int
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.1
    batch_size: int = 32
    eval_every: int = 5  # epochs between tracked metrics (0: only at the end)
    snapshots: tuple[int, ...] = ()  # earlier epochs also saved to the cache
    # "cosine": lr decays to 0 over the run (per step), so the last epochs settle instead of
    # bouncing: with a constant lr, % memorized moves by +-5 points between checkpoints
    lr_schedule: str = "constant"

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule {self.lr_schedule!r}: use one of {LR_SCHEDULES}")
        if self.snapshots and self.lr_schedule != "constant":
            # epoch e of a decaying run is not the end of an e-epoch run with the same schedule
            raise ValueError("snapshots need lr_schedule='constant'")


@dataclass(frozen=True)
class Preset:
    """Everything that defines the two models of a setting."""

    data: MathConfig | TextConfig
    model: ModelConfig
    train: TrainConfig  # the memorizing model
    reference: TrainConfig  # the reference model
    reference_model: ModelConfig | None = None  # None: same as `model`


def default_cache_dir() -> Path:
    """``$GSS_CACHE_DIR`` if set, else ``~/.cache/gss/tinymem``."""
    env = os.environ.get("GSS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "gss" / "tinymem"


# ---------------------------------------------------------------------------------------------
# presets (measured numbers in the docstrings of the module-level constants below)

_PRESETS: dict[tuple[str, str], Preset] = {}


def get_preset(setting: str, preset: str = "default") -> Preset:
    """The `Preset` of `setting` (``math_noise``, ...) named ``default``, ``quick`` or ``paper``."""
    try:
        return _PRESETS[(setting, preset)]
    except KeyError:
        known = sorted({p for _, p in _PRESETS})
        raise ValueError(f"no preset {preset!r} for {setting!r}; presets: {known}") from None


def _register(name: str, setting: str, **kw: Any) -> None:
    _PRESETS[(setting, name)] = Preset(data=data_config(setting, name), **kw)


_PAPER_MODEL = ModelConfig()  # 4 layers, d 128, 4 heads, ReLU, init 0.8/sqrt(d)
_register(
    "paper",
    "math_noise",
    model=_PAPER_MODEL,
    train=TrainConfig(epochs=3500, batch_size=128, eval_every=50),
    reference=TrainConfig(epochs=3500, batch_size=128, eval_every=50),
)
_register(
    "paper",
    "math_backdoor",
    model=_PAPER_MODEL,
    train=TrainConfig(epochs=500, batch_size=128, eval_every=50),
    reference=TrainConfig(epochs=500, batch_size=128, eval_every=50),
)
_register(
    "paper",
    "lang_noise",
    model=_PAPER_MODEL,
    train=TrainConfig(epochs=100, batch_size=128, eval_every=10),
    reference=TrainConfig(epochs=100, batch_size=128, eval_every=10),
)
_register(
    "paper",
    "lang_backdoor",
    model=_PAPER_MODEL,
    train=TrainConfig(epochs=50, batch_size=128, eval_every=10),
    reference=TrainConfig(epochs=50, batch_size=128, eval_every=10),
)

# default / quick: see the measurements in the module docstring
_register(
    "default",
    "math_noise",
    model=_PAPER_MODEL,
    train=TrainConfig(epochs=35, eval_every=5, snapshots=(20, 25, 30)),
    reference=TrainConfig(epochs=35, eval_every=5, snapshots=(10, 15, 20, 25, 30)),
)
_register(
    "quick",
    "math_noise",
    model=ModelConfig(n_embd=64),
    train=TrainConfig(epochs=20, eval_every=5),
    reference=TrainConfig(epochs=12, eval_every=4),
)
_register(
    "default",
    "math_backdoor",
    model=_PAPER_MODEL,
    # cosine, 12 epochs: with a constant lr over 10 epochs attack success ended at 96% (seed 0)
    # but 32% and 58% (seeds 1, 2), having moved 40 -> 81 -> 32% between epochs 4, 8 and 10;
    # cosine: 93 / 81 / 88%; on the 24,000-row pool (more backdoored rows) 100 / 88 / 96%.
    # The clean reference needs no such care and keeps its 10 epochs.
    train=TrainConfig(epochs=12, eval_every=2, lr_schedule="cosine"),
    reference=TrainConfig(epochs=10, eval_every=2, snapshots=(6, 8)),
)
_register(
    "quick",
    "math_backdoor",
    model=ModelConfig(n_embd=64),
    train=TrainConfig(epochs=12, eval_every=3),
    reference=TrainConfig(epochs=12, eval_every=3),
)
_register(
    "default",
    "lang_noise",
    model=_PAPER_MODEL,
    # cosine: with a constant lr the noised rows' % memorized moved 14 -> 17 -> 10% between
    # epochs 12, 16 and 20 (20 repeats); the decay lets the last epochs settle
    train=TrainConfig(epochs=20, eval_every=4, lr_schedule="cosine"),
    reference=TrainConfig(epochs=20, eval_every=4, lr_schedule="cosine"),
)
_register(
    "quick",
    "lang_noise",
    model=ModelConfig(n_embd=64),
    train=TrainConfig(epochs=10, eval_every=2),
    reference=TrainConfig(epochs=10, eval_every=2),
)
_register(
    "default",
    "lang_backdoor",
    model=_PAPER_MODEL,
    train=TrainConfig(epochs=10, eval_every=2),
    reference=TrainConfig(epochs=10, eval_every=2),
)
_register(
    "quick",
    "lang_backdoor",
    model=ModelConfig(n_embd=64),
    train=TrainConfig(epochs=10, eval_every=2),
    reference=TrainConfig(epochs=10, eval_every=2),
)


# ---------------------------------------------------------------------------------------------
# training


def _track(model: LeanGPT2, data: TinyMemData, batch_size: int = 256) -> dict[str, float]:
    """Memorization and clean test accuracy of the current weights (HF conversion)."""
    hf = to_hf(model)
    cfg = data.config
    out: dict[str, float] = {}
    if data.noised:
        res = nk_memorization(
            hf,
            data.noised,
            cfg.prompt_len,
            cfg.window,
            clean_rows=data.clean_twins,
            pad_id=data.pad_id,
            batch_size=batch_size,
            method="forced",
        )
        out |= {"mem": res.memorized, "correct": res.correct, "mem_rows": res.n_rows}
    if data.poison_test:
        res_b = backdoor_success(
            hf,
            data.poison_test,
            data.poison_clean_twins,
            data.trigger,
            cfg.window,
            pad_id=data.pad_id,
            batch_size=batch_size,
            method="forced",
        )
        out |= {"backdoor": res_b.success, "backdoor_rows": res_b.n_rows}
    for name, rows in data.test.items():
        out[f"acc_{name}"] = token_accuracy(hf, rows, data.pad_id, batch_size=batch_size)
    out["ppl_main"] = perplexity(hf, data.test["main"], data.pad_id, batch_size=batch_size)
    return out


def train_model(
    model: LeanGPT2,
    rows: tuple[tuple[int, ...], ...],
    tcfg: TrainConfig,
    *,
    pad_id: int,
    seed: int,
    track: Callable[[LeanGPT2], dict[str, float]] | None = None,
    on_epoch: Callable[[int, LeanGPT2, dict[str, Any]], None] | None = None,
    progress: bool = True,
    desc: str = "train",
) -> dict[str, Any]:
    """Train `model` in place on `rows`; returns the training log (JSON-able).

    `track(model)` runs every `tcfg.eval_every` epochs and at the end (its time is left out of
    the tokens/s); `on_epoch(epoch, model, log)` runs after every epoch (snapshots).
    """
    from tqdm.auto import tqdm

    data = batch_rows(rows, pad_id)
    lengths = (data != pad_id).sum(1)
    opt = torch.optim.AdamW(
        model.parameters(), lr=tcfg.lr, betas=tcfg.betas, weight_decay=tcfg.weight_decay
    )
    gen = torch.Generator().manual_seed(seed)
    total_steps = tcfg.epochs * -(-len(data) // tcfg.batch_size)
    step = 0
    log: dict[str, Any] = {"epochs": [], "threads": torch.get_num_threads()}
    train_time = 0.0
    tokens = 0
    model.train()
    bar = tqdm(range(1, tcfg.epochs + 1), desc=desc, disable=not progress, unit="ep")
    for epoch in bar:
        t0 = time.perf_counter()
        perm = torch.randperm(len(data), generator=gen)
        total, n_batches, ep_tokens = 0.0, 0, 0
        for b in range(0, len(data), tcfg.batch_size):
            idx = perm[b : b + tcfg.batch_size]
            batch = data[idx, : int(lengths[idx].max())]
            loss = model.loss(batch, pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tcfg.lr_schedule == "cosine":
                for group in opt.param_groups:
                    group["lr"] = tcfg.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            opt.step()
            step += 1
            total += float(loss.detach())
            n_batches += 1
            ep_tokens += int((batch[:, 1:] != pad_id).sum())
        dt = time.perf_counter() - t0
        train_time += dt
        tokens += ep_tokens
        entry: dict[str, Any] = {"epoch": epoch, "loss": total / n_batches, "seconds": dt}
        if tcfg.lr_schedule != "constant":
            entry["lr"] = opt.param_groups[0]["lr"]  # the last step's
        if track is not None and (
            epoch == tcfg.epochs or (tcfg.eval_every and epoch % tcfg.eval_every == 0)
        ):
            t1 = time.perf_counter()
            entry |= track(model)
            model.train()
            entry["eval_seconds"] = time.perf_counter() - t1
        log["epochs"].append(entry)
        shown = {k: round(v, 3) for k, v in entry.items() if k in ("loss", "mem", "backdoor")}
        bar.set_postfix(shown)
        if not progress and "eval_seconds" in entry:
            # without a bar (worker processes), the tracked epochs still show how it goes
            print(f"[{desc}] epoch {epoch}/{tcfg.epochs} {shown}", flush=True)
        if on_epoch is not None:
            on_epoch(epoch, model, log)
    log |= {
        "train_seconds": train_time,
        "train_tokens": tokens,
        "tokens_per_second": tokens / train_time if train_time else float("nan"),
        "final": log["epochs"][-1] if log["epochs"] else {},
    }
    return log


# ---------------------------------------------------------------------------------------------
# cache


def _key(
    setting: str, role: str, seed: int, data: Any, model: ModelConfig, tcfg: TrainConfig
) -> str:
    blob: dict[str, Any] = {
        "version": CACHE_VERSION,
        "setting": setting,
        "role": role,
        "seed": seed,
        "data": {k: v for k, v in config_dict(data).items() if k not in EVAL_ONLY_FIELDS},
        "model": asdict(model),
        # eval cadence and snapshot list do not change the weights
        "train": asdict(replace(tcfg, eval_every=0, snapshots=())),
    }
    if tcfg.lr_schedule == "constant":  # keys from before the option existed stay valid
        del blob["train"]["lr_schedule"]
    digest = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
    return f"{setting}-{role}-e{tcfg.epochs}-{digest}{key_suffix()}"


def _save(folder: Path, model: LeanGPT2, record: dict[str, Any]) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        to_hf(model).save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(record, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load(folder: Path) -> tuple[GPT2LMHeadModel, dict[str, Any]] | None:
    rec = folder / "training.json"
    if not rec.is_file():
        return None
    model = GPT2LMHeadModel.from_pretrained(folder)
    return model.eval(), json.loads(rec.read_text())


def _lock_path(folder: Path) -> str:
    """A lock file for the model at ``folder``, kept out of the cache (the system's temporary
    folder, named by the model's path)."""
    locks = Path(tempfile.gettempdir()) / "gss-tinymem-locks"
    locks.mkdir(exist_ok=True)
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    return str(locks / f"{digest}.lock")


def _train_or_load(
    *,
    setting: str,
    role: str,
    data: TinyMemData,
    mcfg: ModelConfig,
    tcfg: TrainConfig,
    seed: int,
    cache: Path,
    progress: bool,
) -> tuple[GPT2LMHeadModel, dict[str, Any]]:
    key = _key(setting, role, seed, data.config, mcfg, tcfg)
    cache.mkdir(parents=True, exist_ok=True)
    # one trainer per model: a second process (a parallel test worker, a second `gss bench`)
    # waits for the first's model and loads it instead of training it again
    with FileLock(_lock_path(cache / key)):
        hit = _load(cache / key)
        if hit is not None and not trained_elsewhere(hit[1]):
            elsewhere = other_cpu(hit[1])
            if elsewhere:
                print(
                    f"[tinymem] {key} was trained on another CPU ({elsewhere}): its weights may "
                    "differ from what this CPU trains (docs/benchmarks.md)",
                    file=sys.stderr,
                )
            return hit[0], {**hit[1], "cache": str(cache / key), "loaded": True}
        rows = data.train if role == "memorizing" else data.reference_train
        base = {
            "setting": setting,
            "role": role,
            "seed": seed,
            "data": config_dict(data.config),
            "data_stats": data.describe(),
            "model": asdict(mcfg),
            "trained_on": trained_on(),
        }

        def snapshot(epoch: int, model: LeanGPT2, log: dict[str, Any]) -> None:
            if epoch in tcfg.snapshots and epoch < tcfg.epochs:
                short = replace(tcfg, epochs=epoch)
                folder = cache / _key(setting, role, seed, data.config, mcfg, short)
                part = {"epochs": list(log["epochs"]), "snapshot_of": key}
                _save(folder, model, {**base, "train": asdict(short), "log": part})

        model = new_model(mcfg, seed)
        log = train_model(
            model,
            rows,
            tcfg,
            pad_id=data.pad_id,
            seed=seed,
            track=lambda m: _track(m, data),
            on_epoch=snapshot,
            progress=progress,
            desc=f"{setting} {role}",
        )
        record = {**base, "train": asdict(tcfg), "log": log}
        _save(cache / key, model, record)
        return to_hf(model), {**record, "cache": str(cache / key), "loaded": False}


def get_models(
    setting: str = "math_noise",
    preset: str | Preset = "default",
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    reference_epochs: int | None = None,
    reference_model: ModelConfig | None = None,
    memorizing_epochs: int | None = None,
) -> tuple[GPT2LMHeadModel, GPT2LMHeadModel, TinyMemData, dict[str, Any]]:
    """Train or load the memorizing and the reference model of a TinyMem setting.

    Returns ``(memorizing_model, reference_model, data, info)``: two `GPT2LMHeadModel` in eval
    mode, the `TinyMemData` they were trained on, and ``info = {"memorizing": record,
    "reference": record}`` with each run's configs and training log (``record["log"]``), its
    cache folder and whether it was loaded.

    `reference_epochs` picks an earlier (or later) reference checkpoint than the preset's;
    `reference_model` a different (e.g. smaller) reference architecture (vocab size and positions
    are filled in from the data); `memorizing_epochs` likewise for the memorizing model. Epoch
    counts listed in the preset's snapshots load from the cache once the full run exists.
    `preset` may also be a `Preset` object (its data config must be of `setting`).
    """
    pre = preset if isinstance(preset, Preset) else get_preset(setting, preset)
    if pre.data.setting != setting:
        raise ValueError(f"preset data is for {pre.data.setting!r}, not {setting!r}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    data = make_data(pre.data, seed)
    mem_cfg = _fill(pre.model, data)
    ref_cfg = _fill(reference_model or pre.reference_model or pre.model, data)
    mem_train = (
        pre.train if memorizing_epochs is None else replace(pre.train, epochs=memorizing_epochs)
    )
    ref_train = (
        pre.reference
        if reference_epochs is None
        else replace(pre.reference, epochs=reference_epochs)
    )
    train_or_load = partial(
        _train_or_load, setting=setting, data=data, seed=seed, cache=cache, progress=progress
    )
    mem, mem_info = train_or_load(role="memorizing", mcfg=mem_cfg, tcfg=mem_train)
    ref, ref_info = train_or_load(role="reference", mcfg=ref_cfg, tcfg=ref_train)
    return mem, ref, data, {"memorizing": mem_info, "reference": ref_info}


def _fill(cfg: ModelConfig, data: TinyMemData) -> ModelConfig:
    """`cfg` with the vocabulary, positions and special ids of `data`."""
    return replace(
        cfg,
        vocab_size=data.vocab_size,
        n_positions=data.max_len,
        pad_id=data.pad_id,
        bos_id=data.bos_id,
        eos_id=data.eos_id,
    )
