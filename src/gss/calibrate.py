"""Calibration: text -> omega -> (Sigma_gen, M) -> probe/steer solve -> gate thresholds.

One pass over the calibration text runs the reference forward, the model forward with the
layer-L output tapped, and a backward from the objective of the memorized tokens down to that
tap only (the model's weights are frozen, so no weight gradients are computed and nothing
below layer L is differentiated). A second, partial forward (stopped after block L) measures
the probe responses on general tokens to set the thresholds. Statistics stream; activations
are never kept.

Gradient sign: g is the gradient of the *log-likelihood* (``-grad CE``) of the memorized
tokens, so the update ``h - s v`` lowers their likelihood (METHOD-NOTES 2.1). With
``gradient="summed"`` one backward of the summed objective gives each position the gradient
of all later memorized tokens' objectives too (METHOD-NOTES 2.5); at the last block that is
exact, at earlier blocks an approximation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gss import distributed
from gss.artifact.steering_artifact import SteeringArtifact, SteeringConfig, model_fingerprint
from gss.data import Batch, TextsOrIds, batches, count_batches, encode, encode_compact
from gss.errors import GSSError
from gss.hf.blocks import residual_width, resolve_layer
from gss.hf.forward import (
    check_same_vocab,
    check_sequences,
    execution_device,
    forward_logits,
    target_mask,
    token_logprobs,
)
from gss.signal.replies import ReplySignal, warn_if_replies_alone
from gss.signal.tokens import encode_trained, reply_masks, trained_targets
from gss.solve.whitened import SolveMethod, solve_probe_steer
from gss.statistics.accumulators import (
    CovarianceAccumulator,
    CrossMomentAccumulator,
    MeanAccumulator,
)
from gss.statistics.gradients import per_position_gradients
from gss.steering.compiled import refuse_if_compiled
from gss.steering.gated import COEFFICIENT_MODES, GATE_MODES, SteeredForward, split_block_output

CENTERINGS = ("covariance", "full", "none")
TARGETS = ("loglik", "toward-reference")
GRADIENTS = ("summed", "per-position")
# General tokens' probe responses kept (a uniform sample) to set the thresholds: the 95th
# percentile of 65,536 samples has a standard error of 0.09 percentile points, and the
# sample's memory (K floats a row) stays fixed however large the corpus.
THRESHOLD_SAMPLES = 2**16


class _StopForward(Exception):
    """Raised by the tap to end a forward pass once layer L has run."""


class _Tap:
    """Applied to block L's output: records it, optionally as a leaf for gradients, and
    optionally stops the forward pass right there."""

    def __init__(self, stop: bool, leaf: bool) -> None:
        self.stop = stop
        self.leaf = leaf
        self.hidden: Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        hidden, rebuild = split_block_output(output)
        if self.leaf:
            hidden = hidden.detach().requires_grad_(True)
        self.hidden = hidden
        if self.stop:
            raise _StopForward
        return rebuild(hidden) if self.leaf else None


@contextmanager
def _tapped(block: nn.Module, stop: bool, leaf: bool) -> Iterator[_Tap]:
    tap = _Tap(stop=stop, leaf=leaf)
    handle = SteeredForward(block, tap)  # as a steer is attached: compiled code sees it
    try:
        yield tap
    finally:
        handle.remove()


@contextmanager
def _calibration_mode(*models: nn.Module) -> Iterator[None]:
    """Eval mode and frozen weights for the duration; both restored afterwards. Models whose
    compiled code would not run calibration's read of a block are refused first."""
    for m in models:
        refuse_if_compiled(m, reading=True)
    states = [(m, m.training, [(p, p.requires_grad) for p in m.parameters()]) for m in models]
    try:
        for m in models:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        yield
    finally:
        for m, training, params in states:
            m.train(training)
            for p, flag in params:
                p.requires_grad_(flag)


def layer_activations(model: nn.Module, block: nn.Module, batch: Batch) -> Tensor:
    """Output of ``block`` for ``batch``, running the model only up to that block."""
    with torch.no_grad(), _tapped(block, stop=True, leaf=False) as tap, suppress(_StopForward):
        forward_logits(model, batch.input_ids, batch.attention_mask)
    if tap.hidden is None:
        raise GSSError("the hooked block never ran: is it part of this model's forward pass?")
    return tap.hidden


