"""Gate thresholds: a rule read off the probe responses of general tokens.

Each direction's gate opens above a percentile of its |response| on general tokens (the
paper's 95th), or all K share one level chosen so that their union opens on a given share of
them. The responses come from a uniform sample of fixed size, so the memory a threshold needs
does not grow with the corpus.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss import distributed
from gss.artifact.steering_artifact import SteeringArtifact, require_artifact
from gss.config import CalibrationConfig, RunOptions, run_options
from gss.data import TextsOrIds, batches, count_batches, encode
from gss.errors import GSSError
from gss.hf.blocks import resolve_layer
from gss.hf.forward import check_sequences, target_mask
from gss.solve.condition import condition_threshold, with_condition
from gss.statistics.capture import calibration_mode, layer_activations
from gss.steering.attach import warn_if_steered


@dataclass
class ThresholdSample:
    """A uniform random sample of at most ``cap`` rows (rows with the smallest random keys)."""

    cap: int
    generator: torch.Generator
    rows: Tensor | None = None
    keys: Tensor | None = None
    seen: int = 0

    def add(self, rows: Tensor) -> None:
        rows = rows.detach().float().cpu()
        self.seen += rows.shape[0]
        keys = torch.rand(rows.shape[0], generator=self.generator)
        if self.rows is not None and self.keys is not None:
            rows = torch.cat([self.rows, rows])
            keys = torch.cat([self.keys, keys])
        self.rows, self.keys = self._capped(rows, keys)

    def _capped(self, rows: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        if rows.shape[0] <= self.cap:
            return rows, keys
        keep = torch.topk(keys, self.cap, largest=False).indices
        return rows[keep], keys[keep]

    def gathered(self, width: int) -> Tensor:
        """Every rank's rows together (under torchrun), capped over all of them: the rows
        with the smallest keys of any rank. One process: its own rows (``width`` columns)."""
        rows = self.rows if self.rows is not None else torch.zeros(0, width)
        keys = self.keys if self.keys is not None else torch.zeros(0)
        if not distributed.is_distributed():
            return rows
        rows, keys = distributed.gather_rows(rows), distributed.gather_rows(keys[:, None])[:, 0]
        return self._capped(rows, keys)[0]


def thresholds_from_responses(
    responses: Tensor,
    gate: str = "hard",
    percentile: float | None = CalibrationConfig.threshold_percentile,
    gate_share: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """Gate thresholds from probe responses (N, K) of general tokens.

    Either each direction's ``percentile`` of |s_k| (s_k for the one-sided ReLU gate), or one
    common percentile chosen so that the *union* of the K gates opens on ``gate_share`` of the
    tokens. Returns the thresholds and the measured open shares.
    """
    if responses.ndim != 2 or responses.shape[0] == 0:
        raise GSSError("no probe responses on general tokens: cannot set gate thresholds.")
    values = responses.abs() if gate != "relu" else responses
    values = values.double()

    def at(level: float) -> Tensor:
        # the one-sided gate opens on s > eps: a direction whose responses are mostly negative
        # would put its percentile below 0 and open on negative responses; 0 is its floor
        return torch.quantile(values, level, dim=0).clamp(min=0.0)

    def union_share(eps: Tensor) -> float:
        return float((values > eps).any(-1).double().mean())

    if gate_share is not None:
        if not 0 < gate_share < 1:
            raise GSSError(f"gate_share must be in (0, 1), got {gate_share}.")
        lo, hi = 0.0, 1.0  # union share decreases as the level rises
        for _ in range(40):
            mid = (lo + hi) / 2
            if union_share(at(mid)) > gate_share:
                lo = mid
            else:
                hi = mid
        eps = at(hi)
        rule: dict[str, Any] = {"kind": "gate_share", "target": gate_share, "level": hi * 100}
    else:
        if percentile is None or not 0 < percentile < 100:
            raise GSSError(f"threshold_percentile must be in (0, 100), got {percentile}.")
        eps = at(percentile / 100)
        rule = {"kind": "percentile", "percentile": percentile}
    shares = {
        "per_direction": (values > eps).double().mean(0).tolist(),
        "union": union_share(eps),
        "tokens": int(values.shape[0]),
    }
    return eps.float(), {"rule": rule, "open_share": shares}


def gate_levels(
    responses: Tensor,
    rank: int,
    gate: str,
    condition: bool,
    percentile: float | None,
    gate_share: float | None,
) -> tuple[Tensor, float | None, dict[str, Any]]:
    """The K thresholds and, with ``condition`` (its response the last column of
    ``responses``), the discriminant gate's level, by one rule; and what they open on.

    A discriminant gate keeps the hard gate's thresholds as well, so that the same artifact
    can be attached with either."""
    eps, info = thresholds_from_responses(
        responses[:, :rank], "hard" if gate == "discriminant" else gate, percentile, gate_share
    )
    if not condition:
        return eps, None, info
    level, shares = condition_threshold(responses[:, -1], percentile, gate_share)
    if gate == "discriminant":
        info = {"rule": {**info["rule"], "condition": level}, "open_share": shares}
    return eps, level, info


def with_gates_set(
    artifact: SteeringArtifact,
    responses: Tensor,
    percentile: float | None,
    gate_share: float | None = None,
) -> SteeringArtifact:
    """``artifact`` with its gates set on ``responses`` (`probe_responses` of general text)."""
    eps, level, info = gate_levels(
        responses,
        artifact.rank,
        artifact.config.gate,
        artifact.condition is not None,
        percentile,
        gate_share,
    )
    return artifact.with_thresholds(eps, info["rule"], info["open_share"], level)


def probe_responses(
    model: nn.Module,
    artifact: SteeringArtifact,
    texts: TextsOrIds,
    *,
    tokenizer: Any | None = None,
    batch_size: int = RunOptions.batch_size,
    max_length: int | None = None,
    progress: bool = False,
) -> Tensor:
    """Probe responses ``U h - offset`` (N, K) on every real next-token position of ``texts``;
    for an artifact with a condition direction w (the discriminant gate's), ``w . h`` as one
    column more."""
    _, block = resolve_layer(model, artifact.layer, artifact.config.block_path)
    readers, offset = with_condition(artifact.probe, artifact.offset, artifact.condition)
    seqs = encode(texts, tokenizer, max_length)
    check_sequences((model,), seqs, "the texts")
    out = []
    with calibration_mode(model):
        for batch in tqdm(
            batches(seqs, batch_size),
            total=count_batches(len(seqs), batch_size),
            disable=not progress,
            desc="gss: probe responses",
            leave=False,
        ):
            hidden = layer_activations(model, block, batch)
            mask = target_mask(batch.attention_mask).to(hidden.device)
            rows = hidden[:, :-1][mask].float()
            out.append(rows @ readers.to(rows.device).T - offset.to(rows.device))
    return torch.cat(out).cpu()


def calibrate_thresholds(
    model: nn.Module,
    artifact: SteeringArtifact,
    texts: TextsOrIds,
    *,
    threshold_percentile: float | None = CalibrationConfig.threshold_percentile,
    gate_share: float | None = None,
    tokenizer: Any | None = None,
    batch_size: int | None = None,
    max_length: int | None = None,
    progress: bool | None = None,
    run: RunOptions | None = None,
) -> SteeringArtifact:
    """Re-set an artifact's gate thresholds from held-out (general) text. ``run`` (a
    `gss.RunOptions`; or ``batch_size``, ``progress``): default `RunOptions.batch_size` rows a
    batch, no progress bar."""
    # the rule, the run options and the model are checked before the pass over the text
    require_artifact(artifact, "calibrate_thresholds")
    opts = run_options(run, batch_size, progress, progress_default=False)
    if gate_share is None and threshold_percentile is None:
        raise GSSError("give threshold_percentile (e.g. 95) or gate_share (e.g. 0.05).")
    default = CalibrationConfig.threshold_percentile
    if gate_share is not None and threshold_percentile not in (None, default):
        raise GSSError(
            f"gate_share replaces threshold_percentile's rule, and both were given "
            f"({gate_share}, {threshold_percentile}): keep one."
        )
    percentile = artifact.config.threshold_percentile
    artifact.config.replace(
        threshold_percentile=percentile if threshold_percentile is None else threshold_percentile,
        gate_share=gate_share,
    )
    artifact.check_model(model)
    block = resolve_layer(model, artifact.layer, artifact.config.block_path)[1]
    warn_if_steered(block, "setting thresholds")
    responses = probe_responses(
        model,
        artifact,
        texts,
        tokenizer=tokenizer,
        batch_size=opts.batch_size,
        max_length=max_length,
        progress=opts.progress,
    )
    return with_gates_set(artifact, responses, threshold_percentile, gate_share)


__all__: Sequence[str] = (
    "ThresholdSample",
    "calibrate_thresholds",
    "probe_responses",
    "thresholds_from_responses",
    "with_gates_set",
)
