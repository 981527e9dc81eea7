"""Steps 4 to 7 of `gss.protect`: the candidate blocks, the block stage (every variant and
block at the first rank), refinement (other ranks, then other gates), a second block, and the
replies check, each a method of one `Search` over the same points (`measure.Judge`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from gss.artifact.stack import Steer, SteeringStack
from gss.artifact.steering_artifact import SteeringArtifact
from gss.calibrate import calibrate
from gss.errors import GSSError, GSSWarning
from gss.hf.blocks import find_decoder_blocks
from gss.protect.checks import DomainRows, search_checks
from gss.protect.clock import Clock
from gss.protect.config import ProtectConfig, Setting
from gss.protect.general import DATA, Budget, GeneralText
from gss.protect.measure import Check, Judge, strength_search
from gss.protect.replies import least_looping
from gss.protect.result import Trial
from gss.protect.space import given_blocks
from gss.protect.split import Split
from gss.solve.thresholds import probe_responses, with_gates_set


class Search:
    """The staged search over one protect run's points: each stage adds trials to the same
    `Judge`, and `best` is the best of them all so far."""

    def __init__(
        self,
        s: Setting,
        config: ProtectConfig,
        split: Split,
        general: GeneralText,
        budget: Budget,
        checks: dict[str, Check],
    ) -> None:
        self.s, self.config, self.space, self.split = s, config, config.search, split
        self.general = general
        self.bar = tqdm(desc="gss: protect", unit="point", disable=not s.progress)
        # where the search's time goes: per stage, and per kind of work across the stages
        self.stages, self.work = Clock(), Clock()
        self.judge = Judge(
            s.model,
            split.tune_candidates,
            budget.utility,
            budget.limit,
            k=config.k,
            n=config.n,
            pad_id=s.pad_id,
            batch_size=s.batch_size,
            bar=self.bar,
            prefer=self.space.prefer,
            checks=checks,
            clock=self.work,
            modes=config.leak_modes,
        )
        self.made: dict[tuple[str, int], SteeringArtifact] = {}
        self.replies: dict[str, Any] = {}

    @property
    def goal(self) -> float:
        return self.config.max_extractable

    def best(self) -> Trial | None:
        return self.judge.best(self.judge.trials, self.goal)

    def short_of_goal(self) -> bool:
        """A best point exists and leaves more than the goal extractable."""
        best = self.best()
        return best is not None and best.memorized > self.goal

    def run(self) -> Trial | None:
        """The stages in order, each only where the ones before fell short; the best point."""
        with self.stages.part("candidate blocks"):
            candidates = self.candidate_blocks()
        with self.stages.part("block stage"):
            self.block_stage(candidates)
        if self.short_of_goal():
            with self.stages.part("refinement"):
                self.refine()
        if self.short_of_goal() and self.space.max_blocks >= 2:
            with self.stages.part("second block"):
                self.second_block()
        best = self.best()
        if best is not None and self.space.reply_check > 1:
            self.bar.set_description_str("gss: protect (replies)")
            with self.stages.part("replies check"):
                best, self.replies = self.replies_check()
        self.bar.close()
        return best

    def replies_check(self) -> tuple[Trial | None, dict[str, Any]]:
        """Step 7: the best points' greedy replies to the tuning prompts, for loops."""
        with self.work.part("replies check"):
            return least_looping(
                self.s.model,
                self.s.reference,
                self.judge,
                self.goal,
                self.split.tune_candidates,
                self.space,
                self.config.k,
                self.config.n,
                self.s.pad_id,
                self.s.batch_size,
            )

    def candidate_blocks(self) -> list[int]:
        """Step 4: every block of a small model; otherwise the strongest signal's blocks
        (`gss.scan_layers`) and evenly spaced ones."""
        count = len(find_decoder_blocks(self.s.model))
        space = self.space
        if space.blocks is not None:
            return given_blocks(space.blocks, count)
        if count <= space.max_candidates:
            return list(range(count))
        from gss.layer_scan import scan_layers

        with self.work.part("layer scan"):
            scan = scan_layers(
                self.s.model,
                self.s.reference,
                self.split.tune_rows,
                "gss-tr",
                gen_texts=self.general.fit_rows,
                batch_size=self.s.batch_size,
                progress=False,
            )
        frozen = set(scan.unchanged)  # blocks whose output equals the reference's
        ranked = sorted(set(scan.strengths) - frozen, key=lambda b: -scan.strengths[b])
        half = space.max_candidates // 2  # evenly spaced; the rest (at least one) by signal
        spaced = [round(i * (count - 1) / half) for i in range(1, half + 1)]
        chosen = set(ranked[: space.max_candidates - half]) | {min(b, count - 1) for b in spaced}
        return sorted(chosen or {count - 1})

    def block_stage(self, candidates: list[int]) -> None:
        """Step 5: every (variant, candidate block) at the first rank and gate."""
        for preset in self.space.presets:
            for layer in candidates:
                self.bar.set_description_str(f"gss: protect ({preset}, block {layer})")
                art = self.calibrated(preset, layer, max(self.space.ranks))
                if art is not None:
                    self.made[preset, layer] = art
                    rank = min(self.space.ranks[0], art.rank)
                    first = art.with_options(rank=rank, gate=self.space.gates[0])
                    self.explore(first, "block", preset)

    def refine(self) -> None:
        """The other ranks, then the other gates, on the best (variant, block) pairs."""
        ranked = self.judge.ranked(self.judge.trials, self.goal)
        pairs = list(dict.fromkeys((t.preset, t.blocks[0]) for t in ranked))
        for preset, layer in pairs[: self.space.refine]:
            # the gate stage 1 used (the artifact's own is "discriminant" when that may be tried)
            full = self.made[preset, layer].with_options(gate=self.space.gates[0])
            for rank in self.space.ranks[1:]:
                if rank <= full.rank:
                    self.explore(full.with_options(rank=rank), "rank", preset)
            here = [t for t in self.judge.trials if (t.preset, t.blocks) == (preset, (layer,))]
            local = self.judge.best(here, self.goal)
            current = full if local is None else full.with_options(rank=local.rank)
            for gate in self.space.gates:
                if gate != current.config.gate:
                    self.explore(current.with_options(gate=gate), "gate", preset)

    def second_block(self) -> None:
        """Step 6: a second block, calibrated on the model steered by the best point's, on the
        three blocks that left the fewest rows; the first block at full or half strength."""
        best = self.best()
        assert best is not None
        head = self.judge.steer_of(best)
        assert isinstance(head, SteeringArtifact)
        by_block: dict[int, float] = {}
        for t in self.judge.trials:
            if t.stage == "block" and t.within_budget and t.blocks[0] != head.layer:
                by_block[t.blocks[0]] = min(by_block.get(t.blocks[0], 100.0), t.memorized)
        for layer in sorted(by_block, key=by_block.__getitem__)[:3]:
            self.bar.set_description_str(f"gss: protect (block {head.layer} + block {layer})")
            with head.attach(self.s.model):
                second = self.calibrated(best.preset, layer, head.rank)
                if second is not None:
                    second = self.gated_as(second.with_options(gate=head.config.gate), head)
            if second is None:
                continue
            for share in (1.0, 0.5):  # the first block gives up part of the budget
                first = head.with_options(delta=head.config.delta * share)
                strength_search(
                    self.judge,
                    _stacked(first, second),
                    self.space,
                    "second block",
                    best.preset,
                    self.goal,
                )

    def calibrated(self, preset: str, layer: int, rank: int) -> SteeringArtifact | None:
        """One calibration on the tuning rows (None, said, where the block cannot be)."""
        try:
            with warnings.catch_warnings(), self.work.part("calibration"):
                # its soundness warnings are of the largest rank, before a rank is chosen, and
                # protect measures what they foretell (rows left, gates open on general text);
                # the chosen steer records its own directions' (`gss show`)
                warnings.filterwarnings("ignore", "calibration: ", GSSWarning)
                return calibrate(
                    self.s.model,
                    self.s.reference,
                    self.split.tune_rows,
                    preset,
                    layer=layer,
                    rank=rank,
                    gen_texts=self.general.fit_rows,
                    # the condition direction too, when some point may use the discriminant gate
                    gate="discriminant" if "discriminant" in self.space.gates else "hard",
                    coefficient=self.space.coefficient,
                    centering=self.space.centering,
                    batch_size=self.s.batch_size,
                    progress=False,
                )
        except GSSError as e:  # a block with nothing to steer against, say
            warnings.warn(
                f"protect: skipped block {layer} ({preset}): {e}", GSSWarning, stacklevel=3
            )
            return None

    def explore(self, art: SteeringArtifact, stage: str, preset: str) -> None:
        """The strength bisection of one artifact, its gates set on the general text first;
        where no point reaches the goal with the data's clean rows among the gates' sources,
        again without them (on a model that learned every row of its data alike, gates set
        on the clean rows stay shut on the memorized ones too)."""
        trials = self._explore(art, stage, preset, self.general.fit)
        others = {name: rows for name, rows in self.general.fit.items() if name != DATA}
        if (
            others
            and DATA in self.general.fit
            and not any(t.within_budget and t.memorized <= self.goal for t in trials)
        ):
            self._explore(art, stage, preset, others)

    def _explore(
        self,
        art: SteeringArtifact,
        stage: str,
        preset: str,
        sources: dict[str, list[list[int]]],
    ) -> list[Trial]:
        try:
            with self.work.part("gate thresholds"):
                art = gated(self.s, art, sources, self.space.gate_share)
        except GSSError as e:  # thresholds this gate cannot have here: the others are searched
            warnings.warn(
                f"protect: skipped block {art.layer}, {art.config.gate} gate ({preset}): {e}",
                GSSWarning,
                stacklevel=4,
            )
            return []
        return strength_search(
            self.judge, lambda d: art.with_options(delta=d), self.space, stage, preset, self.goal
        )

    def gated_as(self, artifact: SteeringArtifact, like: SteeringArtifact) -> SteeringArtifact:
        """``artifact`` with its gates set on the sources ``like``'s were set on."""
        named = like.provenance.threshold_rule["sources"]
        sources = {name: rows for name, rows in self.general.fit.items() if name in named}
        with self.work.part("gate thresholds"):
            return gated(self.s, artifact, sources, self.space.gate_share)


