"""Metrics for any HF causal LM (hooks attached or not): memorization and utility."""

from gss.evaluate.leaks import LeakReport, secrets_said
from gss.evaluate.memorization import (
    BackdoorResult,
    MemorizationResult,
    backdoor_success,
    nk_memorization,
)
from gss.evaluate.suite import EvaluationReport, deviation_score, evaluate_model
from gss.evaluate.sweep import SweepPoint, pareto_front, select_point, steering_sweep
from gss.evaluate.utility import perplexity, repetition, token_accuracy

__all__ = [
    "BackdoorResult",
    "EvaluationReport",
    "LeakReport",
    "MemorizationResult",
    "SweepPoint",
    "backdoor_success",
    "deviation_score",
    "evaluate_model",
    "nk_memorization",
    "pareto_front",
    "perplexity",
    "repetition",
    "secrets_said",
    "select_point",
    "steering_sweep",
    "token_accuracy",
]
