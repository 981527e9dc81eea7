"""SteeringArtifact: the calibrated steer, its provenance, and how to attach it to a model.

Saved as a directory with ``gss_config.json`` (format version, model fingerprint, layer, hook
point, options, thresholds, token counts, timings) and ``gss_tensors.safetensors``, beside a
model card (``README.md``, which loading ignores). Nothing is pickled. Attaching checks the
fingerprint and refuses a model that differs, saying how. `push_to_hub` and loading by Hub id
are in `gss.artifact.hub`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from gss._version import __version__
from gss.artifact import describe as summary
from gss.artifact import hub
from gss.artifact.card import model_card
from gss.artifact.files import interrupted_saves, sha256_of, write_atomically
from gss.artifact.fingerprint import fingerprint_differences, model_fingerprint
from gss.config import CalibrationConfig, field_names
from gss.errors import GSSError, GSSWarning
from gss.file_names import CONFIG_NAME, STACK_NAME, TENSORS_NAME
from gss.hf.blocks import resolve_layer
from gss.hf.forward import check_models
from gss.statistics import soundness
from gss.steering.attach import SteerHandle, register, warn_if_steering
from gss.steering.gated import GatedSteer, count_real_tokens

# 1: options and measurements in one flat dict; 2: config and provenance apart, the tensors
# under a checksum; 3: the config and provenance too, every config field written (1, 2 read)
FORMAT_VERSION = 3


@dataclass(frozen=True)
class Provenance:
    """What calibration measured and on what: the audit trail beside the config (not options)."""

    fingerprint: dict[str, Any] = field(default_factory=dict)
    token_counts: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    threshold_rule: dict[str, Any] = field(default_factory=dict)
    gate_open_share: dict[str, Any] = field(default_factory=dict)
    memorized_rule: dict[str, Any] = field(default_factory=dict)
    solve: dict[str, Any] = field(default_factory=dict)
    jitter: float = 0.0  # the diagonal loading the solve used (it raises the asked one if needed)
    # what the statistics rest on, and what that says (gss.statistics.soundness)
    soundness: dict[str, Any] = field(default_factory=dict)
    hook_point: str = "block_output"
    gss_version: str = __version__
    extra: dict[str, Any] = field(default_factory=dict)


MEASURED = ("protect", "sweep")  # provenance.extra records of what one steer's options did


def _unmeasured(provenance: Provenance) -> Provenance:
    """``provenance`` without the records that measured the steer as it was (`MEASURED`):
    a steer with other options or thresholds must not carry them as its own."""
    if not any(key in provenance.extra for key in MEASURED):
        return provenance
    extra = {k: v for k, v in provenance.extra.items() if k not in MEASURED}
    return dataclasses.replace(provenance, extra=extra)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    return bool(a == b)


@dataclass(frozen=True)
class SteeringArtifact(hub.HubMixin):
    """A calibrated gated subspace steer for one layer of one model.

    Attributes:
        probe: (K, d) probe directions u_k.
        steer: (K, d) unit steer directions v_k.
        thresholds: (K,) gate thresholds eps_k.
        offset: (K,) subtracted from the probe response (U mu when probes are centred).
        singular_values: (K,) of the whitened memorization matrix.
        config: the options it was calibrated with (`gss.CalibrationConfig`); the ones
            that say how it is applied (delta, rank, gate, coefficient, ridge_delta) can be
            changed with `with_options`.
        provenance: what calibration measured (`Provenance`).
        condition: (d,) the discriminant gate's condition direction (`gss.solve.condition`),
            with ``condition_threshold``; None unless calibrated with ``gate="discriminant"``.
    """

    probe: Tensor
    steer: Tensor
    thresholds: Tensor
    offset: Tensor
    singular_values: Tensor
    config: CalibrationConfig
    provenance: Provenance = field(default_factory=Provenance)
    condition: Tensor | None = None
    condition_threshold: float | None = None

    def __post_init__(self) -> None:
        check_tensors(self)

    @property
    def rank(self) -> int:
        return int(self.probe.shape[0])

    @property
    def identity(self) -> tuple[int | None, str]:
        """What tells this steer from another: its block and a digest of its probe directions.
        The same artifact loaded twice (two objects) has the same identity, so attaching it
        again warns (`gss.steering.attach.warn_if_steering`), and a stack refuses it twice."""
        probe = self.probe.detach().float().contiguous().cpu().numpy()
        return self.config.layer, hashlib.sha256(probe.tobytes()).hexdigest()[:16]

    @property
    def layer(self) -> int:
        assert self.config.layer is not None  # set by calibration
        return self.config.layer

    def __repr__(self) -> str:  # one line, not the tensors
        return summary.short_repr(self)

    def __eq__(self, other: object) -> bool:
        """The same fields, each tensor of the same dtype and shape with equal values (the
        generated ``==`` would ask a tensor for its truth value)."""
        if type(other) is not type(self):
            return NotImplemented
        return all(
            _same(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
        )

    __hash__ = object.__hash__  # by identity: equal artifacts may hold distinct tensors

    def describe(self) -> str:
        """A report for a person: the model it was made for, the block and strength, the
        memorized share, how often the gates open on general text, what the solve did."""
        return summary.describe(self)

    def with_options(self, **changes: Any) -> SteeringArtifact:
        """A copy with other options. ``delta`` rescales probes, thresholds and offset by
        sqrt(new/old), exactly what recalibrating with that delta would give; ``gate``,
        ``coefficient`` and ``ridge_delta`` just change how the steer is applied; ``rank``
        keeps the first K directions."""
        allowed = {"delta", "rank", "gate", "coefficient", "ridge_delta"}
        unknown = set(changes) - allowed
        if unknown:
            raise GSSError(f"unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed)}.")
        updates = {k: v for k, v in changes.items() if v is not None}
        k = updates.get("rank")
        if isinstance(k, int) and not isinstance(k, bool) and not 1 <= k <= self.rank:
            raise GSSError(f"rank must be in 1..{self.rank} for this artifact, got {k}.")
        config = self.config.replace(**updates)  # checks every value before any is used
        tensors = {
            "probe": self.probe,
            "thresholds": self.thresholds,
            "offset": self.offset,
            "steer": self.steer,
            "singular_values": self.singular_values,
        }
        if "delta" in updates:
            factor = (config.delta / self.config.delta) ** 0.5
            for name in ("probe", "thresholds", "offset"):
                tensors[name] = tensors[name] * factor
            if not all(bool(torch.isfinite(tensors[n]).all()) for n in ("probe", "offset")):
                raise GSSError(
                    f"delta={config.delta:g} is too large for this artifact: its probes, scaled "
                    f"by sqrt(delta / {self.config.delta:g}), overflow {self.probe.dtype}. Give "
                    "a smaller delta."
                )
        if "rank" in updates:
            tensors = {name: t[: config.rank] for name, t in tensors.items()}
        provenance = self.provenance
        shares = provenance.gate_open_share
        if "rank" in updates and shares.get("per_direction"):
            # the first K directions' shares still hold; their union was measured over all
            shares = {
                **shares,
                "per_direction": shares["per_direction"][: updates["rank"]],
                "union": shares["union"] if updates["rank"] == self.rank else None,
            }
            provenance = dataclasses.replace(provenance, gate_open_share=shares)
        if "rank" in updates and provenance.soundness:  # the kept directions' own evidence
            values = tensors["singular_values"].tolist()
            facts = soundness.for_rank(provenance.soundness, values, config.rank)
            provenance = dataclasses.replace(provenance, soundness=facts)
        if config != self.config:
            provenance = _unmeasured(provenance)
        return SteeringArtifact(
            config=config,
            provenance=provenance,
            condition=self.condition,
            condition_threshold=self.condition_threshold,
            **tensors,
        )

    def with_thresholds(
        self,
        thresholds: Tensor,
        rule: dict[str, Any],
        open_share: dict[str, Any] | None = None,
        condition_threshold: float | None = None,
    ) -> SteeringArtifact:
        """A copy with new gate thresholds (e.g. from :func:`gss.calibrate_thresholds`).
        ``open_share``: how often the new gates open on general tokens, as measured where
        they were set; without it the calibration's shares, which no longer hold, are dropped.
        ``condition_threshold``: the discriminant gate's new level (default: kept).
        """
        if thresholds.shape != self.thresholds.shape:
            raise GSSError(f"thresholds must have shape {tuple(self.thresholds.shape)}.")
        counts = dict(self.provenance.token_counts)  # the responses the gates were set on:
        counts.pop("threshold_samples", None)  # the new ones' count where it is known
        if open_share and isinstance(open_share.get("tokens"), int):
            counts["threshold_samples"] = open_share["tokens"]
        provenance = dataclasses.replace(
            _unmeasured(self.provenance),
            threshold_rule=rule,
            gate_open_share=dict(open_share or {}),
            token_counts=counts,
        )
        level = self.condition_threshold if condition_threshold is None else condition_threshold
        return dataclasses.replace(
            self,
            thresholds=thresholds.float().cpu(),
            provenance=provenance,
            condition_threshold=level,
        )

    def make_hook(self, track_gates: bool = False) -> GatedSteer:
        c = self.config
        return GatedSteer(
            self.probe,
            self.steer,
            self.thresholds,
            self.offset,
            gate=c.gate,
            coefficient=c.coefficient,
            delta=c.delta,
            ridge_delta=c.ridge_delta,
            track_gates=track_gates,
            condition=self.condition if c.gate == "discriminant" else None,
            condition_threshold=self.condition_threshold if c.gate == "discriminant" else None,
        )

    def check_model(self, model: nn.Module, strict: bool = True) -> None:
        """Refuse (or, with ``strict=False``, warn about) a model the artifact was not made for."""
        check_models(model)
        if not callable(getattr(model, "get_input_embeddings", None)):
            raise GSSError(
                f"a steer attaches to a causal language model (a transformers model, with input "
                f"embeddings and decoder blocks), got {type(model).__name__}."
            )
        actual = model_fingerprint(model, self.config.block_path)
        expected = self.provenance.fingerprint
        if not expected.get("block_weights") and actual.get("block_weights"):
            warnings.warn(
                "this steering artifact's fingerprint holds no entries of its blocks' weights "
                "(saved before gss fingerprinted every weight, or edited by hand): attaching "
                "checks the model's shape and embeddings only, so another fine-tune of the same "
                "base would not be refused. Calibrate again on this model for a full fingerprint.",
                GSSWarning,
                stacklevel=3,
            )
        diffs = fingerprint_differences(expected, actual)
        if diffs:
            message = (
                "this steering artifact was calibrated for another model: "
                + "; ".join(diffs)
                + ". Calibrate on this model, or (in Python) pass strict=False if you know the "
                "weights are the same model."
            )
            if strict:
                raise GSSError(message)
            warnings.warn(message, GSSWarning, stacklevel=3)

    def attach(
        self,
        model: nn.Module,
        *,
        strict: bool = True,
        track_gates: bool = False,
        **options: Any,
    ) -> SteerHandle:
        """Install the steer on ``model`` and return a removable handle.

        ``options`` (delta, rank, gate, coefficient, ridge_delta) override the artifact's. The
        steer runs inside the block's ``forward`` (``gss.steering.attach.SteeredForward``).
        ``track_gates`` counts how often each gate opens (`SteerHandle.gate_stats`) without
        changing the output.
        """
        artifact = self.with_options(**options) if options else self
        artifact.check_model(model, strict=strict)
        _, block = resolve_layer(model, artifact.layer, artifact.config.block_path)
        warn_if_steering(block, self.identity, "attaching it again")
        hook = artifact.make_hook(track_gates=track_gates)
        hook.origin = self.identity
        handle = register(block, hook, model)
        if track_gates:  # counted on real tokens only: shares that do not depend on padding
            handle.remove_with(count_real_tokens(model, hook))
        return handle

    def save_pretrained(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write ``gss_config.json``, ``gss_tensors.safetensors`` and the model card
        (``README.md``, `gss.artifact.card`) into ``directory``.

        The directory must be new, empty, or (with ``overwrite``) hold an artifact: nothing
        else is ever written into or deleted, and a README.md someone wrote or edited is kept.
        The save is atomic (`gss.artifact.files`).
        """
        card = model_card(self, str(directory))
        return write_atomically(directory, overwrite, self.write_into, card)

    def write_into(self, directory: Path) -> None:
        """Write both files into ``directory`` as they are (no checks, not atomic): the step
        `save_pretrained` and `gss.artifact.stack` run inside their temporary directory."""
        tensors = {
            "probe": self.probe.float().contiguous().cpu(),
            "steer": self.steer.float().contiguous().cpu(),
            "thresholds": self.thresholds.float().contiguous().cpu(),
            "offset": self.offset.float().contiguous().cpu(),
            "singular_values": self.singular_values.double().contiguous().cpu(),
        }
        if self.condition is not None and self.condition_threshold is not None:
            tensors["condition"] = self.condition.float().contiguous().cpu()
            tensors["condition_threshold"] = torch.tensor(
                [self.condition_threshold], dtype=torch.float64
            )

        save_file(tensors, str(directory / TENSORS_NAME), metadata={"format": "gss"})
        saved = {
            "format_version": FORMAT_VERSION,
            "gss_version": __version__,
            "tensors_sha256": sha256_of(directory / TENSORS_NAME),
            "config": self.config.to_dict(),
            "provenance": dataclasses.asdict(self.provenance),
        }
        saved["content_sha256"] = content_sha256(saved)
        (directory / CONFIG_NAME).write_text(json.dumps(saved, indent=2))

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        revision: str | None = None,
        token: str | bool | None = None,
    ) -> SteeringArtifact:
        """Load an artifact written by :meth:`save_pretrained` (format 2, or 1 before it) from
        its directory, or from a Hub repo id (``"org/name"``, at ``revision``) through the
        local Hub cache (`gss.artifact.hub`)."""
        path = hub.local_path(directory, revision, token)
        cfg_path, tensors_path = path / CONFIG_NAME, path / TENSORS_NAME
        if (path / STACK_NAME).is_file():
            raise GSSError(
                f"{directory} is a steering stack (several blocks saved together): load it with "
                "gss.load or SteeringStack.from_pretrained."
            )
        if not cfg_path.is_file() or not tensors_path.is_file():
            raise _not_an_artifact(path)
        raw, version = _config_file(cfg_path)
        if version == 1:
            config, provenance = _read_format_1(raw, path)
        elif version in (2, FORMAT_VERSION):
            config, provenance = _read_format_2(raw, path, version)
        else:
            raise GSSError(
                f"{path} has artifact format version {version}, this gss reads versions 1 to "
                f"{FORMAT_VERSION}. Re-calibrate, or install the gss version that wrote it "
                f"({raw.get('gss_version')})."
            )
        t = _tensors_file(path, raw, version, config)
        if version < FORMAT_VERSION:  # an old save, or a new one relabelled to skip the check
            warnings.warn(
                f"{path} is an artifact of format {version}, whose config no checksum covers: "
                "an edit of its layer, delta or target would not be detected. Save it again "
                f"(gss.load(...).save_pretrained) for format {FORMAT_VERSION}, which is sealed.",
                GSSWarning,
                stacklevel=2,
            )
        return cls(
            probe=t["probe"],
            steer=t["steer"],
            thresholds=t["thresholds"],
            offset=t["offset"],
            singular_values=t["singular_values"],
            config=config,
            provenance=provenance,
            condition=t.get("condition"),
            condition_threshold=(
                float(t["condition_threshold"].reshape(-1)[0])
                if "condition_threshold" in t and t["condition_threshold"].numel() == 1
                else None
            ),
        )


