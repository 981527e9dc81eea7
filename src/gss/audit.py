"""Which training rows a fine-tune regurgitates: the list `gss evaluate --memorized` needs.

For every row, one teacher-forced forward of the model and one of the reference give:

- **extractable**: (n, k)-extraction, the paper's definition: prompted with the row's first
  ``k`` tokens, greedy decoding reproduces tokens ``k..n-1`` exactly. Greedy decoding
  reproduces a target iff the teacher-forced argmax equals it at every position, so this is
  exact, with no generation;
- **longest run**: the most consecutive tokens anywhere in the row that greedy decoding would
  reproduce from the prefix before them (the longest stretch where the argmax is the next
  token): a row that is not extractable at k may still leak a long stretch;
- **omega** (log p_model - log p_ref, `gss.signal`): mean, max and the longest burst of
  tokens with omega > 0, a cheap risk score that needs no decoding;
- **shorter prompts** (``prefixes``): the same forward says whether greedy decoding from the
  row's first p tokens reproduces its next n - k, for every p at once. On rows of 30-70 tokens
  the first k = 32 already hold part of a record (issue 72): a shorter prompt ends before it.
  ``memorized_from="shortest"`` makes a row memorized when some scored prompt extracts it and
  the reference's does not, scored from the shortest such prompt; the default stays the
  paper's (n, k) (`AuditReport.memorized_from`).

Rows stream in batches; nothing but the per-row numbers is kept.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss.artifact.files import check_outputs, record_outputs
from gss.config import DEFAULT_WINDOW, RunOptions, Window, run_options
from gss.data import TextsOrIds, batches, count_batches, encode_every, predictable
from gss.errors import GSSError, GSSWarning
from gss.evaluate.intervals import clopper_pearson
from gss.evaluate.near_verbatim import SHARE as NEAR_VERBATIM_SHARE
from gss.evaluate.other_prompts import OtherPromptsReport
from gss.evaluate.other_prompts import other_prompts as under_other_prompts
from gss.evaluate.sampled import LIKELY, SAMPLES, TOP_P, sampled_chance, window_logprobs
from gss.evaluate.suite import is_pair
from gss.hf.forward import (
    check_same_vocab,
    check_sequences,
    context_length,
    forward_logits,
    target_mask,
    token_logprobs,
    warn_if_foreign_tokenizer,
)
from gss.signal.omega import nonfinite_error
from gss.statistics.capture import calibration_mode
from gss.statistics.collect import same_model_error


@dataclass(frozen=True)
class AuditRow:
    """What one row shows: its place in the input, and how much of it the model reproduces."""

    index: int
    tokens: int
    extractable: bool | None  # None: the row has no more than k tokens, nothing to extract
    matched: float  # share of tokens k..n-1 that the teacher-forced argmax reproduces
    longest_run: int  # most consecutive tokens greedy decoding reproduces from their prefix
    omega_mean: float
    omega_max: float
    omega_burst: int  # most consecutive tokens with omega > 0
    # the reference extracts it too: the text is predictable, not learned from this row
    reference_extractable: bool | None = None
    # the prompt lengths scored (`AuditReport.prefixes`) from which greedy decoding reproduces
    # the next n - k tokens (to the row's end, windows of at least `MIN_WINDOW` only), by the
    # model and by the reference
    extracted_from: tuple[int, ...] = ()
    reference_extracted_from: tuple[int, ...] = ()
    # log P(one sample reproduces the window), from its first k tokens (`gss.evaluate.sampled`):
    # at temperature 1, with top-p `sampled.TOP_P` (-inf: a token outside the nucleus), and
    # the reference's at temperature 1; None: no window (or an older audit)
    sampled_logprob: float | None = None
    nucleus_logprob: float | None = None
    reference_sampled_logprob: float | None = None

    @property
    def memorized(self) -> bool:
        """Extractable from the model but not from the reference: regurgitated, not general."""
        return bool(self.extractable) and not self.reference_extractable

    @property
    def leaks_from(self) -> int | None:
        """The shortest prompt the model extracts the row from and the reference does not
        (None: no scored prompt)."""
        return min(set(self.extracted_from) - set(self.reference_extracted_from), default=None)

    def sampled_chance(self, samples: int = SAMPLES, nucleus: bool = False) -> float | None:
        """The chance that one of ``samples`` samples reproduces the window (None: not known)."""
        logprob = self.nucleus_logprob if nucleus else self.sampled_logprob
        return None if logprob is None else sampled_chance(logprob, samples)

    def sample_extractable(self, samples: int = SAMPLES, nucleus: bool = False) -> bool:
        """``samples`` samples reproduce the window with a chance of `sampled.LIKELY` or more."""
        chance = self.sampled_chance(samples, nucleus)
        return chance is not None and chance >= LIKELY

    def reference_sample_extractable(self, samples: int = SAMPLES) -> bool:
        """The reference's ``samples`` samples (temperature 1) reproduce the window with a
        chance of `sampled.LIKELY` or more."""
        logprob = self.reference_sampled_logprob
        return logprob is not None and sampled_chance(logprob, samples) >= LIKELY

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> AuditRow:
        """A row of ``audit.jsonl`` (an older audit's too: the fields it lacks take their
        defaults; the keys that are not fields, such as ``text``, are left out)."""
        names = {f.name for f in fields(cls)}
        kept = {key: value for key, value in record.items() if key in names}
        for key in ("extracted_from", "reference_extracted_from"):
            kept[key] = tuple(kept.get(key, ()))
        return cls(**kept)


MIN_WINDOW = 16
"""The fewest tokens a window counts with in `AuditRow.extracted_from` (all n - k where that is
fewer). On the canaries fine-tune (SmolLM2-135M, `gss bench canaries`), the model and not the
reference reproduces the next 8 tokens from 0.18% of the (row, prompt) places of clean rows it
saw once, 16 from 0.06%, 24 from none, and no 6 tokens of unseen text; every canary keeps a
window of 28-31 tokens after k = 32. The clean passages issue 72 saw flagged had 7-13."""

PREFIX_FLOOR = 8
"""The shortest prompt the default `prefixes` score: k, k/2, k/4, ... down to it (8, 16, 32 at
k = 32); `--prefixes` takes shorter ones."""

MEMORIZED_FROM = ("k", "shortest")
"""What makes a row memorized (`AuditReport.memorized_from`)."""


def default_prefixes(k: int) -> tuple[int, ...]:
    """k and its halvings down to `PREFIX_FLOOR`: one prompt ending where the paper's does,
    the others earlier, where a short row's record may start."""
    out = [k]
    while out[-1] // 2 >= PREFIX_FLOOR:
        out.append(out[-1] // 2)
    return tuple(sorted(out))


def check_prefixes(
    prefixes: Sequence[int] | None, k: int, n: int, memorized_from: str = "k"
) -> tuple[int, ...]:
    """The prompt lengths to score, k among them (None: `default_prefixes`), sorted; a list
    that is not whole numbers from 1 with a window of `MIN_WINDOW` tokens before n (or the
    n - k of k's own) is refused before any work."""
    check_window(k, n)
    if memorized_from not in MEMORIZED_FROM:
        raise GSSError(
            f"memorized_from must be one of {', '.join(MEMORIZED_FROM)}, got {memorized_from!r}."
        )
    if prefixes is None:
        return default_prefixes(k)
    if isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Sequence) or not prefixes:
        raise GSSError(
            f"prefixes must be a list of prompt lengths, e.g. 8,16,32; got {prefixes!r}."
        )
    least = min(MIN_WINDOW, n - k)
    for p in prefixes:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= n - least:
            raise GSSError(
                f"prefixes must be whole numbers of prompt tokens from 1 to {n - least} (a window "
                f"of {least} tokens before n = {n}); got {p!r}."
            )
    return tuple(sorted({k, *prefixes}))


