"""SteeringArtifact: the calibrated steer, its provenance, and how to attach it to a model.

Saved as a directory with ``gss_config.json`` (format version, model fingerprint, layer, hook
point, options, thresholds, token counts, timings) and ``gss_tensors.safetensors``. Nothing is
pickled. Attaching checks the fingerprint and refuses a model that differs, saying how.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from gss import __version__
from gss.artifact import describe as summary
from gss.errors import GSSError, GSSWarning
from gss.hf.blocks import find_decoder_blocks, residual_width, resolve_layer
from gss.hf.forward import input_embedding_values, vocab_size
from gss.steering.gated import COEFFICIENT_MODES, GATE_MODES, GatedSteer, SteerHandle, register

if TYPE_CHECKING:
    from typing_extensions import Buffer

FORMAT_VERSION = 1
CONFIG_NAME = "gss_config.json"
TENSORS_NAME = "gss_tensors.safetensors"
_SAMPLE = 8  # embedding sample: _SAMPLE x _SAMPLE entries


def model_fingerprint(model: nn.Module, block_path: str | None = None) -> dict[str, Any]:
    """Identify a model by shape and by a sample of its input embedding.

    The sample is compared with a tolerance, so the same weights in float32, bfloat16 or
    float16 match, while another model does not.
    """
    emb = input_embedding_values(model).detach()
    rows = torch.linspace(0, emb.shape[0] - 1, _SAMPLE).long().to(emb.device)
    cols = torch.linspace(0, emb.shape[1] - 1, _SAMPLE).long().to(emb.device)
    sample = emb[rows][:, cols].float().cpu()
    hash_rows = torch.linspace(0, emb.shape[0] - 1, min(256, emb.shape[0])).long().to(emb.device)
    sampled = emb[hash_rows].to(torch.bfloat16).view(torch.int16).cpu().numpy()
    # numpy's stubs declare the buffer protocol of arrays only for Python >= 3.12
    digest = hashlib.sha256(cast("Buffer", sampled))
    config = getattr(model, "config", None)
    return {
        "architecture": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "hidden_size": residual_width(model),
        "num_layers": len(find_decoder_blocks(model, block_path)),
        "vocab_size": vocab_size(model),
        "embedding_sample": [round(v, 6) for v in sample.flatten().tolist()],
        "embedding_hash": digest.hexdigest()[:16],
    }


def fingerprint_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable list of what differs between two fingerprints (empty if they match)."""
    diffs = []
    for key in ("model_type", "hidden_size", "num_layers", "vocab_size"):
        if expected.get(key) != actual.get(key):
            diffs.append(f"{key}: artifact {expected.get(key)!r}, model {actual.get(key)!r}")
    a = torch.tensor(expected.get("embedding_sample", []))
    b = torch.tensor(actual.get("embedding_sample", []))
    if a.shape == b.shape and a.numel():
        rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
        if rel > 2e-2:
            diffs.append(f"input embeddings differ (relative difference {rel:.3f} on a sample)")
    return diffs


