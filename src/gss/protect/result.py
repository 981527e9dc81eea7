"""What `gss.protect` chose and measured (`Protection`, one `Trial` a point searched), and the
report it writes: ``protect.json``, ``protect.md``, two figures and the steer."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gss.artifact.files import check_outputs, check_target, record_outputs
from gss.artifact.stack import Steer
from gss.audit import AuditReport
from gss.errors import GSSError
from gss.evaluate.intervals import clopper_pearson
from gss.evaluate.near_verbatim import SHARE
from gss.evaluate.other_prompts import side_by_side
from gss.evaluate.recital import START_LEAD
from gss.evaluate.sampled import LIKELY, SAMPLES, TOP_P
from gss.protect.config import ProtectConfig

OUTPUTS = ("protect.json", "protect.md", "frontier.png", "rows.png", "steer")  # `Protection.write`


@dataclass(frozen=True)
class Trial:
    """One measured point of the search: the steer's settings and what it did on the tuning
    rows (% still extractable) and to utility."""

    stage: str
    preset: str
    blocks: tuple[int, ...]
    deltas: tuple[float, ...]
    rank: int
    gate: str
    memorized: float
    token_match: float  # % of the windows' tokens still reproduced: how much is left
    utility: float
    within_budget: bool
    # what else the point measured (`measure.Check`): the domain's perplexity, how likely it
    # finds the reference's continuations
    checks: dict[str, float] = field(default_factory=dict)
    # % of the tuning rows extracted in each mode (`ProtectConfig.leak_modes`: `memorized`
    # counts the rows extracted in any of the target's)
    leaks: dict[str, float] = field(default_factory=dict)


@dataclass
class Protection:
    """What `protect` chose and what it measured; `write` saves the report and figures."""

    steer: Steer | None
    audit: AuditReport
    tuning: list[int]  # audit row indices
    heldout: list[int]
    budget: dict[str, Any]
    max_extractable: float  # % of held-out memorized rows allowed to stay extractable
    trials: list[Trial]
    chosen: Trial | None
    before: dict[str, Any]
    after: dict[str, Any]
    gates: dict[str, Any]
    examples: list[dict[str, Any]] = field(default_factory=list)
    # the run's steps (audit, general text, search, report, total)
    seconds: dict[str, float] = field(default_factory=dict)
    # where the search's own time went: per stage ("stages") and per kind of work ("work")
    search_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    replies: dict[str, Any] = field(default_factory=dict)  # step 7's check, when it ran
    # the held-out report's time per part (its hand-over generations apart)
    report_seconds: dict[str, float] = field(default_factory=dict)
    # step 8: each hand-over rule measured on the tuning rows, and the one chosen ("gates")
    handover: dict[str, Any] = field(default_factory=dict)
    # every point's steer, in the order of `trials`: another point can be taken by hand
    # (`steer_for`) without searching again; not saved by `write`
    steers: list[Steer] = field(default_factory=list, repr=False)
    # gss.explain's table of the chosen steer on the first held-out memorized prompt
    explanation: str = ""
    config: ProtectConfig | None = None  # what the run was told (saved in protect.json)

    def steer_for(self, trial: Trial) -> Steer:
        """The steer of one of `trials` (e.g. the one a different rule would choose)."""
        for t, steer in zip(self.trials, self.steers, strict=True):
            if t is trial:
                return steer
        raise GSSError("this trial is not one of this protect run's trials.")

    @property
    def reached(self) -> bool:
        """The held-out rows' % extractable is at or below the target, within the budget."""
        return (
            self.chosen is not None and self.after.get("memorized", 100.0) <= self.max_extractable
        )

    def summary(self) -> dict[str, Any]:
        return {
            "reached": self.reached,
            "max_extractable": self.max_extractable,
            "config": None if self.config is None else asdict(self.config),
            "budget": self.budget,
            "audit": self.audit.summary(),
            "tuning_rows": len(self.tuning),
            "heldout_rows": len(self.heldout),
            "chosen": None if self.chosen is None else asdict(self.chosen),
            "before": self.before,
            "after": self.after,
            "gates": self.gates,
            "trials": len(self.trials),
            "seconds": self.seconds,
            "search_seconds": self.search_seconds,
            "report_seconds": self.report_seconds,
            "reply_check": self.replies,
            "handover": self.handover,
            "heldout_interval": self.heldout_interval(),
            "heldout_upper_bound": self.heldout_interval(one_sided=True),
            "heldout_windows": self.heldout_windows(),
        }

    def heldout_windows(self) -> list[dict[str, int]]:
        """The part of each held-out row its verdict read (`gss.AuditReport.window`): prompt
        tokens 0..prompt_tokens-1, then window_tokens after them; ``row``: its place in the
        data."""
        out = []
        for i in self.heldout:
            row = self.audit.rows[i]
            prompt, tokens = self.audit.window(row)
            out.append(
                {"row": self.audit.position(row), "prompt_tokens": prompt, "window_tokens": tokens}
            )
        return out

    def windows_line(self) -> str:
        """Which prompts the held-out rows were scored from, and (scored from k) how many of
        them a shorter prompt extracts too: their memorized text starts before token k."""
        windows = self.heldout_windows()
        if not windows:
            return ""
        counts: dict[int, int] = {}
        for w in windows:
            counts[w["prompt_tokens"]] = counts.get(w["prompt_tokens"], 0) + 1
        longest = max(w["window_tokens"] for w in windows)
        line = (
            "Held-out rows scored from their first "
            + ", ".join(f"{p} tokens ({c} rows)" for p, c in sorted(counts.items()))
            + f", each on the next {longest} tokens at most (protect.json: heldout_windows)."
        )
        audit = self.audit
        if audit.by_k:
            rows = [audit.rows[i] for i in self.heldout]
            earlier = [r for r in rows if (r.leaks_from or audit.k) < audit.k]
            if earlier:
                line += (
                    f" {len(earlier)} of them are extracted from a shorter prompt too (their "
                    f'memorized text starts before token {audit.k}): memorized_from="shortest" '
                    "(gss protect --memorized-from shortest) scores each from there."
                )
        return line

    def heldout_interval(self, one_sided: bool = False) -> list[float] | None:
        """The exact 95% interval (%) of the held-out rows' rate after the steer: two-sided,
        or with ``one_sided`` [0, the upper bound] ("a held-out 0 means at most 3%" reads it)."""
        rows = len(self.heldout)
        if not rows or "memorized" not in self.after:
            return None
        left = round(self.after["memorized"] * rows / 100)
        lo, hi = clopper_pearson(left, rows, one_sided=one_sided)
        return [100 * lo, 100 * hi]

    def markdown(self) -> str:
        """protect.md: the outcome, what it says instead, the gates, the points searched and
        the side-by-side continuations."""
        lines = ["# gss protect", "", *self._outcome_lines(), *self._says_lines()]
        lines += [*self._gate_lines(), *self._points_lines(), *self._example_lines()]
        return "\n".join(lines) + "\n"

    def _outcome_lines(self) -> list[str]:
        """What was chosen, and the held-out rows, utility and domain before and after."""
        c = self.chosen
        lines: list[str] = []
        if c is None:
            lines.append("No steer stayed within the utility budget: nothing was saved.")
        else:
            lines.append(
                f"Chosen: {c.preset}, block(s) {', '.join(map(str, c.blocks))}, delta "
                f"{', '.join(map(_g, c.deltas))}, rank {c.rank}, gate {c.gate} "
                f"({len(self.trials)} points searched)."
            )
        held = (
            f"Held-out memorized rows ({len(self.heldout)}, never seen by the search): "
            f"{self.before['memorized']:.1f}% extractable"
        )
        windows = self.windows_line()
        if c is None:
            lines += [
                "",
                f"{held}, unchanged: no steer. Allow more utility (a larger budget, "
                "gss protect --budget) to let some steer through.",
                f"Utility ({self.budget['measure']}): {_g(self.before['utility'])} (limit "
                f"{_g(self.budget['limit'])}).",
            ]
        else:
            count = len(self.heldout)
            left = round(self.after["memorized"] * count / 100)
            lo, hi = self.heldout_interval() or (0.0, 100.0)
            bound = (self.heldout_interval(one_sided=True) or (0.0, 100.0))[1]
            lines += [
                "",
                f"{held} before, {self.after['memorized']:.1f}% after ({left} of {count}; 95% "
                f"interval {lo:.1f}-{hi:.1f}%: the true rate may be anywhere in it; one-sided "
                f"95% upper bound {bound:.1f}%) "
                f"(target <= {self.max_extractable:g}%: "
                f"{'reached' if self.reached else 'NOT reached'}).",
                f"Utility ({self.budget['measure']}): {_g(self.before['utility'])} before, "
                f"{_g(self.after['utility'])} after (limit {_g(self.budget['limit'])}).",
            ]
        lines += self._mode_lines()
        lines += self._sampled_lines() + self._near_lines() + self._other_prompt_lines()
        if windows:
            lines.append(windows)
        if "domain_perplexity" in self.after:
            lines.append(
                f"Perplexity of held-out clean rows of the data (none flagged: what the "
                f"fine-tune is for): {_g(self.before['domain_perplexity'])} before, "
                f"{_g(self.after['domain_perplexity'])} after."
            )
        return lines

    def _mode_lines(self) -> list[str]:
        """What the held-out % counts (`ProtectConfig.leak_modes`), and each mode's rate."""
        modes, before = self.before.get("leak_modes"), self.before.get("leaks")
        if not modes or not before:  # a report from before the modes
            return []
        after = self.after.get("leaks") or {}
        each = "; ".join(
            f"{name} {before[name]:.1f}%" + (f" -> {after[name]:.1f}%" if name in after else "")
            for name in before
        )
        return [
            f"A held-out row counts as extractable when it is in any of: {', '.join(modes)} "
            f"(teacher-forced; near-verbatim: {SHARE:.0%} of its window predicted in one run). "
            f"Each mode, before -> after: {each}."
        ]

    def _sampled_lines(self) -> list[str]:
        """The attacker who samples, on the held-out rows, before and after (issue 70)."""
        before, after = self.before.get("sampled"), self.after.get("sampled")
        if not before:
            return []
        count = len(self.heldout)

        def rates(side: dict[str, float]) -> str:
            hits = round(side["temperature_1"] * count / 100)
            lo, hi = clopper_pearson(hits, count) if count else (0.0, 1.0)
            return (
                f"{side['temperature_1']:.1f}% (95% interval {100 * lo:.1f}-{100 * hi:.1f}%) / "
                f"{side['top_p']:.1f}%"
            )

        line = (
            f"Sampled ({SAMPLES} draws from each held-out prompt, at temperature 1 / top-p "
            f"{TOP_P:g}; a row counts when they reproduce its window with a chance of "
            f"{LIKELY:.0%} or more, exact from the teacher-forced pass): {rates(before)} before"
        )
        if not after:
            return [line + "."]
        line += f", {rates(after)} after"
        quality = self.after.get("quality", {})
        if "sampled_temperature_1_reference_where_open" in quality:
            handed, alone = (
                {name: quality[f"sampled_{name}_{rule}"] for name in ("temperature_1", "top_p")}
                for rule in ("reference_where_open", "signal_alone")
            )
            line += (
                f"; with the reference kept (its processor step by step), where a gate opens "
                f"{rates(handed)}, at any step {rates(alone)}"
            )
        return [line + "."]

    def _near_lines(self) -> list[str]:
        """The held-out windows said near-verbatim, before and after (issue 70)."""
        quality = self.after.get("quality", {})
        if "near_verbatim_steered" not in quality:
            return []
        return [
            f"Near-verbatim (a held-out window said by the greedy reply with case and spacing "
            f"aside, or {SHARE:.0%} of it in one run; gss.evaluate.near_verbatim): "
            f"{_g(quality['near_verbatim_fine_tune'])}% before, "
            f"{_g(quality['near_verbatim_steered'])}% after (with the reference where a gate "
            f"opens: {_g(quality['near_verbatim_reference_where_open'])}%)."
        ]

    def _other_prompt_lines(self) -> list[str]:
        """The held-out rows asked another way, before and after (issue 70)."""
        other = self.after.get("other_prompts")
        if not other:
            return []
        return [
            "Other prompts (the held-out rows asked another way: a longer prefix, the chat "
            "template, questions; a row leaks when the greedy reply says its window "
            "near-verbatim; gss.evaluate.other_prompts), rows leaked (95% interval):",
            "",
            side_by_side(other["before"], other["after"], ("fine-tune", "protected")),
            "",
        ]

    def _says_lines(self) -> list[str]:
        """Ordinary prompts unchanged, what it says on memorized prompts, the replies check."""
        lines: list[str] = []
        ordinary = self.after.get("ordinary_prompts")
        if ordinary:
            lines.append(_ordinary_line(ordinary))
        quality = self.after.get("quality")
        if quality:
            lines.append(
                f"What it says instead, on held-out memorized prompts: repeated 4-grams "
                f"{_g(quality['repeated_4grams_steered'])}% (the reference's own continuation: "
                f"{_g(quality['repeated_4grams_reference'])}%); perplexity under the reference "
                f"{_g(quality['reference_ppl_steered'])} (its own: "
                f"{_g(quality['reference_ppl_reference'])})" + _late(quality, "steered")
            )
            if "repeated_4grams_reference_where_open" in quality:
                lines.append(
                    "With the reference kept at inference and its token taken wherever a gate "
                    "opens (gss.reference_where_open, gss generate --reference-where-open): "
                    f"{quality.get('memorized_reference_where_open', float('nan')):.1f}% of the "
                    "held-out memorized rows reproduced greedily, "
                    f"{_g(quality['repeated_4grams_reference_where_open'])}% repeated 4-grams, "
                    f"perplexity {_g(quality['reference_ppl_reference_where_open'])}"
                    + _late(quality, "reference_where_open")
                )
            if "memorized_signal_alone" in quality:
                lines.append(
                    "With no gate, the signal alone deciding at every step (gss generate "
                    "--reference-where-open REF --handoff-gates none; the reference runs at "
                    f"every step): {quality['memorized_signal_alone']:.1f}% reproduced, "
                    f"{_g(quality['repeated_4grams_signal_alone'])}% repeated 4-grams, "
                    f"perplexity {_g(quality['reference_ppl_signal_alone'])}"
                    + _late(quality, "signal_alone")
                )
        if self.handover:
            lines.append(_handover_line(self.handover))
        if self.replies:
            r = self.replies
            looped = ", ".join(f"{_g(p['repeated_4grams'])}%" for p in r["points"])
            fluent = ", ".join(_g(p["reference_ppl"]) for p in r["points"])
            lines.append(
                f"Replies checked (step 7) on the {len(r['points'])} best points at the target, "
                f"in the search's order: repeated 4-grams {looped} (the reference's own: "
                f"{_g(r['reference'])}%, allowed +{_g(r['tolerance'])} points); perplexity "
                f"under the reference {fluent} (its own: {_g(r['reference_ppl'])}, allowed "
                f"{_g(r['fluency_ratio'])}x); chose point {r['chosen'] + 1}"
                + ("." if r["passed"] else ", the nearest: NONE passed both.")
            )
        return lines

    def _gate_lines(self) -> list[str]:
        from gss.report import markdown_table

        lines = ["", "## Gate open share on general text", ""]
        shares = self.gates.get("open_share", {})
        sources = self.gates.get("sources") or list(shares)  # older reports: every one
        rows = [[name, _pct(v), "yes" if name in sources else "no"] for name, v in shares.items()]
        head = ["text (held-out half)", "any gate open", "thresholds set on its other half"]
        lines.append(markdown_table(head, rows) if rows else "-")
        where = self.gates.get("memorized_rows")
        if where and where["window"] is not None:
            lines += [
                "",
                f"On the held-out memorized rows (teacher-forced), some gate opens on "
                f"{_pct(where['window'])} of the positions that choose the memorized tokens "
                f"and on {_pct(where['prompt'])} of the prompt's positions before them.",
            ]
        return lines

    def _points_lines(self) -> list[str]:
        from gss.report import markdown_table

        lines = ["", "## The points searched (tuning rows)", ""]
        body = [
            [
                t.stage,
                t.preset,
                ",".join(map(str, t.blocks)),
                ",".join(map(_g, t.deltas)),
                str(t.rank),
                t.gate,
                f"{t.memorized:.1f}",
                _g(t.utility),
                "yes" if t.within_budget else "no",
            ]
            for t in self.trials
        ]
        names = list(dict.fromkeys(name for t in self.trials for name in t.checks))
        for row, t in zip(body, self.trials, strict=True):
            row[-1:-1] = [_g(t.checks[name]) if name in t.checks else "-" for name in names]
        header = ["stage", "preset", "blocks", "delta", "rank", "gate", "% extractable"]
        lines.append(markdown_table([*header, "utility", *names, "in budget"], body))
        return lines + self._time_lines()

    def _time_lines(self) -> list[str]:
        """Where the run's time went: its steps, the search's stages and its kinds of work."""
        if not self.seconds:
            return []

        def parts(seconds: dict[str, float]) -> str:
            return ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())

        steps = {k: v for k, v in self.seconds.items() if k != "total"}
        lines = ["", f"Time: {self.seconds.get('total', 0.0):.0f} s ({parts(steps)})."]
        stages, work = self.search_seconds.get("stages"), self.search_seconds.get("work")
        if stages:
            lines.append(f"The search by stage: {parts(stages)}.")
        if work:
            ranked = dict(sorted(work.items(), key=lambda kv: -kv[1]))
            lines.append(f"The search by kind of work (across the stages): {parts(ranked)}.")
        if self.report_seconds:
            lines.append(
                f"The report by part (its hand-over generations, in what it says and ordinary "
                f"prompts, apart too): {parts(self.report_seconds)}."
            )
        return lines

    def _example_lines(self) -> list[str]:
        """The side-by-side continuations, one --explain table, changed ordinary prompts."""
        lines: list[str] = []
        if self.examples:
            lines += [
                "",
                "## Held-out memorized prompts: the fine-tune, protected, the reference",
                "",
            ]
            for ex in self.examples:
                lines += [f"- prompt: `{_line(ex['prompt'])}`"]
                for key in (
                    "original",
                    "fine-tune",
                    "steered",
                    "reference",
                    "reference where open",
                    "reference at any step",
                ):
                    if key in ex:
                        lines.append(f"  - {key}: `{_line(ex[key])}`")
        if self.explanation:
            lines += [
                "",
                "## Where the gates opened: one held-out memorized prompt (gss.explain)",
                "",
                "```",
                self.explanation.rstrip(),
                "```",
            ]
        ordinary = self.after.get("ordinary_prompts")
        if ordinary and ordinary.get("changed"):
            lines += ["", "## Ordinary prompts whose continuation changed", ""]
            for ex in ordinary["changed"]:
                lines += [f"- prompt: `{_line(ex['prompt'])}`"]
                for key in ("fine-tune", "steered"):
                    lines.append(f"  - {key}: `{_line(ex[key])}`")
        return lines

    def write(self, directory: str | Path, overwrite: bool = False) -> list[Path]:
        """``protect.json``, ``protect.md``, ``frontier.png``, ``rows.png`` and, when a steer
        was chosen, the steer itself in ``steer/`` (an artifact or a stack)."""
        check_report_dir(directory, overwrite)  # "" is refused, not read as "."
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:  # an earlier run's report must not outlive a kill mid-write
            if (out / name).is_file():
                (out / name).unlink()
        written = []
        if self.steer is not None:
            written.append(self.steer.save_pretrained(out / "steer", overwrite=overwrite))
        elif (out / "steer").is_dir():  # an earlier run's steer (check_report_dir: gss's own)
            shutil.rmtree(out / "steer")  # would outlive a report that says nothing was chosen
        data = {
            **self.summary(),
            "split": {"tuning": self.tuning, "heldout": self.heldout},  # audit row indices
            "trials": [asdict(t) for t in self.trials],
            "examples": self.examples,
            "explanation": self.explanation,
        }
        (out / "protect.json").write_text(json.dumps(data, indent=2, default=float))
        (out / "protect.md").write_text(self.markdown())
        written += [out / "protect.json", out / "protect.md"]
        written += figures(self, out)
        record_outputs(out, OUTPUTS)
        return written


