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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss.data import TextsOrIds, batches, count_batches, encode
from gss.errors import GSSError
from gss.hf.forward import (
    check_same_vocab,
    check_sequences,
    forward_logits,
    target_mask,
    token_logprobs,
)
from gss.statistics.capture import calibration_mode


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


@dataclass
class AuditReport:
    """Every row's numbers (in input order), and how the audit was run."""

    rows: list[AuditRow]
    k: int
    n: int
    seconds: float
    ids: list[list[int]] = field(repr=False, default_factory=list)

    @property
    def extractable(self) -> list[AuditRow]:
        return [r for r in self.rows if r.extractable]

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
            "k": self.k,
            "n": self.n,
            "seconds": self.seconds,
            "rows_per_second": len(self.rows) / max(self.seconds, 1e-9),
        }

    def table(self, top: int = 20) -> str:
        """A Markdown table of the ``top`` riskiest rows."""
        from gss.report import markdown_table

        header = ["row", "extractable", "% matched", "longest run", "omega mean", "omega max"]
        header.append("omega burst")
        body = [
            [
                str(r.index),
                {True: "yes", False: "no", None: "too short"}[r.extractable],
                f"{100 * r.matched:.1f}",
                str(r.longest_run),
                f"{r.omega_mean:.2f}",
                f"{r.omega_max:.2f}",
                str(r.omega_burst),
            ]
            for r in self.ranked()[:top]
        ]
        return markdown_table(header, body)

    def write(self, directory: str | Path) -> list[Path]:
        """``audit.jsonl`` (every row), ``audit.md`` (summary and the riskiest rows) and
        ``extractable.jsonl`` (the extractable rows' token ids, as `gss evaluate --memorized`
        reads them)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "audit.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in self.rows))
        s = self.summary()
        (out / "audit.md").write_text(
            f"{s['extractable']} of {s['checkable']} rows extractable "
            f"(({self.n},{self.k})-extraction; {s['rows']} rows, {s['seconds']:.1f} s, "
            f"{s['rows_per_second']:.1f} rows/s)\n\n" + self.table()
        )
        (out / "extractable.jsonl").write_text(
            "".join(json.dumps({"input_ids": self.ids[r.index]}) + "\n" for r in self.extractable)
        )
        return [out / "audit.jsonl", out / "audit.md", out / "extractable.jsonl"]


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
    reproduces verbatim, and how much; see the module docstring. Rows are cut to ``n`` tokens."""
    check_window(k, n)
    check_same_vocab(model, reference)
    seqs = encode(texts, tokenizer, n)
    check_sequences((model, reference), seqs, "the texts")
    started = time.perf_counter()
    found: dict[int, AuditRow] = {}
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
            omega = token_logprobs(logits, ids).float().cpu()
            omega -= token_logprobs(forward_logits(reference, ids, mask), ids).float().cpu()
            valid = target_mask(mask).cpu()
            for j, index in enumerate(batch.index.tolist()):
                length = int(mask[j].sum())
                row_hits = hits[j, : length - 1]
                row_omega = omega[j][valid[j]]
                window = row_hits[k - 1 : length - 1]  # predictions of tokens k..length-1
                found[index] = AuditRow(
                    index=index,
                    tokens=length,
                    extractable=bool(window.all()) if length > k else None,
                    matched=float(window.float().mean()) if length > k else 0.0,
                    longest_run=_longest_run(row_hits),
                    omega_mean=float(row_omega.mean()) if row_omega.numel() else 0.0,
                    omega_max=float(row_omega.max()) if row_omega.numel() else 0.0,
                    omega_burst=_longest_run(row_omega > 0),
                )
    rows = [found[i] for i in range(len(seqs))]
    return AuditReport(
        rows=rows,
        k=k,
        n=n,
        seconds=time.perf_counter() - started,
        ids=[[int(t) for t in s] for s in seqs],
    )


__all__: Sequence[str] = ("AuditReport", "AuditRow", "audit")
