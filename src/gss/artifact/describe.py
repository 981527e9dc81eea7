"""A steering artifact told in words: what it steers, how it was calibrated, what it measured.

The config and provenance hold everything an audit needs, but as nested JSON; `describe`
prints the parts a user checks before deploying a steer (the model it was made for, the
block, the strength, how often the gates open on general text, the memorized share, what the
solve did) and `short_repr` the one line that ``repr`` shows instead of the tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gss.errors import GSSError

if TYPE_CHECKING:
    from gss.artifact.steering_artifact import SteeringArtifact


def _numbers(values: Any, digits: int = 4) -> str:
    return ", ".join(f"{float(v):.{digits}g}" for v in values)


def _percent(share: Any) -> str:
    return "?" if share is None else f"{100 * float(share):.1f}%"


def open_share(artifact: SteeringArtifact) -> str | None:
    """How often the steer acts on general tokens, in words: where the gates' union opens as
    calibration measured it, or on every token when it is ungated (``gate="none"``: the
    thresholds, and what they measured, apply only once a gate is set with
    ``with_options(gate=...)``)."""
    if artifact.config.gate == "none":
        return "steers every token (gate none)"
    shares = artifact.provenance.gate_open_share
    if shares.get("condition") is not None:  # the discriminant gate: one condition for all
        return f"the gate opens on {_percent(shares['condition'])} of general tokens"
    union = shares.get("union")
    return None if union is None else f"gates open on {_percent(union)} of general tokens"


def short_repr(artifact: SteeringArtifact) -> str:
    c, m = artifact.config, artifact.provenance
    model = m.fingerprint.get("architecture", "?")
    share = open_share(artifact)
    gates = "" if share is None else f", {share}"
    return (
        f"SteeringArtifact(model={model}, layer={c.layer}, rank={artifact.rank}, "
        f"d={artifact.probe.shape[-1]}, delta={c.delta:g}, gate={c.gate!r}, "
        f"coefficient={c.coefficient!r}{gates})"
    )


def _model_line(fingerprint: dict[str, Any]) -> str:
    if not fingerprint:
        return "model: not recorded"
    name = fingerprint.get("name_or_path")
    return (
        f"model: {fingerprint.get('architecture')} ({fingerprint.get('model_type')}), "
        f"{fingerprint.get('num_layers')} blocks, d = {fingerprint.get('hidden_size')}, "
        f"vocabulary {fingerprint.get('vocab_size')}" + (f", from {name}" if name else "")
    )


def _threshold_lines(artifact: SteeringArtifact) -> list[str]:
    rule = artifact.provenance.threshold_rule
    if rule.get("kind") == "percentile":
        how = f"each direction's {rule['percentile']:g}th percentile on general tokens"
    elif rule.get("kind") == "gate_share":
        how = f"one level set for a union share of {_percent(rule.get('target'))}"
    else:
        how = str(rule) if rule else "rule not recorded"
    shares = artifact.provenance.gate_open_share
    lines = [f"thresholds: {_numbers(artifact.thresholds)} ({how})"]
    if artifact.config.gate == "none":
        lines.append(
            "gate none: every token is steered (the thresholds above, and the shares below, "
            "apply once a gate is set)"
        )
    if artifact.condition_threshold is not None:
        lines.append(
            f"condition (the discriminant gate: every direction at once): w . h > "
            f"{artifact.condition_threshold:.4g}"
        )
    if shares.get("condition") is not None:
        lines.append(
            f"gates, on {shares.get('tokens')} general tokens: the condition opens on "
            f"{_percent(shares['condition'])}"
        )
    elif shares:
        per_direction = ", ".join(map(_percent, shares.get("per_direction", [])))
        union = shares.get("union")
        lines.append(
            f"gates, on {shares.get('tokens')} general tokens: "
            + ("" if union is None else f"any open on {_percent(union)}, ")
            + f"each open on {per_direction}"
        )
    return lines


def _reply_lines(replies: dict[str, Any] | None) -> list[str]:
    """omega on the replies of the conversations checked and on their other tokens
    (`gss.signal.replies`)."""
    if not replies:
        return []
    other = replies.get("other_omega_mean")
    return [
        f"omega on {replies.get('rows')} conversations: {replies['reply_omega_mean']:.2f} nats a "
        f"reply token, " + ("no other token" if other is None else f"{other:.2f} a token outside")
    ]


def describe(artifact: SteeringArtifact) -> str:
    """Several lines for a person: the model, the steer, the calibration, the gates, the solve.
    A provenance whose values are of the wrong kind (an artifact edited and sealed again by
    hand) is said to be damaged, not a traceback from the formatting."""
    try:
        return _describe(artifact)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:
        raise GSSError(
            f"the artifact's provenance holds a value of the wrong kind ({err}): the artifact "
            "is damaged (or edited by hand). Calibrate again, or save it from a good copy."
        ) from None


def _describe(artifact: SteeringArtifact) -> str:
    c, m = artifact.config, artifact.provenance
    counts = m.token_counts
    block = f"block {c.layer}" + (f" of {c.block_path}" if c.block_path else "")
    lines = [
        f"gss steering artifact (written by gss {m.gss_version})",
        _model_line(m.fingerprint),
        f"steer: {block}, K = {artifact.rank}, delta = {c.delta:g}, gate {c.gate}, "
        f"coefficient {c.coefficient}, centering {c.centering}",
        f"calibration: target {c.target}, gradient {c.gradient}",
    ]
    if counts:
        lines.append(
            f"tokens: {counts.get('tokens')} in {counts.get('sequences')} sequences, "
            f"{counts.get('memorized')} memorized ({_percent(counts.get('memorized_share'))}"
            + (
                f"; of the {counts['trained']} trained on, the only ones that could be)"
                if counts.get("trained", counts.get("tokens")) != counts.get("tokens")
                else ")"
            )
            + (
                f", {counts.get('general')} not memorized (Sigma_gen: the held-out general "
                "text's tokens, below)"
                if m.soundness.get("general_from_calibration") is False
                else f", {counts.get('general')} general"
            )
        )
        lines += _reply_lines(counts.get("replies"))
    lines += _threshold_lines(artifact)
    lines.append(f"singular values (whitened M): {_numbers(artifact.singular_values)}")
    solve = m.solve
    if solve:
        how = solve.get("method", "?")
        if how == "truncated":
            settled = "settled" if solve.get("converged") else "NOT settled"
            how += f", {solve.get('power_iters')} subspace iterations, {settled}"
        lines.append(f"solve: {how}; Sigma_gen loaded by {m.jitter:.3g} on its diagonal")
    facts = m.soundness
    if facts:
        lines.append(
            f"statistics: {facts.get('general_tokens')} general tokens for d = "
            f"{facts.get('dimension')}, {facts.get('memorized_tokens')} memorized; last/first "
            f"singular value {facts.get('spectrum_ratio', 0.0):.2g}"
        )
        lines += [f"WARNING: {problem}" for problem in facts.get("warnings", [])]
    if m.timings:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in m.timings.items())
        lines.append(f"timings: {parts}")
    return "\n".join(lines)