# what `write` writes
OUTPUTS = ("audit.jsonl", "audit.md", "memorized.jsonl", "extractable.jsonl", "audit.png")


@dataclass
class AuditReport:
    """Every row's numbers (in input order), and how the audit was run."""

    rows: list[AuditRow]
    k: int
    n: int
    seconds: float
    ids: list[list[int]] = field(repr=False, default_factory=list)
    # where each row's window starts, for (prompt, reply) pairs (None: at k for every row)
    starts: list[int] | None = field(repr=False, default=None)
    # each row's place among the texts given (rows under 2 tokens are not audited, so a row's
    # `index` can be smaller); None: the same
    positions: list[int] | None = field(repr=False, default=None)
    # each text's origin, by its place among the texts given (e.g. "data.txt:12"), when known
    sources: list[str] | None = field(repr=False, default=None)
    # each row's text up to n tokens, decoded, when the audit had the tokenizer
    texts: list[str] | None = field(repr=False, default=None)
    # the prompt lengths scored (k among them; () for pairs, or an older audit: k alone)
    prefixes: tuple[int, ...] = ()
    # what makes a row memorized: "k", extractable from its first k tokens (the paper's); or
    # "shortest", from some scored prompt (a window of `MIN_WINDOW` tokens or more), scored
    # from the shortest one the reference does not extract it from
    memorized_from: str = "k"
    # each row's scored window decoded, (prompt, window), when the audit had the tokenizer
    scored_texts: list[tuple[str, str]] | None = field(repr=False, default=None)
    # the rows' leaks under other prompts, once `other_prompts` measured them
    prompted: OtherPromptsReport | None = field(repr=False, default=None)

    def position(self, row: AuditRow) -> int:
        """Where ``row`` was among the texts given (its line in a file, blank lines aside)."""
        return row.index if self.positions is None else self.positions[row.index]

    def source(self, row: AuditRow) -> str | None:
        return None if self.sources is None else self.sources[self.position(row)]

    def candidate(self, index: int) -> list[int] | tuple[list[int], list[int]]:
        """Row ``index`` as `gss.evaluate.evaluate_model` reads it: its ids, or for a pair
        (prompt, reply) again; with ``memorized_from="shortest"``, (prompt, window) of the
        window it is scored on (`window`), so that it is measured on the part that leaks."""
        ids = self.ids[index]
        if self.starts is not None:
            return ids[: self.starts[index]], ids[self.starts[index] :]
        if self.memorized_from == "k":
            return ids
        prompt, tokens = self.window(self.rows[index])
        return ids[:prompt], ids[prompt : prompt + tokens]

    def scored_from(self, row: AuditRow) -> int:
        """How many of ``row``'s tokens prompt the window its verdict reads: a pair's prompt,
        k, or with ``memorized_from="shortest"`` the shortest prompt it is memorized from."""
        if self.starts is not None:
            return self.starts[row.index]
        if self.memorized_from == "shortest" and row.leaks_from is not None:
            return row.leaks_from
        return self.k

    def window(self, row: AuditRow) -> tuple[int, int]:
        """(p, w): the part of ``row`` its verdict reads, prompt tokens 0..p-1 and window
        tokens p..p+w-1 (n - k of them, or to the row's end)."""
        prompt = self.scored_from(row)
        return prompt, max(min(self.n - self.k, row.tokens - prompt), 0)

    def window_tokens(self, row: AuditRow) -> int:
        """How many tokens of ``row`` the check compared (`window`: after k, or after a pair's
        prompt, up to n). A short window (a row just over k tokens) is a weak finding: a
        reply's last few tokens, say."""
        return self.window(row)[1]

    @property
    def by_k(self) -> bool:
        """The verdicts are (n, k)-extraction's (``memorized_from="k"``, or pairs)."""
        return self.memorized_from == "k" or self.starts is not None

    def checkable(self, row: AuditRow) -> bool:
        """``row`` has a window to check: past k (or its pair's prompt), or with
        ``memorized_from="shortest"`` one of `MIN_WINDOW` tokens after some scored prompt."""
        if self.by_k:
            return row.extractable is not None
        least = min(MIN_WINDOW, self.n - self.k)
        return any(min(self.n - self.k, row.tokens - p) >= least for p in self.prefixes)

    def is_extractable(self, row: AuditRow) -> bool:
        """Extractable from the model: from its first k tokens (`by_k`), or from some scored
        prompt with a window of `MIN_WINDOW` tokens or more."""
        return bool(row.extractable) if self.by_k else bool(row.extracted_from)

    def is_memorized(self, row: AuditRow) -> bool:
        """Extractable and not by the reference, as ``memorized_from`` says."""
        return row.memorized if self.by_k else row.leaks_from is not None

    @property
    def extractable(self) -> list[AuditRow]:
        return [r for r in self.rows if self.is_extractable(r)]

    @property
    def memorized(self) -> list[AuditRow]:
        """The extractable rows the reference does not extract (`is_memorized`)."""
        return [r for r in self.rows if self.is_memorized(r)]

    def shows_memorization(self, row: AuditRow) -> bool:
        """Whether any mode the audit measured finds ``row`` memorized and the reference does
        not: extractable (`is_memorized`, or from a shorter scored prompt), sampled (either
        sampler reproduces its window with a chance of `sampled.LIKELY` or more), or predicted
        near-verbatim (`near_verbatim.SHARE` of its window right, teacher-forced). A row the
        reference extracts from its first k tokens is text any model completes: none."""
        if self.is_memorized(row) or row.leaks_from is not None:
            return True
        if row.reference_extractable:
            return False
        sampled = row.sample_extractable() or row.sample_extractable(nucleus=True)
        return (sampled and not row.reference_sample_extractable()) or (
            row.matched >= NEAR_VERBATIM_SHARE
        )

    @property
    def clean_ids(self) -> list[list[int]]:
        """The token ids of the rows no mode finds memorized (`shows_memorization`), in input
        order: the data's clean rows (what the fine-tune is for, which protect's domain check
        and gates read). A row memorized in a mode the audit does not flag by stays out: on a
        TinyMem backdoor, the two rows the greedy audit missed were sampled leaks, and a
        domain check on them refused every steer that removed the backdoor."""
        flagged = {r.index for r in self.rows if self.shows_memorization(r)}
        return [list(ids) for i, ids in enumerate(self.ids) if i not in flagged]

    def memorized_per_prefix(self) -> dict[int, int]:
        """How many rows each scored prompt length extracts and the reference's does not."""
        return {
            p: sum(p in r.extracted_from and p not in r.reference_extracted_from for r in self.rows)
            for p in self.prefixes
        }

    def ranked(self) -> list[AuditRow]:
        """Extractable rows first, then by longest run and mean omega."""
        return sorted(
            self.rows,
            key=lambda r: (self.is_extractable(r), r.longest_run, r.omega_mean),
            reverse=True,
        )

    def sampled(self, samples: int = SAMPLES) -> dict[str, Any] | None:
        """The attacker who samples (issue 70): how many rows ``samples`` draws from the first
        k tokens reproduce with a chance of `sampled.LIKELY` or more, at temperature 1 and with
        top-p; the reference's at temperature 1; and the memorized ones among them (the model's
        and not the reference's). None: the audit has no sampled numbers (an older one)."""
        rows = [r for r in self.rows if r.sampled_logprob is not None]
        if not rows:
            return None
        model = [r for r in rows if r.sample_extractable(samples)]
        by_reference = {r.index for r in rows if r.reference_sample_extractable(samples)}
        memorized = [r for r in model if r.index not in by_reference]
        return {
            "samples": samples,
            "top_p": TOP_P,
            "likely": LIKELY,
            "rows": len(rows),
            "extractable": len(model),
            "nucleus_extractable": sum(r.sample_extractable(samples, nucleus=True) for r in rows),
            "reference_extractable": len(by_reference),
            "memorized": len(memorized),
            "memorized_interval": list(clopper_pearson(len(memorized), len(rows))),
            "mean_chance": sum(cast(float, r.sampled_chance(samples)) for r in rows) / len(rows),
        }

    def other_prompts(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        reference: nn.Module | None = None,
        *,
        questions: Sequence[Sequence[str]] | None = None,
        rows: Literal["memorized", "all"] = "memorized",
        batch_size: int | None = None,
        progress: bool | None = None,
        run: RunOptions | None = None,
    ) -> OtherPromptsReport:
        """The attacker who changes the prompt (issue 70): whether the model (and the
        reference, given) says each memorized row's window (``rows="all"``: every row's)
        near-verbatim under a longer prefix, the chat template and questions
        (`gss.evaluate.other_prompts`), each row from the prompt its verdict reads (`window`).
        ``questions``: one list per text given to the audit; ``run`` (or ``batch_size``,
        ``progress``): as `gss.evaluate.other_prompts` takes them. Kept in `prompted`, so that
        the summary and ``audit.md`` show it."""
        if rows not in ("memorized", "all"):
            raise GSSError(f"rows must be 'memorized' or 'all', got {rows!r}.")
        chosen = self.memorized if rows == "memorized" else self.rows
        asked = None
        if questions is not None:
            wanted = max((self.position(r) for r in self.rows), default=-1) + 1
            if len(questions) < wanted:
                raise GSSError(
                    f"questions has {len(questions)} lists for at least {wanted} texts given "
                    "to the audit: give one list per text (empty for none)."
                )
            asked = [questions[self.position(r)] for r in chosen]
        self.prompted = under_other_prompts(
            model,
            [self.ids[r.index] for r in chosen],
            tokenizer=tokenizer,
            reference=reference,
            k=self.k,
            n=self.n,
            starts=[self.window(r)[0] for r in chosen],
            questions=asked,
            indices=[r.index for r in chosen],
            batch_size=batch_size,
            progress=progress,
            run=run,
        )
        return self.prompted

    def summary(self) -> dict[str, Any]:
        checkable = [r for r in self.rows if self.checkable(r)]
        return {
            "rows": len(self.rows),
            "checkable": len(checkable),
            "extractable": len(self.extractable),
            "extractable_share": len(self.extractable) / max(len(checkable), 1),
            "memorized": len(self.memorized),
            "k": self.k,
            "n": self.n,
            "prefixes": list(self.prefixes),
            "memorized_from": self.memorized_from,
            "memorized_per_prefix": self.memorized_per_prefix(),
            # the exact 95% interval of the memorized share: what the count can tell apart
            "memorized_interval": list(clopper_pearson(len(self.memorized), len(checkable))),
            "sampled": self.sampled(),
            # the attacker who changes the prompt, once measured (`other_prompts`)
            "other_prompts": None if self.prompted is None else self.prompted.summary(),
            "seconds": self.seconds,
            "rows_per_second": len(self.rows) / max(self.seconds, 1e-9),
        }

    def headline(self) -> str:
        """One line: what was found, by which rule, from which prompts."""
        s = self.summary()
        rule = f"({self.n},{self.k})-extraction"
        if not self.by_k:
            rule = f"from the shortest prompt of {_listed(self.prefixes)} tokens that extracts"
        line = (
            f"{s['extractable']} of {s['checkable']} rows extractable, {s['memorized']} of them "
            f"not by the reference ({rule}, {s['rows']} rows, {s['seconds']:.1f} s, "
            f"{s['rows_per_second']:.1f} rows/s)"
        )
        low, high = s["memorized_interval"]
        line += f"; memorized {100 * low:.1f}-{100 * high:.1f}% of checkable rows (95%)"
        sampled = s["sampled"]
        if sampled is not None:
            line += (
                f"; sampled from the first k tokens ({sampled['samples']} draws, a chance of "
                f"{sampled['likely']:.0%} or more): {sampled['extractable']} of "
                f"{sampled['rows']} rows at temperature 1 ({sampled['memorized']} not by the "
                f"reference), {sampled['nucleus_extractable']} with top-p {sampled['top_p']:g}"
            )
        if self.prompted is not None:
            line += "; " + self.prompted.headline()
        shorter = {p: c for p, c in s["memorized_per_prefix"].items() if p < self.k}
        if shorter:
            counts = ", ".join(f"{c} from {p}" for p, c in shorter.items())
            line += (
                f"; from prompts shorter than k ({self.n - self.k} tokens after each, windows "
                f"of {min(MIN_WINDOW, self.n - self.k)} or more): {counts}"
            )
        return line

    def table(self, top: int = 20) -> str:
        """A Markdown table of the ``top`` riskiest rows, and the part of each that was scored:
        prompt tokens 0..p-1, window p..p+w-1 (their text's seam when the audit decoded it)."""
        from gss.report import markdown_table

        header = ["row", "extractable", "scored (prompt / window)", "window tokens"]
        header += ["% matched", "longest run", "memorized from prompts of"]
        header += ["omega mean", "omega max", "omega burst", "reference extracts"]
        header += ["text"] if self.texts is not None else []
        body = []
        for r in self.ranked()[:top]:
            verdict = self.is_extractable(r) if self.checkable(r) else None
            prompt, tokens = self.window(r)
            leaked = sorted(set(r.extracted_from) - set(r.reference_extracted_from))
            body.append(
                [
                    self.source(r) or str(self.position(r)),
                    {True: "yes", False: "no", None: "too short"}[verdict],
                    f"0-{prompt - 1} / " + (f"{prompt}-{prompt + tokens - 1}" if tokens else "-"),
                    str(tokens),
                    f"{100 * r.matched:.1f}",
                    str(r.longest_run),
                    ",".join(map(str, leaked)) or "-",
                    f"{r.omega_mean:.2f}",
                    f"{r.omega_max:.2f}",
                    str(r.omega_burst),
                    {True: "yes", False: "no", None: "-"}[r.reference_extractable],
                    *([] if self.texts is None else [self._text_cell(r)]),
                ]
            )
        return markdown_table(header, body)

    def _text_cell(self, row: AuditRow) -> str:
        """The row's text, or where the audit decoded its window, the prompt's end and the
        window's start either side of ``‖``."""
        assert self.texts is not None
        if self.scored_texts is None:
            return _preview(self.texts[row.index])
        prompt, window = self.scored_texts[row.index]
        return _preview(prompt, 24, end=False) + " ‖ " + _preview(window, 36)

    def write(self, directory: str | Path, overwrite: bool = False) -> list[Path]:
        """``audit.jsonl`` (every row), ``audit.md`` (summary and the riskiest rows),
        ``memorized.jsonl`` (the memorized rows' token ids, as `gss evaluate --memorized` reads
        them: extractable from the model, not from the reference) and ``extractable.jsonl``
        (every extractable row's, the reference's too); an earlier audit's files there are
        replaced only with ``overwrite``."""
        check_outputs(directory, OUTPUTS, overwrite)  # "" is refused, not read as "."
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        # each measured row's leaks under other prompts, by variant
        by_row = {} if self.prompted is None else self.prompted.per_row()
        prompted = {index: {"other_prompts": flags} for index, flags in by_row.items()}
        (out / "audit.jsonl").write_text(
            "".join(
                json.dumps({**asdict(r), **self._origin(r), **prompted.get(r.index, {})}) + "\n"
                for r in self.rows
            )
        )
        under = (
            "" if self.prompted is None else "\n## Under other prompts\n\n" + self.prompted.table()
        )
        (out / "audit.md").write_text(self.headline() + "\n\n" + self.table() + under)
        for name, rows in (("memorized", self.memorized), ("extractable", self.extractable)):
            (out / f"{name}.jsonl").write_text(
                "".join(json.dumps({"input_ids": self.ids[r.index]}) + "\n" for r in rows)
            )
        self.plot(out / "audit.png")
        record_outputs(out, OUTPUTS)
        return [out / name for name in OUTPUTS]

    def _origin(self, row: AuditRow) -> dict[str, Any]:
        """Where ``row`` came from, for ``audit.jsonl``: its place among the texts given, its
        file and line when known, and its text when the audit had the tokenizer."""
        prompt, tokens = self.window(row)
        origin: dict[str, Any] = {"row": self.position(row)}
        if self.sources is not None:
            origin["source"] = self.source(row)
        if self.texts is not None:
            origin["text"] = self.texts[row.index]
        # the part scored: prompt tokens 0..prompt_tokens-1, then window_tokens after them
        origin.update(prompt_tokens=prompt, window_tokens=tokens)
        if self.scored_texts is not None:
            origin["prompt_text"], origin["window_text"] = self.scored_texts[row.index]
        return origin

    def plot(self, path: str | Path) -> Path:
        """Two histograms over the rows: the share of the window the model reproduces, and
        the mean omega (the risk score), the memorized rows apart from the others."""
        from gss.report import pyplot, save_figure

        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        groups = {
            "memorized (model extracts, reference does not)": self.memorized,
            "other rows": [r for r in self.rows if not self.is_memorized(r)],
        }
        for ax, (label, value) in zip(
            axes,
            (
                (f"% of tokens {self.k}..{self.n - 1} reproduced", lambda r: 100 * r.matched),
                ("mean omega (nats)", lambda r: r.omega_mean),
            ),
            strict=True,
        ):
            for name, rows in groups.items():
                if rows:
                    ax.hist(
                        [value(r) for r in rows], bins=30, alpha=0.6, label=f"{name}: {len(rows)}"
                    )
            ax.set_xlabel(label)
            ax.set_ylabel("rows")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"gss audit: {len(self.rows)} rows, ({self.n},{self.k})-extraction")
        return save_figure(fig, path)