def gated(
    s: Setting, artifact: SteeringArtifact, sources: dict[str, list[list[int]]], share: float
) -> SteeringArtifact:
    """The artifact with thresholds set so that, on every token of each source, some gate
    opens on at most ``share`` of them (the union, not each direction: K gates at 5% each open
    on up to K x 5%): each source's thresholds, the highest of them kept. Calibration sets
    them on its own general tokens, which need not look like the traffic the model will
    serve; pooled sources let the largest decide, and a gate set on in-domain text alone
    opened on half of ordinary English (issue 72)."""
    named = {name: rows for name, rows in sources.items() if rows}
    responses = {
        name: probe_responses(s.model, artifact, rows, batch_size=s.batch_size)
        for name, rows in named.items()
    }
    gated = {name: with_gates_set(artifact, r, None, share) for name, r in responses.items()}
    if len(gated) == 1:  # its own thresholds and shares; the rule names the source
        ((name, one),) = gated.items()
        rule = {**one.provenance.threshold_rule, "sources": [name]}
        return dataclasses.replace(
            one, provenance=dataclasses.replace(one.provenance, threshold_rule=rule)
        )
    eps = torch.stack([g.thresholds for g in gated.values()]).amax(0)
    levels = [g.condition_threshold for g in gated.values() if g.condition_threshold is not None]
    level = max(levels, default=None)
    rule = {**next(iter(gated.values())).provenance.threshold_rule, "sources": list(named)}
    if artifact.config.gate == "discriminant":  # one condition: the highest source's shares
        top = max(gated.values(), key=lambda g: g.condition_threshold or 0.0)
        return artifact.with_thresholds(eps, rule, top.provenance.gate_open_share, level)
    pooled = torch.cat(list(responses.values()))[:, : artifact.rank].double()
    values = pooled if artifact.config.gate == "relu" else pooled.abs()
    opened = values > eps.double()
    bounds = torch.tensor([0, *(len(r) for r in responses.values())]).cumsum(0).tolist()
    shares = {
        "per_direction": opened.double().mean(0).tolist(),
        "union": float(opened.any(-1).double().mean()),
        "tokens": int(values.shape[0]),
        "per_source": {
            name: float(opened[a:b].any(-1).double().mean())
            for name, a, b in zip(named, bounds[:-1], bounds[1:], strict=True)
        },
    }
    return artifact.with_thresholds(eps, rule, shares, level)


def _stacked(first: SteeringArtifact, second: SteeringArtifact) -> Callable[[float], Steer]:
    """The two blocks as one steer, the second at strength ``delta``."""
    return lambda delta: SteeringStack((first, second.with_options(delta=delta)))


def make_search(
    s: Setting, config: ProtectConfig, split: Split, general: GeneralText, budget: Budget
) -> tuple[Search, DomainRows]:
    """The search, with the checks every point is held to besides the budget, and the
    domain's clean rows the report measures before and after (`checks`)."""
    checks, domain = search_checks(s, config, split)
    return Search(s, config, split, general, budget, checks), domain
