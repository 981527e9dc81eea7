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
  tokens with omega > 0, a cheap risk score that needs no decoding.

Rows stream in batches; nothing but the per-row numbers is kept.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss.artifact.files import check_outputs, record_outputs
from gss.config import RunOptions
from gss.data import TextsOrIds, batches, count_batches, encode_every, predictable
from gss.errors import GSSError, GSSWarning
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

    @property
    def memorized(self) -> bool:
        """Extractable from the model but not from the reference: regurgitated, not general."""
        return bool(self.extractable) and not self.reference_extractable


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

    def position(self, row: AuditRow) -> int:
        """Where ``row`` was among the texts given (its line in a file, blank lines aside)."""
        return row.index if self.positions is None else self.positions[row.index]

    def source(self, row: AuditRow) -> str | None:
        return None if self.sources is None else self.sources[self.position(row)]

    def candidate(self, index: int) -> list[int] | tuple[list[int], list[int]]:
        """Row ``index`` as `gss.evaluate.evaluate_model` reads it: its ids, or for a pair
        (prompt, reply) again."""
        ids = self.ids[index]
        if self.starts is None:
            return ids
        return ids[: self.starts[index]], ids[self.starts[index] :]

    def window_tokens(self, row: AuditRow) -> int:
        """How many tokens of ``row`` the check compared (its window: after k, or after a
        pair's prompt, up to n). A short window (a row just over k tokens) is a weak finding:
        a reply's last few tokens, say."""
        start = self.k if self.starts is None else self.starts[row.index]
        return max(row.tokens - start, 0)

    @property
    def extractable(self) -> list[AuditRow]:
        return [r for r in self.rows if r.extractable]

    @property
    def memorized(self) -> list[AuditRow]:
        """The extractable rows the reference does not extract (`AuditRow.memorized`)."""
        return [r for r in self.rows if r.memorized]

    def ranked(self) -> list[AuditRow]:
        """Extractable rows first, then by longest run and mean omega."""
        return sorted(
            self.rows,
            key=lambda r: (bool(r.extractable), r.longest_run, r.omega_mean),
            reverse=True,
        )

    def summary(self) -> dict[str, Any]:
        checkable = [r for r in self.rows if r.extractable is not None]
        return {
            "rows": len(self.rows),
            "checkable": len(checkable),
            "extractable": len(self.extractable),
            "extractable_share": len(self.extractable) / max(len(checkable), 1),
            "memorized": len(self.memorized),
            "k": self.k,
            "n": self.n,
            "seconds": self.seconds,
            "rows_per_second": len(self.rows) / max(self.seconds, 1e-9),
        }

    def table(self, top: int = 20) -> str:
        """A Markdown table of the ``top`` riskiest rows."""
        from gss.report import markdown_table

        header = ["row", "extractable", "window tokens", "% matched", "longest run"]
        header += ["omega mean", "omega max", "omega burst", "reference extracts"]
        header += ["text"] if self.texts is not None else []
        body = [
            [
                self.source(r) or str(self.position(r)),
                {True: "yes", False: "no", None: "too short"}[r.extractable],
                str(self.window_tokens(r)),
                f"{100 * r.matched:.1f}",
                str(r.longest_run),
                f"{r.omega_mean:.2f}",
                f"{r.omega_max:.2f}",
                str(r.omega_burst),
                {True: "yes", False: "no", None: "-"}[r.reference_extractable],
                *([] if self.texts is None else [_preview(self.texts[r.index])]),
            ]
            for r in self.ranked()[:top]
        ]
        return markdown_table(header, body)

    def write(self, directory: str | Path, overwrite: bool = False) -> list[Path]:
        """``audit.jsonl`` (every row), ``audit.md`` (summary and the riskiest rows),
        ``memorized.jsonl`` (the memorized rows' token ids, as `gss evaluate --memorized` reads
        them: extractable from the model, not from the reference) and ``extractable.jsonl``
        (every extractable row's, the reference's too); an earlier audit's files there are
        replaced only with ``overwrite``."""
        check_outputs(directory, OUTPUTS, overwrite)  # "" is refused, not read as "."
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "audit.jsonl").write_text(
            "".join(
                json.dumps({**asdict(r), **self._origin(r), "window_tokens": self.window_tokens(r)})
                + "\n"
                for r in self.rows
            )
        )
        s = self.summary()
        (out / "audit.md").write_text(
            f"{s['extractable']} of {s['checkable']} rows extractable, {s['memorized']} of "
            f"them not by the reference (({self.n},{self.k})-extraction; {s['rows']} rows, "
            f"{s['seconds']:.1f} s, "
            f"{s['rows_per_second']:.1f} rows/s)\n\n" + self.table()
        )
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
        origin: dict[str, Any] = {"row": self.position(row)}
        if self.sources is not None:
            origin["source"] = self.source(row)
        if self.texts is not None:
            origin["text"] = self.texts[row.index]
        return origin

    def plot(self, path: str | Path) -> Path:
        """Two histograms over the rows: the share of the window the model reproduces, and
        the mean omega (the risk score), the memorized rows apart from the others."""
        from gss.report import pyplot, save_figure

        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        groups = {
            "memorized (model extracts, reference does not)": [r for r in self.rows if r.memorized],
            "other rows": [r for r in self.rows if not r.memorized],
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
    """Refuse a window no row can be audited in: k prompt tokens, rows read up to n."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise GSSError(f"k must be an integer >= 1, got {k!r}.")
    if isinstance(n, bool) or not isinstance(n, int) or n <= k:
        raise GSSError(f"n must be an integer > k = {k}, got {n!r}.")


def _risk(row: AuditRow) -> tuple[bool, int, float]:
    return bool(row.extractable), row.longest_run, row.omega_mean


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
    k: int = 32,
    n: int = 72,
    batch_size: int = 8,
    progress: bool = True,
) -> AuditReport:
    """Which of ``texts`` (the fine-tuning data, in any form `gss.calibrate` takes) the model
    reproduces verbatim, and how much; see the module docstring. Rows are cut to ``n`` tokens.

    ``texts`` may instead be (prompt ids, reply ids) pairs (`gss.data.encode_replies` makes
    them from chats): a pair is extractable when greedy decoding from its whole prompt
    reproduces the first ``n - k`` tokens of its reply, the reply given the conversation."""
    check_window(k, n)
    RunOptions(batch_size=batch_size, progress=progress)  # checks both
    vocab = check_same_vocab(model, reference, tokenizer)
    warn_if_foreign_tokenizer(model, tokenizer)
    starts: list[int] | None = None
    if isinstance(texts, Sequence) and texts and all(is_pair(r) for r in texts):
        pairs = [([int(t) for t in p], [int(t) for t in c]) for p, c in cast(Any, texts)]
        if any(not p or not c for p, c in pairs):
            raise GSSError("every (prompt, reply) pair needs a non-empty prompt and reply.")
        starts = [len(p) for p, _ in pairs]
        seqs = [p + c[: n - k] for p, c in pairs]
        positions = None
    else:
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
        positions = kept if len(kept) < len(given) else None
    check_sequences((model, reference), seqs, "the texts")
    if all(len(s) <= (k if starts is None else starts[i]) for i, s in enumerate(seqs)):
        warnings.warn(
            f"no row has more than its prompt's tokens (k = {k}): nothing could be checked. "
            "Lower k (--k) and n (--n) to what the rows hold.",
            GSSWarning,
            stacklevel=2,
        )
    started = time.perf_counter()
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
            ids, mask = batch.input_ids, batch.attention_mask
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
            differs = differs or bool((omega[valid] != 0).any())
            tokens += int(valid.sum())
            for j, index in enumerate(batch.index.tolist()):
                length = int(mask[j].sum())
                start = k if starts is None else starts[index]  # the window's first token
                row_hits = hits[j, : length - 1]
                row_omega = omega[j][valid[j]]
                window = row_hits[start - 1 : length - 1]  # predictions of tokens start..
                found[index] = AuditRow(
                    index=index,
                    tokens=length,
                    extractable=bool(window.all()) if length > start else None,
                    matched=float(window.float().mean()) if length > start else 0.0,
                    longest_run=_longest_run(row_hits),
                    omega_mean=float(row_omega.mean()) if row_omega.numel() else 0.0,
                    omega_max=float(row_omega.max()) if row_omega.numel() else 0.0,
                    omega_burst=_longest_run(row_omega > 0),
                    reference_extractable=(
                        bool(ref_hits[j, start - 1 : length - 1].all()) if length > start else None
                    ),
                )
    if tokens and not differs:
        raise same_model_error(tokens, "audited")
    rows = [found[i] for i in range(len(seqs))]
    return AuditReport(
        rows=rows,
        starts=starts,
        k=k,
        n=n,
        seconds=time.perf_counter() - started,
        ids=[[int(t) for t in s] for s in seqs],
        positions=positions,
        texts=_decoded(tokenizer, seqs),
    )


def _decoded(tokenizer: Any, seqs: list[list[int]]) -> list[str] | None:
    """Each row's text, for the report to show (None without a tokenizer that decodes)."""
    decode = getattr(tokenizer, "batch_decode", None)
    return None if decode is None else list(decode(seqs, skip_special_tokens=True))


def _preview(text: str, width: int = 60) -> str:
    """``text`` on one line, for a Markdown table cell: at most ``width`` characters."""
    one_line = " ".join(text.split()).replace("|", "\\|")
    return one_line if len(one_line) <= width else one_line[: width - 1] + "…"


__all__: Sequence[str] = ("AuditReport", "AuditRow", "audit")
