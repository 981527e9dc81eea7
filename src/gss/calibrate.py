"""Calibration: text -> statistics -> probe/steer solve -> gate thresholds -> artifact.

`collect_statistics` (`gss.statistics.collect`) makes one pass over the text; `build_artifact`
solves for the directions (`gss.solve.whitened`), sets the thresholds from general tokens
(`gss.solve.thresholds`, from the hidden states the pass kept or a second, partial forward
stopped after the block) and records what was measured. `calibrate` is the two in one call.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss import distributed
from gss.artifact.fingerprint import model_fingerprint
from gss.artifact.steering_artifact import Provenance, SteeringArtifact
from gss.config import DEFAULT_PRESET, CalibrationConfig, RunOptions, resolve
from gss.data import TextsOrIds
from gss.errors import GSSError, GSSWarning
from gss.hf.blocks import resolve_layer
from gss.solve.condition import condition_direction, with_condition
from gss.solve.thresholds import ThresholdSample, gate_levels
from gss.solve.whitened import ProbeSteer, solve_probe_steer
from gss.statistics import soundness
from gss.statistics.capture import calibration_mode, layer_activations
from gss.statistics.collect import (
    COLLECT_FIELDS,
    CalibrationStatistics,
    collect,
    same_model_error,
)


def calibrate(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    config: CalibrationConfig | str = DEFAULT_PRESET,
    *,
    tokenizer: Any = None,
    gen_texts: TextsOrIds | None = None,
    run: RunOptions | None = None,
    **overrides: Any,
) -> SteeringArtifact:
    """Calibrate Gated Subspace Steering for ``model`` at one decoder block.

    Args:
        model: the fine-tuned causal LM whose memorization is to be removed.
        reference: a model with the same tokenizer that did not see the fine-tuning data
            (e.g. the base model); omega = log p_model - log p_ref per token.
        texts: calibration text (strings with ``tokenizer``, conversations, dataset rows, or
            token id lists / a tensor / rows with ``input_ids``), usually including the data
            the model may have memorized. Rows with ``labels`` say which tokens the fine-tune
            was trained on (-100: not): only those can be memorized.
        config: a `gss.CalibrationConfig`, or a preset's name: ``"gss-tr"`` (ours, the
            default: it measured best on every benchmark) or ``"gss"`` (the paper's method;
            `gss.config.PRESETS`).
        tokenizer: turns string texts into tokens.
        gen_texts: held-out text for Sigma_gen and the thresholds (as in the paper's
            experiments); default: the calibration tokens not marked memorized.
        run: how the pass runs, not what it computes (a `gss.RunOptions`: ``batch_size``,
            ``progress``, ``keep_general``); its fields may instead be given as keywords.
        **overrides: fields of the config (``layer=2, rank=8, ...``: see
            `gss.CalibrationConfig` for each one's meaning and default) and run options that do
            not change the result (``batch_size``, ``progress``, ``keep_general``:
            `gss.config.RunOptions`; one that contradicts ``run`` is refused). ``layer`` has
            no default: `gss.scan_layers` picks one.

    Every option is checked before any pass over the data. The artifact holds the config
    (with the layer resolved to an index) and, apart, what calibration measured
    (``artifact.provenance``).
    """
    cfg, options = resolve(config, overrides, run)
    if gen_texts is not None and _same_rows(gen_texts, texts):
        warnings.warn(  # as gss calibrate says where --gen-data is --data
            "gen_texts is texts: the general statistics and the gates would be set on the very "
            "text whose memorized tokens the steer must act on, so the gates learn to stay "
            "closed there. Give text the fine-tune was not tuned on, or leave gen_texts out.",
            GSSWarning,
            stacklevel=2,
        )
    stats = collect(model, reference, texts, cfg, options, tokenizer, gen_texts)
    return _build(model, stats, cfg.replace(layer=stats.layer), options.progress)


def _same_rows(a: Any, b: Any) -> bool:
    """Whether two inputs of `calibrate` are the same rows: the same object, equal tensors, or
    equal lists (a dataset is compared by identity only)."""
    if a is b:
        return True
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        try:
            return bool(a == b) if type(a) is type(b) else list(a) == list(b)
        except (RuntimeError, ValueError):  # rows of tensors: no one truth value
            return False
    return False


def build_artifact(
    model: nn.Module,
    stats: CalibrationStatistics,
    config: CalibrationConfig | str | None = None,
    run: RunOptions | None = None,
    **overrides: Any,
) -> SteeringArtifact:
    """Solve for the probes and steers from ``stats`` and set the gate thresholds.

    The config is the one ``stats`` was collected with unless given; ``overrides`` change
    what the pass did not fix (rank, delta, the threshold rule, gate, coefficient, centering,
    the solve) and ``progress`` (or ``run``). Fields the pass fixed (`COLLECT_FIELDS`) must not
    differ.
    """
    base = stats.config if config is None else config
    cfg, options = resolve(base, overrides, run)
    layer = stats.layer if cfg.layer is None else cfg.layer
    if resolve_layer(model, layer, cfg.block_path)[0] == stats.layer:
        layer = stats.layer  # the same block, perhaps counted from the end
    cfg = cfg.replace(layer=layer)
    fixed = [name for name in COLLECT_FIELDS if getattr(cfg, name) != getattr(stats.config, name)]
    if fixed:
        raise GSSError(
            f"the statistics were collected with other {', '.join(fixed)} than this config "
            "asks for: collect them again with these options, or leave them out here."
        )
    return _build(model, stats, cfg, options.progress)


def _build(
    model: nn.Module, stats: CalibrationStatistics, cfg: CalibrationConfig, progress: bool
) -> SteeringArtifact:
    """The artifact of ``stats`` under ``cfg``: the solve, the thresholds and what both
    measured (the soundness warnings are said from here, for the caller of `calibrate`)."""
    rank, delta, centering, seed = cfg.rank, cfg.delta, cfg.centering, cfg.seed
    _check_counts(stats.counts, stats.memorization.count, rank)
    _, block = resolve_layer(model, stats.layer, stats.block_path)
    timings = dict(stats.timings)
    t0 = time.perf_counter()
    sigma_acc = stats.sigma
    sigma = sigma_acc.second_moment if centering == "none" else sigma_acc.covariance
    solution = solve_probe_steer(
        stats.memorization.value,
        sigma,
        rank,
        delta,
        jitter=cfg.jitter,
        method=cfg.solve_method,
        seed=seed,
    )
    probe, steer, singular_values = distributed.broadcast_tensors(
        solution.probe.float(), solution.steer.float(), solution.singular_values
    )
    facts = soundness.evidence(
        stats.counts,
        sigma_acc.count,
        stats.memorization.count,
        sigma.shape[0],
        singular_values.tolist(),
        solution.jitter,
        general_from_calibration=stats.gen_seqs is None,
    )
    facts["warnings"] = soundness.warn_about(facts, rank, stacklevel=3)
    offset, condition = _offset_and_condition(stats, cfg, probe, sigma.device)
    readers, shift = with_condition(probe.to(sigma.device), offset, condition)
    timings["solve"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    samples = _threshold_samples(model, block, stats, cfg, readers, shift, progress)
    thresholds, level, info = gate_levels(
        samples, rank, cfg.gate, condition is not None, cfg.threshold_percentile, cfg.gate_share
    )
    timings["thresholds"] = time.perf_counter() - t0
    timings["total"] = sum(timings[k] for k in ("signal", "statistics", "solve", "thresholds"))
    return SteeringArtifact(
        probe=probe.cpu(),
        steer=steer.cpu(),
        thresholds=thresholds.cpu(),
        offset=offset.float().cpu(),
        singular_values=singular_values.cpu(),
        config=cfg,
        provenance=_provenance(model, stats, timings, samples, info, solution, facts),
        condition=None if condition is None else condition.float().cpu(),
        condition_threshold=level,
    )


def _offset_and_condition(
    stats: CalibrationStatistics, cfg: CalibrationConfig, probe: Tensor, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """The probes' offsets (``U mu`` for centred probes, else zeros) and, for the
    discriminant gate, its condition direction, on ``device``."""
    sigma_acc = stats.sigma
    mean = sigma_acc.mean.float()
    offset = (
        probe.to(device) @ mean if cfg.centering == "full" else torch.zeros(cfg.rank, device=device)
    )
    condition = None
    if cfg.gate == "discriminant":  # read beside the probes: one column more to sample
        condition = condition_direction(sigma_acc.covariance, stats.memorized_mean.mean, mean)
        condition = distributed.broadcast_tensors(condition)[0].to(device)
    return offset, condition


def _threshold_samples(
    model: nn.Module,
    block: nn.Module,
    stats: CalibrationStatistics,
    cfg: CalibrationConfig,
    readers: Tensor,
    shift: Tensor,
    progress: bool,
) -> Tensor:
    """The general tokens' responses the thresholds are set from: from the hidden states the
    pass kept, else a second pass stopped after the block (a capped sample of either)."""
    device = readers.device
    # each rank draws its own keys (rank 0's are one process's), and the cap is applied to all
    # ranks' rows together: a sample of the same size as one process's
    keys = torch.Generator().manual_seed(cfg.seed + 1_000_003 * distributed.rank())
    reservoir = ThresholdSample(cfg.max_threshold_samples, keys)
    kept = stats.general_sample
    if kept is not None:  # every general token's hidden state: no second pass needed
        reservoir.add(torch.cat([part.to(device) @ readers.T for part in kept]) - shift)
    with calibration_mode(model):
        for batch, mask in tqdm(
            () if kept is not None else stats.general_batches(),
            desc="gss: thresholds",
            total=0 if kept is not None else stats.general_batch_count,
            disable=not progress,
            leave=False,
        ):
            hidden = layer_activations(model, block, batch)
            rows = hidden[:, :-1][mask.to(hidden.device)].float().to(device)
            reservoir.add(rows @ readers.T - shift)
    return reservoir.gathered(readers.shape[0])


def _provenance(
    model: nn.Module,
    stats: CalibrationStatistics,
    timings: dict[str, float],
    samples: Tensor,
    info: dict[str, Any],
    solution: ProbeSteer,
    facts: dict[str, Any],
) -> Provenance:
    """What calibration measured, recorded beside the config in the artifact."""
    counts = {
        **stats.counts,
        "threshold_samples": int(samples.shape[0]),
        # False: thresholds from hidden states kept in pass 1
        "threshold_pass": stats.general_sample is None,
    }
    return Provenance(
        fingerprint=model_fingerprint(model, stats.block_path),
        token_counts=counts,
        timings=timings,
        threshold_rule=info["rule"],
        gate_open_share=info["open_share"],
        memorized_rule=stats.memorized_rule,
        solve={
            "method": solution.method,
            "power_iters": solution.power_iters,
            "converged": solution.converged,
        },
        jitter=solution.jitter,
        soundness=facts,
    )


def _check_counts(counts: dict[str, Any], n_mem: int, rank: int) -> None:
    if n_mem == 0 and counts.get("omega_nonzero") == 0:
        raise same_model_error(counts["tokens"])
    if counts.get("trained") == 0:
        raise GSSError(
            f"none of the {counts['tokens']} calibration tokens was trained on (every label is "
            "-100, or no reply survived max_length), so none can be memorized: check the "
            "labels, or raise max_length so that the replies fit."
        )
    if n_mem == 0:
        raise GSSError(
            f"no token of the {counts['tokens']} calibration tokens passed the memorized-token "
            "rule, so there is nothing to steer against. Lower omega_threshold, use "
            "memorized_quantile, include the text the model memorized, or check that the "
            "reference model is not the fine-tuned model itself."
        )
    if counts["general"] < 2:  # a covariance of one token is 0
        which = (
            "every calibration token was"
            if counts["general"] == 0
            else f"all but one of the {counts['tokens']} calibration tokens were"
        )
        raise GSSError(
            f"{which} marked memorized, so Sigma_gen has no data. Raise omega_threshold, "
            "lower memorized_quantile, or pass gen_texts (held-out text)."
        )
    if n_mem < rank:
        raise GSSError(
            f"only {n_mem} memorized tokens for rank {rank}: M has rank < K. Lower the rank or "
            "add memorized text."
        )


__all__: Sequence[str] = ("build_artifact", "calibrate")
