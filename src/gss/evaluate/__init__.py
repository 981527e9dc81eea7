"""Metrics for any HF causal LM (hooks attached or not): memorization and utility, and the
comparisons, tables and signal report the ``gss`` commands print and save; leaks under other
prompts than the row's own (`other_prompts`); lm-eval's tasks on a model unsteered and steered
(`lm_eval_steering`: lm-eval, an optional dependency, is imported only when called)."""

from gss.evaluate.compare import evaluate_steering, sweep_and_select
from gss.evaluate.inputs import EvaluationRows, SecretsCheck, evaluation_rows, secrets_check
from gss.evaluate.leaks import LeakReport, secrets_said
from gss.evaluate.lm_eval_bridge import (
    LMEvalComparison,
    LMEvalTasks,
    lm_eval_steering,
    lm_eval_tasks,
    run_lm_eval,
)
from gss.evaluate.memorization import (
    BackdoorResult,
    MemorizationResult,
    backdoor_success,
    nk_memorization,
)
from gss.evaluate.other_prompts import OtherPromptsReport, VariantLeaks, other_prompts
from gss.evaluate.signal_report import (
    SignalReport,
    omega_all_zero,
    omega_of_texts,
    signal_report,
)
from gss.evaluate.suite import EvaluationReport, deviation_score, evaluate_model
from gss.evaluate.sweep import SweepPoint, pareto_front, select_point, steering_sweep
from gss.evaluate.tables import SteeringEvaluation, SweepResult
from gss.evaluate.utility import perplexity, repetition, token_accuracy

__all__ = [
    "BackdoorResult",
    "EvaluationReport",
    "EvaluationRows",
    "LMEvalComparison",
    "LMEvalTasks",
    "LeakReport",
    "MemorizationResult",
    "OtherPromptsReport",
    "SecretsCheck",
    "SignalReport",
    "SteeringEvaluation",
    "SweepPoint",
    "SweepResult",
    "VariantLeaks",
    "backdoor_success",
    "deviation_score",
    "evaluate_model",
    "evaluate_steering",
    "evaluation_rows",
    "lm_eval_steering",
    "lm_eval_tasks",
    "nk_memorization",
    "omega_all_zero",
    "omega_of_texts",
    "other_prompts",
    "pareto_front",
    "perplexity",
    "repetition",
    "run_lm_eval",
    "secrets_check",
    "secrets_said",
    "select_point",
    "signal_report",
    "steering_sweep",
    "sweep_and_select",
    "token_accuracy",
]
