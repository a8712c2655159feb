"""PRM-Lite: a rule-based process reward, 15 interpretable rules scored per assistant turn, no trainable parameters.

An airline episode runs for dozens of turns and the outcome reward (τ²'s DB × COMMUNICATE) is a single bit at the
end, so GRPO cannot tell which turns helped. PRM-Lite adds dense, readable turn-level credit that pays for *progress*
(confirmed, grounded changes to the booking and the facts reported about them) and charges for behaviour that is wrong
whatever the task. The rules read only the trajectory, never the task's gold actions or expected outcome; they are
calibrated on a labelled corpus of scripted behaviours (``corpus``), and the report lives in docs/prm_lite.md.

Modules: ``detectors`` (what is a placeholder, a confirmation, an id), ``rules`` (the 15 rules), ``engine``
(``score_episode``), ``stats`` (fire rates, AUC, Spearman, calibration), ``corpus`` (the behaviour corpus),
``report`` (the generated docs and the command line).
"""

from airline_rl.rewards.prm.detectors import (
    EXAMPLE_VALUES,
    ID_ARGUMENT_NAMES,
    LOOKUP_TOOLS,
    VERIFIABLE_ID_NAMES,
    asks_for_human,
    call_signature,
    declines_request,
    id_values,
    is_confirmation,
    is_placeholder,
    mentionable_values,
)
from airline_rl.rewards.prm.engine import DEFAULT_CLIP, PRMResult, score_episode
from airline_rl.rewards.prm.rules import (
    MAX_FREE_TOOL_CALLS,
    RULES,
    TRUNCATED_TURN_COST,
    Rule,
    TurnContext,
    UnknownRuleError,
    get_rule,
)
from airline_rl.rewards.prm.stats import auc, episode_rule_stats, spearman

__all__ = [
    "DEFAULT_CLIP",
    "EXAMPLE_VALUES",
    "ID_ARGUMENT_NAMES",
    "LOOKUP_TOOLS",
    "MAX_FREE_TOOL_CALLS",
    "RULES",
    "TRUNCATED_TURN_COST",
    "VERIFIABLE_ID_NAMES",
    "PRMResult",
    "Rule",
    "TurnContext",
    "UnknownRuleError",
    "asks_for_human",
    "auc",
    "call_signature",
    "declines_request",
    "episode_rule_stats",
    "get_rule",
    "id_values",
    "is_confirmation",
    "is_placeholder",
    "mentionable_values",
    "score_episode",
    "spearman",
]