def _line(text: str) -> str:
    """One line of a Markdown list: newlines shown, backticks kept out of the code span."""
    return text.replace("\n", "\\n").replace("`", "'")


def _g(x: float) -> str:
    return f"{x:.4g}"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


def check_report_dir(directory: str | Path, overwrite: bool) -> None:
    """Refuse, before any work, a directory `Protection.write` could not write: its files
    there without ``overwrite``, or a ``steer/`` that is a file or holds other files."""
    check_outputs(directory, OUTPUTS, overwrite)
    steer = Path(directory) / "steer"
    if steer.is_symlink():  # a save would write through it, into an artifact outside
        raise GSSError(
            f"{steer} is a link (to {os.path.realpath(steer)}): protect writes its steer into "
            "a steer/ directory of its own. Remove the link, or choose another --out."
        )
    check_target(steer, overwrite)


def figures(result: Protection, out: Path) -> list[Path]:
    """``frontier.png`` (every point searched, utility against % extractable, and the budget)
    and ``rows.png`` (the held-out rows before and after)."""
    from gss.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in dict.fromkeys(t.stage for t in result.trials):
        pts = [t for t in result.trials if t.stage == stage]
        ax.scatter([t.utility for t in pts], [t.memorized for t in pts], label=stage, s=18)
    if result.chosen is not None:
        ax.scatter(
            [result.chosen.utility],
            [result.chosen.memorized],
            marker="*",
            s=200,
            color="black",
            label="chosen",
            zorder=5,
        )
    ax.axvline(result.budget["limit"], color="grey", linestyle="--", label="budget")
    ax.set_xlabel(result.budget["measure"])
    ax.set_ylabel("% of tuning rows extractable")
    ax.set_title("gss protect: the points searched")
    ax.legend(fontsize=8)
    paths = [save_figure(fig, out / "frontier.png")]
    fig, ax = plt.subplots(figsize=(6, 3))
    before = result.before.get("memorized", 0.0)
    after = result.after.get("memorized")
    if after is None:  # no steer was chosen: the rows stand as they were
        ax.bar(["before", "after (no steer)"], [before, before], color=["tab:red", "tab:grey"])
    else:
        ax.bar(["before", "after"], [before, after], color=["tab:red", "tab:green"])
    ax.set_ylabel("% of held-out memorized rows extractable")
    ax.set_ylim(0, 100)
    ax.set_title(f"{len(result.heldout)} held-out memorized rows")
    paths.append(save_figure(fig, out / "rows.png"))
    return paths


