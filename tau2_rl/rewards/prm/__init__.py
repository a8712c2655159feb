"""PRM-Lite: a rule-based process reward, interpretable rules scored per assistant turn, no trainable parameters.

A τ² episode runs for dozens of turns and the outcome reward (τ²'s DB × COMMUNICATE) is a single bit at the end, so
GRPO cannot tell which turns helped. PRM-Lite adds dense, readable turn-level credit that pays for *progress*
(confirmed, grounded changes to the records and the facts reported about them) and charges for behaviour that is wrong
whatever the task. The rules read only the trajectory, never the task's gold actions or expected outcome; they are
calibrated on a labelled corpus of scripted behaviours (``corpus``) and on real agents' conversations
(``conversations``), and the report lives in docs/prm_lite.md. Two rule sets (``RULE_SETS``): ``v1`` (15 rules, the
scripted corpus) and ``v2`` (default: a domain policy's checks of every write where the domain's folder has them:
``vocabulary.DomainPolicy``). Two more (``REFERENCE_SETS``) are not
trajectory-only: ``reference`` scores progress against the task's gold actions (``reference``: privileged task
information, a training signal only, never an evaluation metric) and ``reference+v2`` adds v2 to it.

Modules: ``vocabulary`` (a domain's ids, look-ups, examples, policy checks), ``detectors`` (what is a placeholder, a
confirmation, an id), ``rules`` (the rule sets), ``reference`` (the gold-action terms), ``engine``
(``score_episode``), ``stats`` (fire rates, AUC, Spearman, within-group signal, calibration), ``corpus`` (the
behaviour corpus), ``conversations`` (importing real conversations), ``report`` (the generated docs and the command
line).
"""

from tau2_rl.rewards.prm.detectors import (
    asks_for_human,
    call_signature,
    declines_request,
    id_values,
    is_confirmation,
    is_placeholder,
    mentionable_values,
)
from tau2_rl.rewards.prm.engine import (
    DEFAULT_CLIP,
    PRM_RULE_SETS,
    REFERENCE_SETS,
    TRAINING_RULE_SET,
    PRMResult,
    score_episode,
)
from tau2_rl.rewards.prm.reference import REFERENCE_TERMS
from tau2_rl.rewards.prm.rules import (
    DEFAULT_RULE_SET,
    MAX_FREE_TOOL_CALLS,
    RULE_SETS,
    RULES,
    RULES_V1,
    RULES_V2,
    TRUNCATED_TURN_COST,
    Rule,
    TurnContext,
    UnknownRuleError,
    UnknownRuleSetError,
    get_rule,
    get_rule_set,
)
from tau2_rl.rewards.prm.stats import auc, episode_rule_stats, spearman, within_group_signal
from tau2_rl.rewards.prm.vocabulary import PrmTerms, Vocabulary, vocabulary

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_RULE_SET",
    "PRM_RULE_SETS",
    "REFERENCE_SETS",
    "REFERENCE_TERMS",
    "TRAINING_RULE_SET",
    "RULE_SETS",
    "RULES_V1",
    "RULES_V2",
    "UnknownRuleSetError",
    "get_rule_set",
    "within_group_signal",
    "PrmTerms",
    "Vocabulary",
    "vocabulary",
    "MAX_FREE_TOOL_CALLS",
    "RULES",
    "TRUNCATED_TURN_COST",
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