def check_window(k: int, n: int) -> None:
    """Refuse a window no row can be audited in: k prompt tokens, rows read up to n (the
    check is `gss.Window`'s)."""
    Window(k, n)


def _extracted_from(
    hits: Tensor, length: int, prefixes: Sequence[int], span: int
) -> tuple[int, ...]:
    """The ``prefixes`` from which greedy decoding reproduces the next ``span`` tokens of a row
    of ``length`` (to its end; windows of `MIN_WINDOW` or more, or all of ``span``), read off
    ``hits`` (the teacher-forced argmax equals the next token, position by position)."""
    least = min(MIN_WINDOW, span)
    out = []
    for p in prefixes:
        tokens = min(span, length - p)
        if tokens >= least and bool(hits[p - 1 : p - 1 + tokens].all()):
            out.append(p)
    return tuple(out)


def _longest_run(flags: Tensor) -> int:
    """The most consecutive True values in a 1-d bool tensor."""
    best = run = 0
    for flag in flags.tolist():
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


def audit(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    *,
    tokenizer: Any = None,
    k: int = DEFAULT_WINDOW.k,
    n: int = DEFAULT_WINDOW.n,
    prefixes: Sequence[int] | None = None,
    memorized_from: Literal["k", "shortest"] = "k",
    other_prompts: bool = False,
    batch_size: int | None = None,
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> AuditReport:
    """Which of ``texts`` (the fine-tuning data, in any form `gss.calibrate` takes) the model
    reproduces verbatim, and how much; see the module docstring. Rows are cut to ``n`` tokens.

    ``prefixes``: the prompt lengths each row is also scored from, each followed by a window
    of n - k tokens (k is always scored; None: k, k/2, k/4, ... down to `PREFIX_FLOOR`);
    ``memorized_from``: "k" (the paper's (n, k)) or "shortest" (`AuditReport.memorized_from`).

    ``texts`` may instead be (prompt ids, reply ids) pairs (`gss.data.encode_replies` makes
    them from chats): a pair is extractable when greedy decoding from its whole prompt
    reproduces the first ``n - k`` tokens of its reply, the reply given the conversation; its
    prompt is the conversation, so ``prefixes`` are not scored.

    ``other_prompts``: also measure the memorized rows under other prompts, by the model and
    the reference (`AuditReport.other_prompts`, kept in ``report.prompted``). ``run`` (a
    `gss.RunOptions`; or ``batch_size``, ``progress``): how the passes run, as in
    `gss.calibrate` (default: `RunOptions`')."""
    scored = check_prefixes(prefixes, k, n, memorized_from)
    opts = run_options(run, batch_size, progress)  # checked before any pass
    vocab = check_same_vocab(model, reference, tokenizer)
    warn_if_foreign_tokenizer(model, tokenizer)
    seqs, starts, positions = _audited_rows(model, reference, texts, tokenizer, k, n)
    if starts is not None:  # (prompt, reply) pairs: the prompt is the conversation
        scored = ()
    check_sequences((model, reference), seqs, "the texts")
    if all(len(s) <= (k if starts is None else starts[i]) for i, s in enumerate(seqs)):
        warnings.warn(
            f"no row has more than its prompt's tokens (k = {k}): nothing could be checked. "
            "Lower k (--k) and n (--n) to what the rows hold.",
            GSSWarning,
            stacklevel=2,
        )
    started = time.perf_counter()
    found = _scored_rows(
        model, reference, seqs, starts, vocab, k, n, scored, opts.batch_size, opts.progress
    )
    rows = [found[i] for i in range(len(seqs))]
    report = AuditReport(
        rows=rows,
        starts=starts,
        k=k,
        n=n,
        seconds=time.perf_counter() - started,
        ids=[[int(t) for t in s] for s in seqs],
        positions=positions,
        texts=_decoded(tokenizer, seqs),
        prefixes=scored,
        memorized_from=memorized_from,
    )
    report.scored_texts = _scored_texts(report, tokenizer)
    if other_prompts:
        report.other_prompts(model, tokenizer, reference, run=opts)
    return report


def _scored_rows(
    model: nn.Module,
    reference: nn.Module,
    seqs: list[list[int]],
    starts: list[int] | None,
    vocab: int | None,
    k: int,
    n: int,
    scored: Sequence[int],
    batch_size: int,
    progress: bool,
) -> dict[int, AuditRow]:
    """Each row's `AuditRow`, by index, from one teacher-forced pass of both models over the
    rows; refused when omega is 0 on every token (the reference is the model itself)."""
    found: dict[int, AuditRow] = {}
    differs, tokens = False, 0  # omega != 0 on some token: the reference is another model
    with calibration_mode(model, reference), torch.no_grad():
        for batch in tqdm(
            batches(seqs, batch_size),
            total=count_batches(len(seqs), batch_size),
            desc="gss: audit",
            disable=not progress,
            leave=False,
        ):
            scores = _BatchScores.of(model, reference, batch.input_ids, batch.attention_mask, vocab)
            differs = differs or bool((scores.omega[scores.valid] != 0).any())
            tokens += int(scores.valid.sum())
            for j, index in enumerate(batch.index.tolist()):
                start = k if starts is None else starts[index]  # the window's first token
                found[index] = scores.row(j, index, start, scored, n - k)
    if tokens and not differs:
        raise same_model_error(tokens, "audited")
    return found


def _audited_rows(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    tokenizer: Any,
    k: int,
    n: int,
) -> tuple[list[list[int]], list[int] | None, list[int] | None]:
    """The rows `audit` reads, as token ids, with each pair's prompt length (None for rows,
    whose prompt is their first k tokens) and where the rows kept came from in ``texts``
    (None when every row was kept). Refuses an empty pair and a window past a model's
    context before anything runs."""
    if isinstance(texts, Sequence) and texts and all(is_pair(r) for r in texts):
        pairs = [([int(t) for t in p], [int(t) for t in c]) for p, c in cast(Any, texts)]
        if any(not p or not c for p, c in pairs):
            raise GSSError("every (prompt, reply) pair needs a non-empty prompt and reply.")
        return [p + c[: n - k] for p, c in pairs], [len(p) for p, _ in pairs], None
    sides = (("model", model), ("reference", reference))
    contexts = [(c[0], who) for who, m in sides if (c := context_length(m))]
    if contexts and n > min(contexts)[0]:  # rows are cut to n: n is what must fit
        limit, who = min(contexts)
        raise GSSError(
            f"n = {n} passes the {who}'s context ({limit} positions): lower n (--n) to "
            f"{limit} or less."
        )
    given = encode_every(texts, tokenizer, n)
    seqs = predictable(given)  # rows under 2 tokens have nothing to check
    kept = [i for i, s in enumerate(given) if len(s) >= 2]
    return seqs, None, kept if len(kept) < len(given) else None


@dataclass
class _BatchScores:
    """One batch read by both models, teacher-forced: what each of its rows' `AuditRow` is
    measured from."""

    ids: Tensor
    mask: Tensor
    logits: Tensor
    ref_logits: Tensor
    hits: Tensor  # (B, T-1): the model's argmax is the next token
    ref_hits: Tensor  # the same for the reference
    omega: Tensor  # (B, T-1) float32 on the CPU: log p_model - log p_ref
    valid: Tensor  # (B, T-1) on the CPU: real targets, not padding

    @classmethod
    def of(
        cls, model: nn.Module, reference: nn.Module, ids: Tensor, mask: Tensor, vocab: int | None
    ) -> _BatchScores:
        """Both models' forwards over one batch; a non-finite log-probability is refused (else
        nothing would look memorized)."""
        logits = forward_logits(model, ids, mask)
        hits = logits[:, :-1].argmax(-1).cpu() == ids[:, 1:].cpu()  # (B, T-1)
        omega = token_logprobs(logits, ids, vocab).float().cpu()
        ref_logits = forward_logits(reference, ids, mask)
        ref_hits = ref_logits[:, :-1].argmax(-1).cpu() == ids[:, 1:].cpu()
        ref_lp = token_logprobs(ref_logits, ids, vocab).float().cpu()
        valid = target_mask(mask).cpu()
        for name, lp in (("model", omega), ("reference", ref_lp)):
            if not bool(torch.isfinite(lp[valid]).all()):  # else nothing looks memorized
                raise nonfinite_error(name, "audited")
        omega -= ref_lp
        return cls(ids, mask, logits, ref_logits, hits, ref_hits, omega, valid)

    def row(self, j: int, index: int, start: int, scored: Sequence[int], span: int) -> AuditRow:
        """Row ``j`` of the batch (row ``index`` of the audit), its window from ``start``."""
        length = int(self.mask[j].sum())
        row_hits = self.hits[j, : length - 1]
        row_omega = self.omega[j][self.valid[j]]
        window = row_hits[start - 1 : length - 1]  # predictions of tokens start..
        ref_hits = self.ref_hits[j, : length - 1]
        return AuditRow(
            index=index,
            tokens=length,
            extractable=bool(window.all()) if length > start else None,
            matched=float(window.float().mean()) if length > start else 0.0,
            longest_run=_longest_run(row_hits),
            omega_mean=float(row_omega.mean()) if row_omega.numel() else 0.0,
            omega_max=float(row_omega.max()) if row_omega.numel() else 0.0,
            omega_burst=_longest_run(row_omega > 0),
            reference_extractable=(
                bool(self.ref_hits[j, start - 1 : length - 1].all()) if length > start else None
            ),
            extracted_from=_extracted_from(row_hits, length, scored, span),
            reference_extracted_from=_extracted_from(ref_hits, length, scored, span),
            **_sampled(
                self.logits[j : j + 1],
                self.ref_logits[j : j + 1],
                self.ids[j : j + 1],
                start,
                length,
            ),
        )


def _sampled(
    logits: Tensor, ref_logits: Tensor, ids: Tensor, start: int, length: int
) -> dict[str, float | None]:
    """One row's `AuditRow` sampled fields: its window ``start..length-1``, teacher-forced."""
    if length <= start:
        return {}
    return {
        "sampled_logprob": float(window_logprobs(logits, ids, start, length)[0]),
        "nucleus_logprob": float(window_logprobs(logits, ids, start, length, TOP_P)[0]),
        "reference_sampled_logprob": float(window_logprobs(ref_logits, ids, start, length)[0]),
    }


def _decoded(tokenizer: Any, seqs: list[list[int]]) -> list[str] | None:
    """Each row's text, for the report to show (None without a tokenizer that decodes)."""
    decode = getattr(tokenizer, "batch_decode", None)
    return None if decode is None else list(decode(seqs, skip_special_tokens=True))


def _scored_texts(report: AuditReport, tokenizer: Any) -> list[tuple[str, str]] | None:
    """Each row's scored prompt and window (`AuditReport.window`), decoded."""
    parts = []
    for row in report.rows:
        prompt, tokens = report.window(row)
        ids = report.ids[row.index]
        parts += [ids[:prompt], ids[prompt : prompt + tokens]]
    decoded = _decoded(tokenizer, parts)
    return None if decoded is None else list(zip(decoded[::2], decoded[1::2], strict=True))


def _listed(values: Sequence[int]) -> str:
    """1, 2 and 3."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _preview(text: str, width: int = 60, end: bool = True) -> str:
    """``text`` on one line, for a Markdown table cell: at most ``width`` characters, its
    start (``end``: cut at the end) or its end."""
    one_line = " ".join(text.split()).replace("|", "\\|")
    if len(one_line) <= width:
        return one_line
    return one_line[: width - 1] + "…" if end else "…" + one_line[1 - width :]


__all__: Sequence[str] = ("AuditReport", "AuditRow", "audit", "check_prefixes", "default_prefixes")