class _GeneralKeeper:
    """Collects general-token hidden states on the host until more than ``cap`` were seen."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: list[Tensor] | None = []
        self.count = 0

    def add(self, rows: Tensor) -> None:
        self.count += rows.shape[0]
        if self.parts is None:
            return
        if self.count > self.cap:
            self.parts = None  # too many: the thresholds will take a second pass
        else:
            self.parts.append(rows.detach().float().cpu())

    def result(self) -> list[Tensor] | None:
        """The kept batches as they came: concatenating them would double the peak memory."""
        if self.parts is None or not self.parts:
            return None
        return self.parts


class GeneralFlags:
    """Which next-token targets were general, for every batch, in one buffer allocated up front.

    The threshold pass needs each batch's general-token mask again. Kept as one small tensor
    per batch, those long-lived allocations sat between the pass's large transient ones and
    pinned glibc's heap: the process grew with the corpus (+15 MB over 1,600 texts of 32
    tokens) from fragmentation alone. One bool per target, allocated once, does not.
    """

    def __init__(self, seqs: Sequence[Tensor]) -> None:
        self.flags = torch.zeros(sum(len(s) - 1 for s in seqs), dtype=torch.bool)
        self.spans: list[tuple[int, int]] = []

    def add(self, general: Tensor, valid: Tensor) -> None:
        """Record one batch, in batch order: ``general`` and ``valid`` are (B, T-1) masks."""
        start = self.spans[-1][1] if self.spans else 0
        end = start + int(valid.sum())
        self.flags[start:end] = general[valid].cpu()
        self.spans.append((start, end))

    def mask(self, index: int, valid: Tensor) -> Tensor:
        """The (B, T-1) general-token mask of batch ``index``, on the CPU."""
        start, end = self.spans[index]
        out = torch.zeros(valid.shape, dtype=torch.bool)
        out[valid.cpu()] = self.flags[start:end]
        return out


@dataclass
class _Reservoir:
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
        if rows.shape[0] > self.cap:
            keep = torch.topk(keys, self.cap, largest=False).indices
            rows, keys = rows[keep], keys[keep]
        self.rows, self.keys = rows, keys


def thresholds_from_responses(
    responses: Tensor,
    gate: str = "hard",
    percentile: float | None = 95.0,
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
        return torch.quantile(values, level, dim=0)

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


def _objective(
    target: str, logits: Tensor, lp_model: Tensor, ref_logits: Tensor | None, mem: Tensor
) -> Tensor:
    """Sum over memorized targets of the quantity whose gradient defines g."""
    if target == "loglik":
        per_token = lp_model
    else:  # toward-reference: log p(x_t) - sum_y p_ref(y) log p(y); logits grad e_x - p_ref
        assert ref_logits is not None
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        p_ref = torch.softmax(ref_logits[:, :-1].float(), dim=-1)
        per_token = lp_model - (p_ref * logp).sum(-1)
    return (per_token * mem).sum()


@dataclass
class CalibrationStatistics:
    """What one calibration pass gathered at one layer: enough to solve for any rank, delta
    and centering, to set thresholds, and to build mean-difference steering."""

    layer: int
    block_path: str | None
    sigma: CovarianceAccumulator
    memorization: CrossMomentAccumulator
    memorized_mean: MeanAccumulator
    counts: dict[str, Any]
    timings: dict[str, float]
    memorized_rule: dict[str, Any]
    target: str
    gradient: str
    batch_size: int
    seqs: list[Tensor]  # token ids, compact (`encode_compact`)
    gen_seqs: list[Tensor] | None
    general_flags: GeneralFlags | None = None  # set when Sigma_gen comes from `seqs` itself
    # every general token's hidden state (float32, CPU) while they fit in `keep_general`, so
    # that the thresholds need no second pass; None once more were seen
    general_sample: list[Tensor] | None = None

    def general_batches(self) -> Iterator[tuple[Batch, Tensor]]:
        """The general tokens, batch by batch, in the order the statistics saw them."""
        if self.gen_seqs is None:
            for b, batch in enumerate(batches(self.seqs, self.batch_size)):
                assert self.general_flags is not None
                yield batch, self.general_flags.mask(b, target_mask(batch.attention_mask))
        else:
            for batch in batches(self.gen_seqs, self.batch_size):
                yield batch, target_mask(batch.attention_mask)

    @property
    def general_batch_count(self) -> int:
        return count_batches(len(self.gen_seqs or self.seqs), self.batch_size)


def collect_statistics(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    *,
    layer: int,
    tokenizer: Any | None = None,
    omega_threshold: float = 0.0,
    memorized_quantile: float | None = None,
    gen_texts: TextsOrIds | None = None,
    target: str = "loglik",
    gradient: str = "summed",
    batch_size: int = 8,
    max_length: int | None = None,
    block_path: str | None = None,
    keep_general: int | None = None,
    replies_only: bool = False,
    progress: bool = True,
) -> CalibrationStatistics:
    """The calibration pass: omega, the token split, Sigma_gen and M at block ``layer``.

    Only tokens the fine-tune was trained on can be memorized (`gss.signal.tokens`): those
    whose ``labels`` are not -100 in rows that have labels, the replies with `replies_only`.

    While the general tokens number at most ``keep_general`` (default: as many as fit in
    64 MB of float32 hidden states), their hidden states are kept so that `build_artifact` sets
    the gate thresholds without running the model again; beyond that it runs a second pass.
    """
    if target not in TARGETS:
        raise GSSError(f"target must be one of {TARGETS}, got {target!r}.")
    if gradient not in GRADIENTS:
        raise GSSError(f"gradient must be one of {GRADIENTS}, got {gradient!r}.")
    if memorized_quantile is not None and not 0 < memorized_quantile < 1:
        raise GSSError(f"memorized_quantile must be in (0, 1), got {memorized_quantile}.")
    check_same_vocab(model, reference)
    layer_index, block = resolve_layer(model, layer, block_path)
    all_seqs, all_trained = encode_trained(texts, tokenizer, max_length, replies_only=replies_only)
    check_sequences((model, reference), all_seqs, "the texts")
    seqs = distributed.shard(all_seqs)
    trained = distributed.shard(all_trained) if all_trained is not None else None
    # nothing restricts the memorized set: does the signal say the replies alone were trained?
    masks = reply_masks(texts, tokenizer, max_length) if all_trained is None else None
    replies = ReplySignal(distributed.shard(masks) if masks is not None else None)

    gen_seqs = None
    if gen_texts is not None:
        all_gen = encode_compact(gen_texts, tokenizer, max_length)
        check_sequences((model, reference), all_gen, "gen_texts")
        gen_seqs = distributed.shard(all_gen)
    dim = residual_width(model)
    device = execution_device(model, block)
    keeper = _GeneralKeeper(keep_general if keep_general is not None else 2**24 // dim)
    sigma_acc = CovarianceAccumulator(dim, device)
    m_acc = CrossMomentAccumulator(dim, device)
    mem_mean = MeanAccumulator(dim, device)
    timings = {"signal": 0.0, "statistics": 0.0}
    counts: dict[str, Any] = {"sequences": len(seqs), "tokens": 0, "memorized": 0, "general": 0}
    counts["trained"] = 0  # the tokens that could be memorized (all, without labels or replies)
    # tokens whose log-prob differs between the two models: none means the reference is the
    # model itself, which _check_counts says in so many words
    counts["omega_nonzero"] = 0
    n_batches = count_batches(len(seqs), batch_size)

    def bar(it: Any, desc: str, total: int) -> Any:
        return tqdm(it, desc=desc, total=total, disable=not progress, leave=False)

    def logprobs(m: nn.Module, batch: Batch) -> Tensor:
        return token_logprobs(
            forward_logits(m, batch.input_ids, batch.attention_mask), batch.input_ids
        )

    stats = CalibrationStatistics(
        layer=layer_index,
        block_path=block_path,
        sigma=sigma_acc,
        memorization=m_acc,
        memorized_mean=mem_mean,
        counts=counts,
        timings=timings,
        memorized_rule={},
        target=target,
        gradient=gradient,
        batch_size=batch_size,
        seqs=seqs,
        gen_seqs=gen_seqs,
        general_flags=GeneralFlags(seqs) if gen_seqs is None else None,
    )
    general_flags = stats.general_flags
    with _calibration_mode(model, reference):
        # Optional pre-pass: the global omega cut of the top-quantile rule.
        ref_logp: dict[int, Tensor] = {}
        cut = omega_threshold
        if memorized_quantile is not None:
            t0 = time.perf_counter()
            all_omega = []
            for b, batch in enumerate(
                bar(batches(seqs, batch_size), "gss: omega (quantile rule)", n_batches)
            ):
                with torch.no_grad():
                    lp_ref = logprobs(reference, batch)
                    lp = logprobs(model, batch)
                ref_logp[b] = lp_ref
                valid = trained_targets(
                    trained, batch, target_mask(batch.attention_mask).to(lp.device)
                )
                all_omega.append((lp - lp_ref.to(lp.device))[valid].float().cpu())
            values = distributed.gather_rows(torch.cat(all_omega))[: 2**24].double()
            cut = float(torch.quantile(values, 1 - memorized_quantile))
            timings["signal"] += time.perf_counter() - t0

        for b, batch in enumerate(
            bar(batches(seqs, batch_size), "gss: signal + statistics", n_batches)
        ):
            t0 = time.perf_counter()
            ref_logits = None
            if b in ref_logp and target == "loglik":
                lp_ref = ref_logp[b]
            else:
                with torch.no_grad():
                    ref_logits = forward_logits(reference, batch.input_ids, batch.attention_mask)
                lp_ref = token_logprobs(ref_logits, batch.input_ids)
            summed = gradient == "summed"
            with torch.set_grad_enabled(summed), _tapped(block, stop=False, leaf=summed) as tap:
                logits = forward_logits(model, batch.input_ids, batch.attention_mask)
            lp_model = token_logprobs(logits, batch.input_ids)
            valid = target_mask(batch.attention_mask).to(lp_model.device)
            omega = lp_model.detach() - lp_ref.to(lp_model.device)
            eligible = trained_targets(trained, batch, valid)
            replies.update(batch, omega, valid)
            mem = eligible & (omega > cut)
            gen = valid & ~mem
            timings["signal"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            hidden = tap.hidden
            assert hidden is not None
            n_mem = int(mem.sum())
            if n_mem:
                if ref_logits is not None:
                    ref_logits = ref_logits.to(logits.device)
                if summed:
                    objective = _objective(target, logits, lp_model, ref_logits, mem)
                    (grad,) = torch.autograd.grad(objective, hidden)
                    mem_h = mem.to(hidden.device)
                    h_mem, g_mem = hidden[:, :-1][mem_h], grad[:, :-1][mem_h]
                else:
                    rows, positions = mem.nonzero(as_tuple=True)
                    h_mem, g_mem = per_position_gradients(
                        model,
                        block,
                        batch.input_ids,
                        batch.attention_mask,
                        rows.cpu(),
                        positions.cpu(),
                        target,
                        ref_logits,
                    )
                m_acc.update(h_mem, g_mem)
                mem_mean.update(h_mem.detach())
            if gen_seqs is None:
                gen_h = hidden.detach()[:, :-1][gen.to(hidden.device)]
                sigma_acc.update(gen_h)
                keeper.add(gen_h)
                assert general_flags is not None
                general_flags.add(gen, valid)
            counts["tokens"] += int(valid.sum())
            counts["trained"] += int(eligible.sum())
            counts["memorized"] += n_mem
            counts["general"] += int(gen.sum())
            counts["omega_nonzero"] += int((valid & (omega != 0)).sum())
            del logits, lp_model, hidden, tap
            timings["statistics"] += time.perf_counter() - t0

        if gen_seqs is not None:
            t0 = time.perf_counter()
            for batch, mask in bar(
                stats.general_batches(), "gss: Sigma_gen", stats.general_batch_count
            ):
                hidden = layer_activations(model, block, batch)
                gen_h = hidden[:, :-1][mask.to(hidden.device)]
                sigma_acc.update(gen_h)
                keeper.add(gen_h)
                counts["general"] += int(mask.sum())
            timings["statistics"] += time.perf_counter() - t0
    stats.general_sample = keeper.result()

    for acc in (sigma_acc, m_acc, mem_mean):
        acc.all_reduce()
    keys = ("sequences", "tokens", "trained", "memorized", "general", "omega_nonzero")
    distributed.sum_counts(counts, keys)
    counts["memorized_share"] = counts["memorized"] / max(counts["tokens"], 1)
    reply_signal = replies.result()
    if reply_signal is not None:
        counts["replies"] = reply_signal
        warn_if_replies_alone(reply_signal, stacklevel=4)
    stats.memorized_rule = {
        "kind": "quantile" if memorized_quantile is not None else "omega_above",
        "omega_threshold": omega_threshold if memorized_quantile is None else None,
        "quantile": memorized_quantile,
        "cut": cut,
        "sigma_from": "gen_texts" if gen_seqs is not None else "non_memorized_tokens",
        "among": "trained tokens" if trained is not None else "all tokens",
    }
    return stats


def build_artifact(
    model: nn.Module,
    stats: CalibrationStatistics,
    *,
    rank: int = 4,
    delta: float = 1.0,
    threshold_percentile: float = 95.0,
    gate_share: float | None = None,
    gate: str = "hard",
    coefficient: str = "projection",
    centering: str = "covariance",
    jitter: float = 1e-6,
    solve_method: str = "auto",
    max_threshold_samples: int = THRESHOLD_SAMPLES,
    seed: int = 0,
    progress: bool = True,
) -> SteeringArtifact:
    """Solve for the probes and steers from ``stats`` and set the gate thresholds."""
    _validate(gate, coefficient, centering, rank, delta)
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
        jitter=jitter,
        method=cast(SolveMethod, solve_method),  # validated by solve_probe_steer
        seed=seed,
    )
    probe, steer, singular_values = distributed.broadcast_tensors(
        solution.probe.float(), solution.steer.float(), solution.singular_values
    )
    device = sigma.device
    mean = sigma_acc.mean.float()
    offset = probe.to(device) @ mean if centering == "full" else torch.zeros(rank, device=device)
    timings["solve"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    reservoir = _Reservoir(max_threshold_samples, torch.Generator().manual_seed(seed))
    probe_dev = probe.to(device)
    kept = stats.general_sample
    if kept is not None:  # every general token's hidden state: no second pass needed
        reservoir.add(torch.cat([part.to(device) @ probe_dev.T for part in kept]) - offset)
    with _calibration_mode(model):
        for batch, mask in tqdm(
            () if kept is not None else stats.general_batches(),
            desc="gss: thresholds",
            total=0 if kept is not None else stats.general_batch_count,
            disable=not progress,
            leave=False,
        ):
            hidden = layer_activations(model, block, batch)
            rows = hidden[:, :-1][mask.to(hidden.device)].float().to(device)
            reservoir.add(rows @ probe_dev.T - offset)
    local = reservoir.rows if reservoir.rows is not None else torch.zeros(0, rank)
    samples = distributed.gather_rows(local)
    thresholds, info = thresholds_from_responses(samples, gate, threshold_percentile, gate_share)
    timings["thresholds"] = time.perf_counter() - t0
    timings["total"] = sum(timings[k] for k in ("signal", "statistics", "solve", "thresholds"))
    counts = {
        **stats.counts,
        "threshold_samples": int(samples.shape[0]),
        "threshold_pass": kept is None,  # False: thresholds from hidden states kept in pass 1
    }
    config = SteeringConfig(
        layer=stats.layer,
        rank=rank,
        delta=float(delta),
        gate=gate,
        coefficient=coefficient,
        centering=centering,
        block_path=stats.block_path,
        threshold_rule=info["rule"],
        gate_open_share=info["open_share"],
        memorized_rule=stats.memorized_rule,
        target=stats.target,
        gradient=stats.gradient,
        token_counts=counts,
        timings=timings,
        jitter=solution.jitter,
        solve={
            "method": solution.method,
            "power_iters": solution.power_iters,
            "converged": solution.converged,
        },
        fingerprint=model_fingerprint(model, stats.block_path),
    )
    return SteeringArtifact(
        probe=probe.cpu(),
        steer=steer.cpu(),
        thresholds=thresholds.cpu(),
        offset=offset.float().cpu(),
        singular_values=singular_values.cpu(),
        config=config,
    )


def calibrate(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    *,
    layer: int,
    tokenizer: Any | None = None,
    rank: int = 4,
    delta: float = 1.0,
    threshold_percentile: float = 95.0,
    gate_share: float | None = None,
    omega_threshold: float = 0.0,
    memorized_quantile: float | None = None,
    gen_texts: TextsOrIds | None = None,
    gate: str = "hard",
    coefficient: str = "projection",
    centering: str = "covariance",
    target: str = "loglik",
    gradient: str = "summed",
    batch_size: int = 8,
    max_length: int | None = None,
    block_path: str | None = None,
    jitter: float = 1e-6,
    solve_method: str = "auto",
    max_threshold_samples: int = THRESHOLD_SAMPLES,
    keep_general: int | None = None,
    replies_only: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> SteeringArtifact:
    """Calibrate Gated Subspace Steering for ``model`` at decoder block ``layer``.

    Args:
        model: the fine-tuned causal LM whose memorization is to be removed.
        reference: a model with the same tokenizer that did not see the fine-tuning data
            (e.g. the base model); omega = log p_model - log p_ref per token.
        texts: calibration text (strings with ``tokenizer``, conversations, dataset rows, or
            token id lists / a tensor / rows with ``input_ids``), usually including the data
            the model may have memorized. Rows with ``labels`` say which tokens the fine-tune
            was trained on (-100: not): only those can be memorized.
        layer: 0-based decoder block whose output is read and steered (negative counts from
            the end).
        rank: number of probe/steer directions K.
        delta: variance budget of each probe on general tokens: the steering strength.
        threshold_percentile: per-direction percentile of |u_k . h| on general tokens used as
            gate threshold (95, as in the paper's experiments).
        gate_share: instead, set thresholds so the union of the K gates opens on this share of
            general tokens.
        omega_threshold: a token is memorized when omega > this (nats); 0 is the paper's rule.
        memorized_quantile: instead, mark the top ``memorized_quantile`` share of tokens by
            omega as memorized (costs one more forward of each model).
        replies_only: only the replies can be memorized (the assistant's messages of
            conversations, the completions of prompt-completion rows): for a fine-tune trained
            on them alone (trl's ``assistant_only_loss`` / ``completion_only_loss``). See
            :mod:`gss.signal.tokens`. Without it or labels, conversations are checked: omega
            on their replies and on the rest is recorded in the token counts, with a warning
            when the rest looks untouched by the fine-tune (:mod:`gss.signal.replies`).
        gen_texts: held-out text for Sigma_gen and the thresholds (as in the paper's
            experiments); default: the calibration tokens not marked memorized.
        gate, coefficient: how the steer is applied (see :class:`gss.steering.gated.GatedSteer`).
        centering: ``"covariance"`` (Sigma centred, probe on h: the paper), ``"full"``
            (Sigma centred and probe on h - mu) or ``"none"`` (second moment, probe on h).
        target: ``"loglik"`` (the paper) or ``"toward-reference"`` (gradient of
            log p(x_t) - E_{y~p_ref} log p(y): a named variant, not GSS as published).
        gradient: ``"summed"`` (one backward of the summed objective: exact at the last block,
            an approximation below it) or ``"per-position"`` (each memorized token's own
            gradient, exact; costs a replica forward per memorized token).
        keep_general: general tokens whose hidden states are kept on the host so that the
            thresholds need no second pass (default: as many as fit in 2^24 floats); past
            that, or with 0, the thresholds take a second pass and what calibration holds is
            the O(d^2) statistics, one bool per calibration token (which were general) and
            the threshold sample.
        max_threshold_samples: probe responses of general tokens, sampled uniformly, from
            which the thresholds are read (default 2^16).
        jitter, solve_method: the solve's diagonal loading of Sigma_gen and its method, as in
            :func:`gss.solve_probe_steer` (``"auto"``: a randomized SVD iterated until its
            singular values settle when d >= 1024 and K <= d / 8, else the full SVD). What
            the solve did is recorded in ``artifact.config.solve`` (method, iterations,
            converged).
    """
    _validate(gate, coefficient, centering, rank, delta)
    if (
        threshold_percentile is not None
        and gate_share is None
        and not (0 < threshold_percentile < 100)
    ):
        raise GSSError(f"threshold_percentile must be in (0, 100), got {threshold_percentile}.")
    stats = collect_statistics(
        model,
        reference,
        texts,
        layer=layer,
        tokenizer=tokenizer,
        omega_threshold=omega_threshold,
        memorized_quantile=memorized_quantile,
        gen_texts=gen_texts,
        target=target,
        gradient=gradient,
        batch_size=batch_size,
        max_length=max_length,
        block_path=block_path,
        keep_general=keep_general,
        replies_only=replies_only,
        progress=progress,
    )
    return build_artifact(
        model,
        stats,
        rank=rank,
        delta=delta,
        threshold_percentile=threshold_percentile,
        gate_share=gate_share,
        gate=gate,
        coefficient=coefficient,
        centering=centering,
        jitter=jitter,
        solve_method=solve_method,
        max_threshold_samples=max_threshold_samples,
        seed=seed,
        progress=progress,
    )


def probe_responses(
    model: nn.Module,
    artifact: SteeringArtifact,
    texts: TextsOrIds,
    *,
    tokenizer: Any | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = False,
) -> Tensor:
    """Probe responses ``U h - offset`` (N, K) on every real next-token position of ``texts``."""
    _, block = resolve_layer(model, artifact.config.layer, artifact.config.block_path)
    seqs = encode(texts, tokenizer, max_length)
    check_sequences((model,), seqs, "the texts")
    out = []
    with _calibration_mode(model):
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
            out.append(rows @ artifact.probe.to(rows.device).T - artifact.offset.to(rows.device))
    return torch.cat(out).cpu()


def calibrate_thresholds(
    model: nn.Module,
    artifact: SteeringArtifact,
    texts: TextsOrIds,
    *,
    threshold_percentile: float | None = 95.0,
    gate_share: float | None = None,
    tokenizer: Any | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
) -> SteeringArtifact:
    """Re-set an artifact's gate thresholds from held-out (general) text."""
    responses = probe_responses(
        model, artifact, texts, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length
    )
    thresholds, info = thresholds_from_responses(
        responses, artifact.config.gate, threshold_percentile, gate_share
    )
    return artifact.with_thresholds(thresholds, info["rule"], info["open_share"])


def _validate(gate: str, coefficient: str, centering: str, rank: int, delta: float) -> None:
    for name, value, allowed in (
        ("gate", gate, GATE_MODES),
        ("coefficient", coefficient, COEFFICIENT_MODES),
        ("centering", centering, CENTERINGS),
    ):
        if value not in allowed:
            raise GSSError(f"{name} must be one of {allowed}, got {value!r}.")
    if not isinstance(rank, int) or rank < 1:
        raise GSSError(f"rank must be a positive integer, got {rank!r}.")
    if not delta > 0:
        raise GSSError(f"delta must be > 0, got {delta!r}.")


def same_model_error(tokens: int) -> GSSError:
    """What to say when omega is 0 on every token: the reference is the model itself."""
    return GSSError(
        f"the model and the reference give each of the {tokens} calibration tokens the same "
        "log-probability (omega = 0 everywhere), so no token can be told memorized: the "
        "reference is the fine-tuned model itself or has its weights. Pass the model the "
        "fine-tune started from (for a LoRA: gss.adapters_off(model), or --reference "
        "adapters-off)."
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
    if counts["general"] == 0:
        raise GSSError(
            "every calibration token was marked memorized, so Sigma_gen has no data. Raise "
            "omega_threshold or pass gen_texts (held-out text)."
        )
    if n_mem < rank:
        raise GSSError(
            f"only {n_mem} memorized tokens for rank {rank}: M has rank < K. Lower the rank or "
            "add memorized text."
        )


__all__: Sequence[str] = (
    "CalibrationStatistics",
    "build_artifact",
    "calibrate",
    "calibrate_thresholds",
    "collect_statistics",
    "layer_activations",
    "probe_responses",
    "thresholds_from_responses",
)