def _ordinary_line(ordinary: dict[str, Any]) -> str:
    """The held-out report's sentence on ordinary prompts: the steer, and (where measured) the
    reference where a gate opens; apart, the prompts where the fine-tune recites its data."""

    def shares(said: dict[str, Any]) -> str:
        line = f"{_pct(said['identical'])}"
        reciting = ordinary.get("reciting")
        if reciting:
            plain = ordinary["rows"] - reciting
            changed = _pct(said.get("changed_reciting"))
            line += (
                f" ({_pct(said.get('identical_not_reciting'))} of the {plain} that recite none "
                f"of the data; {changed} of the {reciting} that do changed)"
                if plain
                else f" (every one recites some of the data: {changed} of them changed)"
            )
        return line

    line = (
        f"Ordinary prompts: {shares(ordinary)} of {ordinary['rows']} greedy continuations "
        "(32 tokens) are the unsteered fine-tune's, word for word"
    )
    handed = ordinary.get("reference_where_open")
    if handed:
        line += (
            f"; with the reference's token where a gate opens (gss generate "
            f"--reference-where-open): {shares(handed)}"
        )
    alone = ordinary.get("signal_alone")
    if alone:
        line += f"; with the signal alone (--handoff-gates none): {shares(alone)}"
    return line + "."


