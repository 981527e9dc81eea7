"""gss: remove verbatim memorization from fine-tuned language models at inference time.

Gated Subspace Steering calibrates, at one decoder layer, probe directions (when to act) and
steer directions (how to act) from a token-level memorization signal, and applies them inside
that block's forward: the steer is subtracted only on tokens whose probe response passes a
threshold.
"""

__version__ = "0.1.0"

from gss.artifact.steering_artifact import SteeringArtifact, SteeringConfig, load, steer
from gss.calibrate import calibrate, calibrate_thresholds
from gss.errors import GSSError, GSSWarning
from gss.hf.adapters import adapters_off
from gss.hf.blocks import find_decoder_blocks
from gss.layer_scan import LayerScan, scan_layers
from gss.signal.omega import SignalStatistics, memorization_signal, signal_statistics
from gss.solve.whitened import ProbeSteer, solve_probe_steer
from gss.variants import VARIANTS, variant

__all__ = [
    "VARIANTS",
    "GSSError",
    "GSSWarning",
    "LayerScan",
    "ProbeSteer",
    "SignalStatistics",
    "SteeringArtifact",
    "SteeringConfig",
    "__version__",
    "adapters_off",
    "calibrate",
    "calibrate_thresholds",
    "find_decoder_blocks",
    "load",
    "memorization_signal",
    "scan_layers",
    "signal_statistics",
    "solve_probe_steer",
    "steer",
    "variant",
]