def _not_an_artifact(path: Path) -> GSSError:
    """What to say of a directory without both artifact files: which one is missing, and
    where the artifact may be instead (`gss protect`'s steer/, a save set aside)."""
    cfg_path, tensors_path = path / CONFIG_NAME, path / TENSORS_NAME
    missing = [p.name for p in (cfg_path, tensors_path) if not p.is_file()]
    lacks = "" if len(missing) == 2 or not path.is_dir() else f" ({missing[0]} is missing)"
    inner = path / "steer"  # gss protect's --out holds its artifact there
    hint = f" Did you mean {inner}?" if (inner / CONFIG_NAME).is_file() else ""
    hint = f" Did you mean {inner} (a stack)?" if (inner / STACK_NAME).is_file() else hint
    aside = interrupted_saves(path)
    if aside and not path.exists():
        hint = (
            f" An interrupted save set it aside in {aside[-1].parent}: saving there "
            "again restores it first, or rename that folder's artifact/ back."
        )
    return GSSError(
        f"{path} is not a gss artifact directory{lacks}: expected {CONFIG_NAME} and "
        f"{TENSORS_NAME} in it (written by SteeringArtifact.save_pretrained).{hint}"
    )


def _config_file(cfg_path: Path) -> tuple[dict[str, Any], int]:
    """The config file's JSON object and its format version; a file that is no JSON object
    or records no integer version is refused as damaged."""
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise GSSError(f"{cfg_path} is not valid JSON ({e}): the artifact is damaged.") from None
    if not isinstance(raw, dict):
        raise GSSError(f"{cfg_path} does not hold a JSON object: the artifact is damaged.")
    version = raw.get("format_version")
    if type(version) is not int:  # "2" (a string) or 2.0 is no version this gss wrote
        raise GSSError(
            f"{cfg_path}: format_version is {version!r}, not a version number: the "
            "artifact is damaged (or edited by hand). Save it again."
        )
    return raw, version


