"""The model card of a steering artifact: ``README.md``, what the Hub shows for its repo.

`save_pretrained` writes it beside the artifact (as PEFT does for an adapter) and `push_to_hub`
writes it again with the repo id in its examples. It says what a person needs before using a
steer they did not make: the model it steers, the block(s), the options, what it was calibrated
on, what was measured (when the artifact records it: `gss sweep --save`, `gss protect`) and how
to load it. Loading never reads it.

The card's last line records the SHA-256 of the text above it. gss replaces a ``README.md`` only
while that line still holds, that is, a card gss wrote and nobody edited since; a README someone
wrote or edited is kept (`gss.artifact.files`, `gss.artifact.hub`), never silently overwritten.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.config import HANDOFF_GATES

if TYPE_CHECKING:
    from gss.artifact.stack import Steer
    from gss.artifact.steering_artifact import SteeringArtifact

TAGS = ("gss", "steering", "memorization")
_SEAL = re.compile(r"<!-- gss model card, sha256 ([0-9a-f]{64}) of the text above[^\n]*-->\n?\Z")
# a Hub id as a card's base_model: "org/name" (a local path is not one)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_card(steer: Steer, location: str | None = None) -> str:
    """The card of ``steer`` (an artifact or a stack), sealed. ``location``: what its usage
    examples load (the Hub repo id, or the directory it is saved in)."""
    steers = members(steer)
    first = steers[0]
    fingerprint = first.provenance.fingerprint
    model = fingerprint.get("name_or_path") or None
    where = location or "DIR"
    stack = len(steers) > 1 or type(steer).__name__ == "SteeringStack"
    layers = [a.layer for a in steers]
    what = (
        f"steering stack (blocks {layers})" if stack else f"steering artifact (block {layers[0]})"
    )
    lines = [
        *_front_matter(model),
        f"# gss {what}" + (f" for {model}" if model else ""),
        "",
        "A Gated Subspace Steering (gss) "
        + (
            "stack of steers, one per block, each calibrated on the model steered by the ones "
            "before it and applied together."
            if stack
            else "artifact."
        )
        + " At inference it steers "
        + (f"`{model}`" if model else "the model it was calibrated on")
        + " away from reproducing its fine-tuning data verbatim (how far, where measured, is "
        "under Measured below): inside the block, each probe direction's gate opens where the "
        "hidden state's response to the probe passes a threshold set on general text, and "
        "there the steer direction is subtracted; every other token passes unchanged. It "
        "holds no model weights, only K probe and steer directions of the residual stream, "
        "their gate thresholds, and the record of how they were calibrated.",
        "",
        "## Model",
        "",
        *_model_lines(first),
        "",
        "## Steer",
        "",
        *_options_table(steers),
        "",
        "## Calibration data",
        "",
        *[line for a in steers for line in _data_lines(a, len(steers) > 1)],
        "",
        "## Measured",
        "",
        *_measured_lines(steers, where),
        "",
        "## Use",
        "",
        *_usage_lines(model, where),
        "",
    ]
    return seal("\n".join(lines))


def seal(text: str) -> str:
    """``text`` with the line that marks it a card gss wrote, unedited."""
    body = text if text.endswith("\n") else text + "\n"
    digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
    return (
        f"{body}<!-- gss model card, sha256 {digest} of the text above: gss rewrites this file "
        "while it is unedited; once edited, gss keeps it -->\n"
    )


def is_generated(text: str) -> bool:
    """Whether ``text`` is a card gss wrote that nobody edited since (its seal holds)."""
    found = _SEAL.search(text)
    if found is None:
        return False
    body = text[: found.start()]
    return hashlib.sha256(body.encode("utf-8")).hexdigest() == found.group(1)


def card_is_generated(path: Path) -> bool:
    """`is_generated` for a file; an unreadable one counts as someone's own."""
    try:
        return is_generated(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return False


def front_matter(text: str) -> str:
    """The YAML between a card's leading ``---`` lines ("" without one)."""
    if not text.startswith("---\n"):
        return ""
    return text[4:].split("\n---\n", 1)[0]


def members(steer: Steer) -> list[SteeringArtifact]:
    """The artifacts of ``steer``: a stack's members, or the artifact itself."""
    return list(getattr(steer, "artifacts", None) or (steer,))


def _yaml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML double-quoted scalar


def _front_matter(model: str | None) -> list[str]:
    lines = ["---", "library_name: gss", "tags:", *(f"- {tag}" for tag in TAGS)]
    if model and _HUB_ID.fullmatch(model) and not Path(model).exists():
        lines.append(f"base_model: {_yaml(model)}")  # the Hub links the card to the model
    return [*lines, "---", ""]


def _model_lines(artifact: SteeringArtifact) -> list[str]:
    f = artifact.provenance.fingerprint
    if not f:
        return ["The model it was calibrated on is not recorded in this artifact."]
    name = f.get("name_or_path")
    lines = [
        f"- Steers: {f'`{name}`' if name else 'a model whose name was not recorded'} "
        f"({f.get('architecture')}, {f.get('model_type')}, {f.get('num_layers')} decoder blocks, "
        f"hidden size {f.get('hidden_size')}, vocabulary {f.get('vocab_size')}).",
    ]
    reference = artifact.provenance.extra.get("reference")
    if isinstance(reference, str) and reference:
        lines.append(f"- Reference (base) model of the memorization signal: `{reference}`.")
    lines.append(
        "- Attaching checks a fingerprint of the model (its shapes, a sample of its input "
        "embeddings and of every block's weights) and refuses another model, another fine-tune "
        "of the same base included."
    )
    return lines


def _variant(artifact: SteeringArtifact) -> str:
    c = artifact.config
    name = "GSS-TR" if c.target == "toward-reference" else "GSS"
    return f"{name} (target {c.target}, gradient {c.gradient})"


def _threshold_rule(artifact: SteeringArtifact) -> str:
    rule = artifact.provenance.threshold_rule
    if rule.get("kind") == "percentile":
        return f"p{rule['percentile']:g} of general tokens"
    if rule.get("kind") == "gate_share":
        return f"union open share {rule.get('target')}"
    c = artifact.config
    if c.gate_share is not None:
        return f"union open share {c.gate_share:g}"
    return f"p{c.threshold_percentile:g} of general tokens"


def _share(value: Any) -> str:
    return "not measured" if value is None else f"{100 * float(value):.1f}%"


def _open_on_general(a: SteeringArtifact) -> str:
    if a.config.gate == "none":
        return "every token (gate none)"
    return _share(a.provenance.gate_open_share.get("union"))


def _options_table(steers: list[SteeringArtifact]) -> list[str]:
    header = (
        "| block | variant | rank K | delta | gate | thresholds | coefficient | centering | "
        "gates open on general tokens |"
    )
    rows = [header, "|" + "---|" * 9]
    for a in steers:
        c = a.config
        values = ", ".join(f"{float(v):.4g}" for v in a.thresholds)
        rows.append(
            f"| {c.layer} | {_variant(a)} | {a.rank} | {c.delta:g} | {c.gate} | "
            f"{_threshold_rule(a)}: {values} | {c.coefficient} | {c.centering} | "
            f"{_open_on_general(a)} |"
        )
    block_path = steers[0].config.block_path
    if block_path:
        rows += ["", f"Decoder blocks read from `{block_path}`."]
    return rows


def _data_lines(artifact: SteeringArtifact, label: bool) -> list[str]:
    counts = artifact.provenance.token_counts
    prefix = f"- Block {artifact.layer}: " if label else "- "
    if not counts:
        return [f"{prefix}the calibration data is not recorded in this artifact."]
    rule = artifact.provenance.memorized_rule
    if rule.get("quantile") is not None:
        how = f"the top {100 * float(rule['quantile']):g}% of tokens by omega"
    elif rule.get("omega_threshold") is not None:
        how = f"omega above {rule['omega_threshold']:g} nats"
    else:
        how = "the memorized-token rule"
    trained = counts.get("trained")
    lines = [
        f"{prefix}{counts.get('tokens')} tokens in {counts.get('sequences')} sequences"
        + (
            f" ({trained} of them trained on)"
            if trained is not None and trained != counts.get("tokens")
            else ""
        )
        + f"; {counts.get('memorized')} marked memorized ({_share(counts.get('memorized_share'))}"
        f", {how}), {_sigma_tokens(artifact)} general tokens for Sigma_gen"
        + (
            f", {counts['threshold_samples']} general tokens' probe responses for the thresholds"
            if counts.get("threshold_samples") is not None
            else ""
        )
        + "."
    ]
    warnings = artifact.provenance.soundness.get("warnings") or []
    lines += [f"  - Calibration warned: {w}" for w in warnings]
    return lines


def _sigma_tokens(artifact: SteeringArtifact) -> Any:
    """The general tokens Sigma_gen was computed from: with held-out general text
    (``gen_texts``), those, not the calibration tokens left unmarked."""
    facts = artifact.provenance.soundness
    return facts.get("general_tokens", artifact.provenance.token_counts.get("general"))


def _measured_lines(steers: list[SteeringArtifact], where: str) -> list[str]:
    lines: list[str] = []
    extra = next((a.provenance.extra for a in steers if a.provenance.extra.get("protect")), {})
    record = extra.get("protect")
    if isinstance(record, dict):
        lines += _protect_lines(record)
    sweep = next((a.provenance.extra.get("sweep") for a in steers), None)
    if isinstance(sweep, dict):
        lines += _sweep_lines(sweep)
    if not lines:
        lines.append(
            "This artifact records no measurement of memorization or utility (those are "
            f"recorded by `gss protect` and `gss sweep --save`): `gss evaluate --steer {where}` "
            "measures both on your data."
        )
    lines.append(
        "The share of general tokens on which the gates open (above) was measured at "
        "calibration, on the general tokens the thresholds were set on: on other text it can "
        "be higher."
    )
    return lines


def _number(value: Any, digits: int = 4) -> str:
    return "?" if not isinstance(value, (int, float)) else f"{float(value):.{digits}g}"


def _percent_value(value: Any) -> str:
    return "?" if not isinstance(value, (int, float)) else f"{float(value):.1f}%"


def _protect_lines(record: dict[str, Any]) -> list[str]:
    before, after = record.get("before") or {}, record.get("after") or {}
    budget = record.get("budget") or {}
    measure = budget.get("measure", "utility")
    reached = "reached" if record.get("reached") else "not reached"
    return [
        f"`gss protect`, on {record.get('heldout_rows')} held-out memorized rows the search "
        "never saw:",
        "",
        "| | extractable rows | " + f"{measure} |",
        "|---|---|---|",
        f"| unsteered | {_percent_value(before.get('memorized'))} | "
        f"{_number(before.get('utility'))} |",
        f"| steered | {_percent_value(after.get('memorized'))} | {_number(after.get('utility'))} |",
        "",
        # "target" in artifacts saved before it was named max_extractable
        f"Target: at most {_number(record.get('max_extractable', record.get('target')))}% "
        f"extractable ({reached}); utility "
        f"limit {_number(budget.get('limit'))}.",
        "",
        *_held_out_shares(record.get("gate_open_share")),
        *_handoff_lines(record.get("handoff")),
    ]


def _handoff_lines(handoff: Any) -> list[str]:
    """The hand-over rule protect chose (its step 8), which `gss generate` uses."""
    if not isinstance(handoff, dict) or handoff.get("gates") not in HANDOFF_GATES:
        return []
    where = "where the steer's gates open" if handoff["gates"] == "steer" else "at any step"
    return [
        "With the reference kept at inference (`gss generate --reference-where-open REF`), it "
        f"speaks {where}: the rule `gss protect` chose on its tuning rows.",
        "",
    ]


def _held_out_shares(shares: Any) -> list[str]:
    """How often the gates opened on the general text protect held out of setting them."""
    if not isinstance(shares, dict) or not shares:
        return []
    measured = ", ".join(f"{_share(v)} of {name}" for name, v in shares.items())
    return [
        f"On general text held out of setting the thresholds, the gates opened on {measured}.",
        "",
    ]


def _sweep_lines(sweep: dict[str, Any]) -> list[str]:
    options = sweep.get("options") or {}
    shown = ", ".join(f"{k} {v}" for k, v in options.items() if v is not None)
    ppl, base = sweep.get("perplexity"), sweep.get("unsteered_perplexity")
    change = (
        f" ({100 * (float(ppl) / float(base) - 1):+.1f}%)"
        if isinstance(ppl, (int, float)) and isinstance(base, (int, float)) and base
        else ""
    )
    return [
        f"`gss sweep` selected this point ({shown}) within a perplexity tolerance of "
        f"+{100 * float(sweep.get('tolerance') or 0):g}%: {_percent_value(sweep.get('memorized'))}"
        f" of the memorized rows still reproduced verbatim, held-out perplexity "
        f"{_number(ppl)} against {_number(base)} unsteered{change}.",
        "",
    ]


def _usage_lines(model: str | None, where: str) -> list[str]:
    name = model or "PATH/TO/THE/MODEL"
    return [
        "Install gss (the package `gated-subspace-steering`; from a clone of its repository: "
        "`pip install -e .`), then:",
        "",
        "```python",
        "import gss",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({_yaml(name)})",
        f"tokenizer = AutoTokenizer.from_pretrained({_yaml(name)})",
        f"artifact = gss.load({_yaml(where)})",
        'inputs = tokenizer("The account number is", return_tensors="pt")',
        "with gss.steer(model, artifact):  # steered inside, untouched after",
        "    ids = model.generate(**inputs, max_new_tokens=40, do_sample=False)",
        "print(tokenizer.decode(ids[0, inputs.input_ids.shape[1]:]))",
        "```",
        "",
        "```bash",
        f'gss generate --model {name} --steer {where} --prompt "The account number is" --compare',
        f"gss show {where}   # what it steers, how it was calibrated, its gates",
        "```",
        "",
        "A Hub id loads through the local Hub cache (`HF_HUB_CACHE`), so with `HF_HUB_OFFLINE=1` "
        "it loads without the network once it has been downloaded.",
    ]
