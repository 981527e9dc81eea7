"""gss: remove verbatim memorization from fine-tuned language models at inference time.

Gated Subspace Steering calibrates, at one decoder layer, probe directions (when to act) and
steer directions (how to act) from a token-level memorization signal, and applies them inside
that block's forward: the steer is subtracted only on tokens whose probe response passes a
threshold. The pipeline, in the order data flows: `gss.signal` -> `gss.statistics` ->
`gss.solve` -> `gss.calibrate` -> `gss.artifact` -> `gss.steering` (docs/architecture.md).
"""

from gss import _startup
from gss._version import __version__

# in the gss command, a Ctrl-C while torch and transformers load is one line and exit 130
with _startup.interruptible():
    from gss.artifact.stack import SteeringStack, load, steer
    from gss.artifact.steering_artifact import Provenance, SteeringArtifact
    from gss.audit import AuditReport, audit
    from gss.calibrate import calibrate
    from gss.config import PRESETS, CalibrationConfig, RunOptions, Window, preset
    from gss.errors import GSSError, GSSWarning
    from gss.hf.adapters import adapters_off
    from gss.hf.blocks import find_decoder_blocks
    from gss.inference.explain import Explanation, explain
    from gss.inference.handoff import reference_where_open
    from gss.layer_scan import LayerScan, scan_layers
    from gss.protect import ProtectConfig, Protection, SearchSpace, protect
    from gss.signal.omega import SignalStatistics, memorization_signal, signal_statistics
    from gss.solve.thresholds import calibrate_thresholds
    from gss.solve.whitened import ProbeSteer, solve_probe_steer

__all__ = [
    "PRESETS",
    "AuditReport",
    "CalibrationConfig",
    "Explanation",
    "GSSError",
    "GSSWarning",
    "LayerScan",
    "ProbeSteer",
    "ProtectConfig",
    "Protection",
    "Provenance",
    "RunOptions",
    "SearchSpace",
    "SignalStatistics",
    "SteeringArtifact",
    "SteeringStack",
    "Window",
    "__version__",
    "adapters_off",
    "audit",
    "calibrate",
    "calibrate_thresholds",
    "explain",
    "find_decoder_blocks",
    "load",
    "memorization_signal",
    "preset",
    "protect",
    "reference_where_open",
    "scan_layers",
    "signal_statistics",
    "solve_probe_steer",
    "steer",
]