def _tensors_file(
    path: Path, raw: dict[str, Any], version: int, config: CalibrationConfig
) -> dict[str, Tensor]:
    """The tensors file's tensors, refused where the file is damaged, is not the one the
    config was saved with (its SHA-256), lacks a tensor, or does not match the config's rank."""
    cfg_path, tensors_path = path / CONFIG_NAME, path / TENSORS_NAME
    try:  # before the checksum: a damaged file is named damaged, not from another save
        t = load_file(str(tensors_path))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise GSSError(f"{tensors_path} does not load ({e}): the artifact is damaged.") from None
    recorded = raw.get("tensors_sha256")
    if version >= 2 and not isinstance(recorded, str):
        raise GSSError(
            f"{cfg_path} records no SHA-256 of {TENSORS_NAME} (tensors_sha256 is "
            f"{recorded!r}): nothing ties the tensors to this config, so the artifact is "
            "refused. Save it again from the object that has both (gss.load of the original)."
        )
    if recorded is not None and recorded != sha256_of(tensors_path):
        raise GSSError(
            f"{path}: {TENSORS_NAME} is not the file {CONFIG_NAME} was saved with (its "
            "SHA-256 differs): the two files come from different saves. Save the artifact "
            "again, or copy both files of one save."
        )
    missing = sorted({"probe", "steer", "thresholds", "offset", "singular_values"} - set(t))
    if missing:
        raise GSSError(f"{tensors_path} lacks the tensors {missing}: the artifact is damaged.")
    if config.layer is None or config.rank != t["probe"].shape[0]:
        raise GSSError(
            f"{cfg_path} records layer {config.layer} and rank {config.rank}, and its tensors "
            f"hold {t['probe'].shape[0]} directions: the artifact is damaged (a config needs "
            "the block it steers and the rank of its tensors)."
        )
    return t