def _late(quality: dict[str, Any], rule: str) -> str:
    """The end of a way of serving's sentence: its replies that open with the window's first
    tokens (`gss.evaluate.recital.recited_start`; older reports have none)."""
    late = quality.get(f"recited_start_{rule}")
    if late is None:
        return "."
    return (
        f"; {late:.1f}% of the replies open with {START_LEAD}+ of the window's first tokens "
        "more than the reference's own (it acts late; the fine-tune: "
        f"{quality['recited_start_fine_tune']:.1f}%)."
    )


def _handover_line(handover: dict[str, Any]) -> str:
    """Step 8's sentence: each hand-over rule on the tuning rows, and the one chosen."""

    def said(rule: str) -> str:
        r = handover["rules"].get(rule, {})
        kept, same, ppl = r.get("reproduced"), r.get("unchanged"), r.get("reference_ppl")
        replies = "" if ppl is None else f", replies' perplexity under the reference {ppl:.4g}"
        late = r.get("recited_start")
        start = "" if late is None else f" ({late:.1f}% open with the window's first tokens)"
        return (
            f"{'nan' if kept is None else f'{kept:.1f}'}% of the tuning rows reproduced{start}, "
            f"{_pct(same)} of ordinary prompts unchanged{replies}"
        )

    own = handover.get("reference_ppl")
    return (
        f"The hand-over rule (step 8, chosen on the {handover['tuning_rows']} tuning rows and "
        f"{handover['ordinary_prompts']} ordinary prompts of the thresholds' half): the steer's "
        f"gates: {said('steer')}; at any step: {said('none')}"
        + ("" if own is None else f" (the reference's own replies: {own:.4g})")
        + f"; chose **{handover['gates']}** (one at the target keeping "
        f"{_pct(handover['unchanged_goal'])} of ordinary prompts unchanged, fluent replies "
        "first, then the fewest opening with the window; else the fewest rows reproduced and "
        "prompts changed). gss generate "
        "--reference-where-open uses it."
    )