@dataclass(frozen=True)
class SteeringConfig:
    """Everything needed to re-apply and to audit an artifact (serialised to JSON)."""

    layer: int
    rank: int
    delta: float
    gate: str = "hard"
    coefficient: str = "projection"
    ridge_delta: float | None = None
    centering: str = "covariance"
    hook_point: str = "block_output"
    block_path: str | None = None
    threshold_rule: dict[str, Any] = field(default_factory=dict)
    gate_open_share: dict[str, Any] = field(default_factory=dict)
    memorized_rule: dict[str, Any] = field(default_factory=dict)
    target: str = "loglik"
    gradient: str = "summed"
    token_counts: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    jitter: float = 0.0
    solve: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    gss_version: str = __version__
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SteeringArtifact:
    """A calibrated gated subspace steer for one layer of one model.

    Attributes:
        probe: (K, d) probe directions u_k.
        steer: (K, d) unit steer directions v_k.
        thresholds: (K,) gate thresholds eps_k.
        offset: (K,) subtracted from the probe response (U mu when probes are centred).
        singular_values: (K,) of the whitened memorization matrix.
        config: provenance and options.
    """

    probe: Tensor
    steer: Tensor
    thresholds: Tensor
    offset: Tensor
    singular_values: Tensor
    config: SteeringConfig

    @property
    def rank(self) -> int:
        return int(self.probe.shape[0])

    @property
    def layer(self) -> int:
        return self.config.layer

    def __repr__(self) -> str:  # one line, not the tensors
        return summary.short_repr(self)

    def describe(self) -> str:
        """A report for a person: the model it was made for, the block and strength, the
        memorized share, how often the gates open on general text, what the solve did."""
        return summary.describe(self)

    def with_options(self, **changes: Any) -> SteeringArtifact:
        """A copy with other options. ``delta`` rescales probes, thresholds and offset by
        sqrt(new/old), exactly what recalibrating with that delta would give; ``gate``,
        ``coefficient`` and ``ridge_delta`` just change how the steer is applied; ``rank``
        keeps the first K directions."""
        tensors = {
            "probe": self.probe,
            "thresholds": self.thresholds,
            "offset": self.offset,
            "steer": self.steer,
            "singular_values": self.singular_values,
        }
        if "delta" in changes and changes["delta"] is not None:
            new = float(changes["delta"])
            if not new > 0:
                raise GSSError(f"delta must be > 0, got {new}.")
            factor = (new / self.config.delta) ** 0.5
            for name in ("probe", "thresholds", "offset"):
                tensors[name] = tensors[name] * factor
        if changes.get("rank") is not None:
            k = int(changes["rank"])
            if not 1 <= k <= self.rank:
                raise GSSError(f"rank must be in 1..{self.rank} for this artifact, got {k}.")
            tensors = {name: t[:k] for name, t in tensors.items()}
        if changes.get("gate") is not None and changes["gate"] not in GATE_MODES:
            raise GSSError(f"gate must be one of {GATE_MODES}, got {changes['gate']!r}.")
        if changes.get("coefficient") is not None and changes["coefficient"] not in (
            COEFFICIENT_MODES
        ):
            raise GSSError(
                f"coefficient must be one of {COEFFICIENT_MODES}, got {changes['coefficient']!r}."
            )
        allowed = {"delta", "rank", "gate", "coefficient", "ridge_delta"}
        unknown = set(changes) - allowed
        if unknown:
            raise GSSError(f"unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed)}.")
        updates = {k: v for k, v in changes.items() if v is not None}
        shares = self.config.gate_open_share
        if "rank" in updates and shares.get("per_direction"):
            # the first K directions' shares still hold; their union was measured over all
            updates["gate_open_share"] = {
                **shares,
                "per_direction": shares["per_direction"][: updates["rank"]],
                "union": shares["union"] if updates["rank"] == self.rank else None,
            }
        config = dataclasses.replace(self.config, **updates)
        return SteeringArtifact(config=config, **tensors)

    def with_thresholds(
        self,
        thresholds: Tensor,
        rule: dict[str, Any],
        open_share: dict[str, Any] | None = None,
    ) -> SteeringArtifact:
        """A copy with new gate thresholds (e.g. from :func:`gss.calibrate_thresholds`).
        ``open_share``: how often the new gates open on general tokens, as measured where
        they were set; without it the calibration's shares, which no longer hold, are dropped.
        """
        if thresholds.shape != self.thresholds.shape:
            raise GSSError(f"thresholds must have shape {tuple(self.thresholds.shape)}.")
        config = dataclasses.replace(
            self.config, threshold_rule=rule, gate_open_share=dict(open_share or {})
        )
        return dataclasses.replace(self, thresholds=thresholds.float().cpu(), config=config)

    def make_hook(
        self, track_gates: bool = False, cpu_kernel: bool = False, cuda_kernel: bool = False
    ) -> GatedSteer:
        c = self.config
        return GatedSteer(
            self.probe,
            self.steer,
            self.thresholds,
            self.offset,
            gate=c.gate,  # type: ignore[arg-type]
            coefficient=c.coefficient,  # type: ignore[arg-type]
            delta=c.delta,
            ridge_delta=c.ridge_delta,
            track_gates=track_gates,
            cpu_kernel=cpu_kernel,
            cuda_kernel=cuda_kernel,
        )

    def check_model(self, model: nn.Module, strict: bool = True) -> None:
        """Refuse (or, with ``strict=False``, warn about) a model the artifact was not made for."""
        actual = model_fingerprint(model, self.config.block_path)
        diffs = fingerprint_differences(self.config.fingerprint, actual)
        if diffs:
            message = (
                "this steering artifact was calibrated for another model: "
                + "; ".join(diffs)
                + ". Calibrate on this model, or pass strict=False if you know the weights "
                "are the same model."
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
        cpu_kernel: bool = False,
        cuda_kernel: bool = False,
        **options: Any,
    ) -> SteerHandle:
        """Install the steer on ``model`` and return a removable handle.

        ``options`` (delta, rank, gate, coefficient, ridge_delta) override the artifact's.
        ``cpu_kernel=True`` steers CPU decode steps (float32, bfloat16, float16) with one
        compiled C++ function (built on first use: a C++ compiler and ninja) instead of three
        PyTorch ops (five with a 16-bit model's casts), which
        matters on small models (see ``gss.steering.cpu_kernel``). Either way the steer runs inside the
        block's ``forward`` (``gss.steering.gated.SteeredForward``). ``cuda_kernel=True`` does the same
        on a GPU with one Triton kernel instead of five (``gss.steering.cuda_kernel``). With
        ``track_gates`` every call runs the checked path, which counts the gates, so neither
        has an effect there.
        """
        artifact = self.with_options(**options) if options else self
        artifact.check_model(model, strict=strict)
        _, block = resolve_layer(model, artifact.config.layer, artifact.config.block_path)
        hook = artifact.make_hook(
            track_gates=track_gates, cpu_kernel=cpu_kernel, cuda_kernel=cuda_kernel
        )
        return register(block, hook, model)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``gss_config.json`` and ``gss_tensors.safetensors`` into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {
            "probe": self.probe.float().contiguous().cpu(),
            "steer": self.steer.float().contiguous().cpu(),
            "thresholds": self.thresholds.float().contiguous().cpu(),
            "offset": self.offset.float().contiguous().cpu(),
            "singular_values": self.singular_values.double().contiguous().cpu(),
        }
        save_file(tensors, str(out / TENSORS_NAME), metadata={"format": "gss"})
        (out / CONFIG_NAME).write_text(json.dumps(dataclasses.asdict(self.config), indent=2))
        return out

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> SteeringArtifact:
        """Load an artifact written by :meth:`save_pretrained`."""
        path = Path(directory)
        cfg_path, tensors_path = path / CONFIG_NAME, path / TENSORS_NAME
        if not cfg_path.is_file() or not tensors_path.is_file():
            raise GSSError(
                f"{path} is not a gss artifact directory: expected {CONFIG_NAME} and "
                f"{TENSORS_NAME} in it (written by SteeringArtifact.save_pretrained)."
            )
        raw = json.loads(cfg_path.read_text())
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise GSSError(
                f"{path} has artifact format version {version}, this gss reads version "
                f"{FORMAT_VERSION}. Re-calibrate, or install the gss version that wrote it "
                f"({raw.get('gss_version')})."
            )
        known = {f.name for f in dataclasses.fields(SteeringConfig)}
        config = SteeringConfig(**{k: v for k, v in raw.items() if k in known})
        t = load_file(str(tensors_path))
        return cls(
            probe=t["probe"],
            steer=t["steer"],
            thresholds=t["thresholds"],
            offset=t["offset"],
            singular_values=t["singular_values"],
            config=config,
        )


def load(directory: str | Path) -> SteeringArtifact:
    """Load a saved :class:`SteeringArtifact`."""
    return SteeringArtifact.from_pretrained(directory)


@contextmanager
def steer(model: nn.Module, artifact: SteeringArtifact, **options: Any) -> Iterator[SteerHandle]:
    """``with gss.steer(model, artifact): ...`` steers inside the block and never after it."""
    handle = artifact.attach(model, **options)
    try:
        yield handle
    finally:
        handle.remove()