def _warn_unknown(path: Path, keys: set[str]) -> None:
    if keys:
        warnings.warn(
            f"{path}: ignored unknown artifact entries {sorted(keys)} (written by a newer gss?)",
            GSSWarning,
            stacklevel=4,
        )


def _provenance(values: Any, path: Path) -> Provenance:
    """The provenance a config file recorded; an entry of the wrong JSON type (a hand edit, a
    damaged file) is refused here rather than failing later, deep in a report."""
    where = path / CONFIG_NAME
    if not isinstance(values, dict):
        raise GSSError(f"{where}: its provenance is not a JSON object: the artifact is damaged.")
    defaults = Provenance()
    known = {f.name for f in dataclasses.fields(Provenance)}
    _warn_unknown(path, set(values) - known)
    for name in sorted(known & set(values)):
        value, expected = values[name], type(getattr(defaults, name))  # dict, float or str
        numeric = expected is float and isinstance(value, (int, float))
        if isinstance(value, bool) or not (numeric or isinstance(value, expected)):
            raise GSSError(
                f"{where}: provenance entry {name!r} is a {type(value).__name__}, not a "
                f"{expected.__name__}: the artifact is damaged."
            )
    if isinstance(values.get("fingerprint"), dict):
        _check_fingerprint(values["fingerprint"], where)
    return Provenance(**{k: v for k, v in values.items() if k in known})


