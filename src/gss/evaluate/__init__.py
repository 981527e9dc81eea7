"""Metrics for any HF causal LM (hooks attached or not): memorization and utility."""

from gss.evaluate.memorization import (
    BackdoorResult,
    MemorizationResult,
    backdoor_success,
    nk_memorization,
)
from gss.evaluate.utility import perplexity, token_accuracy

__all__ = [
    "BackdoorResult",
    "MemorizationResult",
    "backdoor_success",
    "nk_memorization",
    "perplexity",
    "token_accuracy",
]
