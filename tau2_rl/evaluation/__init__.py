"""Evaluation of policies on τ² domains' tasks: metrics, resumable results files, comparisons.

- ``metrics``: pass^k, grouped / stratified pass^1 with bootstrap CIs, error rates, reasoning depth (one
  implementation, used by the evaluator, the summaries and compare mode);
- ``results``: the results.json schema, resume and config fingerprint, markdown summary;
- ``evaluator``: ``run_evaluation`` (``evaluate.py``): every selected task × sample through ``run_episodes``;
- ``compare``: ``run_compare`` (``evaluate.py --compare``): ablation table and plots from several results files;
- ``heldout``: ``HeldoutEvaluation``, the GRPO trainer's held-out pass^k at eval steps (same loop, format, metrics);

Names are imported lazily, so ``tau2_rl.evaluation.metrics`` loads without transformers or TRL.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompareError": "compare",
    "run_compare": "compare",
    "EvaluationError": "evaluator",
    "run_evaluation": "evaluator",
    "bootstrap_pass1": "metrics",
    "compute_metrics": "metrics",
    "generalization_pass1": "metrics",
    "pass_hat_k": "metrics",
    "pass_hat_k_task": "metrics",
    "ConfigMismatchError": "results",
    "ResultsError": "results",
    "read_results": "results",
}

__all__ = ["INPUT_ERRORS", *sorted(_EXPORTS)]


def input_errors() -> tuple[type[Exception], ...]:
    """Errors caused by bad input: evaluate.py reports their message (it names the thing) instead of a traceback."""
    from tau2_rl.domains import UnknownDomainError
    from tau2_rl.envs.data import DomainDataError
    from tau2_rl.envs.splits import SplitError
    from tau2_rl.run.hub import HubError

    from .compare import CompareError
    from .evaluator import EvaluationError
    from .results import ResultsError

    # ConnectionError: the LLM user's endpoint does not answer (EndpointUnreachableError). A judge that keeps failing
    # is not bad input (evaluate.py: exit 1, as for a failing user endpoint)
    return (EvaluationError, ResultsError, CompareError, HubError, SplitError, DomainDataError, UnknownDomainError,
            ConnectionError)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "INPUT_ERRORS":
        return input_errors()
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