# the fingerprint's entries and their JSON types (`gss.artifact.fingerprint.model_fingerprint`)
_FINGERPRINT_TYPES = {
    "architecture": str,
    "model_type": str,
    "name_or_path": str,
    "embedding_hash": str,
    "hidden_size": int,
    "num_layers": int,
    "vocab_size": int,
}


def _numbers(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    )


def _check_fingerprint(fingerprint: dict[str, Any], where: Path) -> None:
    """Refuse a fingerprint entry of the wrong JSON type: attaching compares them with the
    model's, and a damaged one must be named damaged, not taken for another model (a vocab
    size "48" is not 48) nor end in a traceback."""
    wrong = [
        (name, "an int" if kind is int else "a string")
        for name, kind in _FINGERPRINT_TYPES.items()
        if fingerprint.get(name) is not None
        and (isinstance(fingerprint[name], bool) or not isinstance(fingerprint[name], kind))
    ]
    if not _numbers(fingerprint.get("embedding_sample", [])):
        wrong.append(("embedding_sample", "a list of numbers"))
    blocks = fingerprint.get("block_weights", [])
    if not isinstance(blocks, list) or not all(
        isinstance(b, dict) and all(_numbers(v) for v in b.values()) for b in blocks
    ):
        wrong.append(("block_weights", "a list of {tensor name: list of numbers}"))
    samples = fingerprint.get("blocks_sample", [])
    if not isinstance(samples, list) or not all(
        isinstance(b, dict) and isinstance(b.get("names", []), list) and _numbers(b.get("bits", []))
        for b in samples
    ):
        wrong.append(("blocks_sample", "a list of {names, bits}"))
    if wrong:
        name, kind = wrong[0]
        raise GSSError(
            f"{where}: fingerprint entry {name!r} is not {kind}: the artifact is damaged (or "
            "edited by hand). Calibrate again, or use an undamaged copy."
        )


def content_sha256(saved: dict[str, Any]) -> str:
    """The SHA-256 of what a format-3 config file says (its version, the tensors' checksum, the
    config and the provenance, as canonical JSON): an edited layer, delta or target, or a
    provenance from another save, no longer matches it."""
    content = {k: v for k, v in saved.items() if k not in ("content_sha256", "gss_version")}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_format_2(
    raw: dict[str, Any], path: Path, version: int = 2
) -> tuple[CalibrationConfig, Provenance]:
    """Formats 2 and 3; a format-3 file must hold every config field (no default fills a
    missing one: a GSS-TR artifact without its target would steer as the paper's) and match
    its own checksum."""
    known = {"format_version", "gss_version", "tensors_sha256", "config", "provenance"}
    if version >= 3:
        known.add("content_sha256")
    _warn_unknown(path, set(raw) - known)
    values = raw.get("config", {})
    if not isinstance(values, dict):
        raise GSSError(
            f"{path / CONFIG_NAME}: its config is not a JSON object: the artifact is damaged."
        )
    if version >= 3:
        missing = sorted(set(field_names()) - set(values))
        if missing:
            raise GSSError(
                f"{path / CONFIG_NAME}: its config lacks {missing}: the artifact is damaged "
                "(or edited by hand); a default in their place would steer otherwise than it "
                "was calibrated. Save it again."
            )
        if raw.get("content_sha256") != content_sha256(raw):
            raise GSSError(
                f"{path / CONFIG_NAME} does not match its own checksum (content_sha256): its "
                "config or provenance was changed after it was saved (a hand edit, or parts "
                "of two saves). Change an artifact with with_options(...) and save_pretrained, "
                "or save it again."
            )
    try:
        config = CalibrationConfig.from_dict(values)
    except GSSError as e:
        raise GSSError(f"{path}: its config does not load: {e}") from None
    return config, _provenance(raw.get("provenance", {}), path)


# Format 1 kept options and measurements in one flat dict.
_FORMAT_1_OPTIONS = (
    "layer",
    "rank",
    "delta",
    "gate",
    "coefficient",
    "ridge_delta",
    "centering",
    "block_path",
    "target",
    "gradient",
)


def _read_format_1(raw: dict[str, Any], path: Path) -> tuple[CalibrationConfig, Provenance]:
    """A format-1 artifact: the options it recorded become the config (the rules of the
    threshold and of the memorized tokens included), the rest its provenance."""
    options = {k: raw[k] for k in _FORMAT_1_OPTIONS if k in raw}
    rule = raw.get("threshold_rule") or {}
    if rule.get("kind") == "percentile":
        options["threshold_percentile"] = rule["percentile"]
    elif rule.get("kind") == "gate_share":
        options["gate_share"] = rule["target"]
    memorized = raw.get("memorized_rule") or {}
    if memorized.get("omega_threshold") is not None:
        options["omega_threshold"] = memorized["omega_threshold"]
    if memorized.get("quantile") is not None:
        options["memorized_quantile"] = memorized["quantile"]
    try:
        config = CalibrationConfig.from_dict(options)
    except GSSError as e:
        raise GSSError(f"{path}: its format-1 config does not load: {e}") from None
    rest = {k: v for k, v in raw.items() if k not in (*_FORMAT_1_OPTIONS, "format_version")}
    return config, _provenance(rest, path)


def require_artifact(value: Any, what: str) -> None:
    """Refuse, in ``what``, anything but one `SteeringArtifact` (a stack's blocks are one at a
    time: ``stack.artifacts[i]``)."""
    if not isinstance(value, SteeringArtifact):
        hint = (
            "one of its artifacts, stack.artifacts[i]"
            if hasattr(value, "artifacts")
            else ("gss.load(path) loads a saved one")
        )
        raise GSSError(
            f"{what} takes one SteeringArtifact, got {type(value).__name__}: give {hint}."
        )


def check_tensors(artifact: SteeringArtifact) -> None:
    """Refuse tensors no steer can run with: wrong shapes or dtypes, NaN or infinite
    directions, steers that are not unit vectors, NaN or negative thresholds. An infinite
    threshold is kept: that direction's gate never opens."""
    k, d = tuple(artifact.probe.shape) if artifact.probe.ndim == 2 else (0, 0)
    expected = {
        "probe": (k, d),
        "steer": (k, d),
        "thresholds": (k,),
        "offset": (k,),
        "singular_values": (k,),
    }
    for name, shape in expected.items():
        tensor = getattr(artifact, name)
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise GSSError(f"the artifact's {name} must be a floating-point tensor.")
        if k == 0 or d == 0 or tuple(tensor.shape) != shape:
            raise GSSError(
                f"the artifact's {name} has shape {tuple(tensor.shape)}; expected {shape} for "
                f"probe (K, d) = {tuple(artifact.probe.shape)}: the tensors do not belong together."
            )
        finite = tensor if name != "thresholds" else tensor[~torch.isinf(tensor)]
        if not bool(torch.isfinite(finite).all()):
            raise GSSError(
                f"the artifact's {name} holds NaN or infinite values: the calibration that made "
                "it failed (check the models' outputs for NaN) or the file is damaged."
            )
    _check_condition(artifact, d)
    if bool((artifact.thresholds < 0).any()):
        raise GSSError(
            f"the artifact has negative gate thresholds ({artifact.thresholds.tolist()}): a "
            "threshold is a level of |probe response|, >= 0 (inf: the gate never opens)."
        )
    norms = artifact.steer.double().norm(dim=-1)
    if bool(((norms - 1).abs() > 1e-3).any()):
        raise GSSError(
            f"the artifact's steer directions must be unit vectors; their norms are "
            f"{[round(v, 4) for v in norms.tolist()]}: the file is damaged or was edited."
        )


def _check_condition(artifact: SteeringArtifact, d: int) -> None:
    """The discriminant gate's condition: present exactly when some steer can use it, (d,),
    finite, with a finite threshold."""
    w, level = artifact.condition, artifact.condition_threshold
    if w is None or level is None:
        if artifact.config.gate == "discriminant":
            raise GSSError(
                "gate='discriminant' needs the artifact's condition direction, and this one has "
                "none: calibrate with gate='discriminant' (it is computed then), or pick "
                "another gate."
            )
        return
    if not isinstance(w, Tensor) or not w.is_floating_point() or tuple(w.shape) != (d,):
        shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise GSSError(
            f"the artifact's condition has shape {shape}; expected ({d},): the tensors do not "
            "belong together."
        )
    if not bool(torch.isfinite(w).all()) or not math.isfinite(level):
        raise GSSError(
            "the artifact's condition direction or threshold holds NaN or infinite values: the "
            "calibration that made it failed or the file is damaged."
        )
