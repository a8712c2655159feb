"""Tests for PRM-Lite (``tau2_rl.rewards.prm``): every rule fires and stays silent on real episode records.

The records come from driving ``DomainEnv`` episodes with hand-written assistant turns (user: ``mia_li_3668``, whose
profile lists reservations NO6JO3, AIXC49 and HKEG34 and the card ``credit_card_4421486``), so the rules are tested
on exactly what the environment records. Fast: no model, a few milliseconds per episode.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tau2_rl.domains import DOMAINS, get_domain
from tau2_rl.domains.airline.tools import TOOL_SCHEMAS
from tau2_rl.envs.episode import DomainEnv, EpisodeRecord
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.tool_calls import format_tool_call
from tau2_rl.envs.users.scripted import ScriptedUser
from tau2_rl.evaluation.prm_report import main, rules_markdown
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rewards.prm import (
    RULE_SETS,
    RULES,
    RULES_V1,
    RULES_V2,
    TRUNCATED_TURN_COST,
    PRMResult,
    declines_request,
    episode_rule_stats,
    get_rule,
    is_confirmation,
    is_placeholder,
    mentionable_values,
    vocabulary,
)
from tau2_rl.rewards.prm import score_episode as score_any_episode
from tau2_rl.rewards.prm.reference import REFERENCE_TERMS
from tau2_rl.rewards.prm.report import DOCS_END, DOCS_START

AIRLINE = get_domain("airline")
VOCAB = vocabulary(AIRLINE)


def score_episode(record: EpisodeRecord, **kwargs: Any) -> PRMResult:
    """PRM-Lite on an airline episode (every episode of this module is one)."""
    return score_any_episode(record, spec=AIRLINE, **kwargs)


DOCS = Path(__file__).resolve().parents[1] / "docs" / "prm_lite.md"


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE)


def user(text: str) -> tuple[str, str]:
    return ("user", text)


def call(name: str, **arguments: Any) -> str:
    return format_tool_call(name, arguments)


def play(env: DomainEnv, steps: list[str | tuple[str, str]], task_id: str = "1") -> EpisodeRecord:
    """Plays ``steps`` (assistant texts, or ``user(...)`` replies) on a fresh episode and returns its record."""
    episode = env.reset(task_id)
    for step in steps:
        if isinstance(step, tuple) and step[0] == "cut":
            episode.env_response(step[1], truncated=True)  # the turn ran out of token budget
        elif isinstance(step, tuple):
            episode.user_response(step[1])
        else:
            episode.env_response(step)
    return episode.record


HELLO = user("Hi, my user id is mia_li_3668.")
GUD_CALL = call("get_user_details", user_id="mia_li_3668")
GUD = "Let me look up your profile. " + GUD_CALL
GRD_CALL = call("get_reservation_details", reservation_id="NO6JO3")
GRD = "Let me check that reservation. " + GRD_CALL
BAD_GRD_CALL = call("get_reservation_details", reservation_id="ZZZ999")
BAD_GRD = "Checking the reservation. " + BAD_GRD_CALL
CANCEL = "Cancelling it now. " + call("cancel_reservation", reservation_id="NO6JO3")
ASK = "Shall I cancel reservation NO6JO3? (yes/no)"
TRANSFER = "I will transfer you. " + call("transfer_to_human_agents", summary="User needs help with a booking.")


def bags(payment_id: str) -> str:
    return "Updating your bags. " + call(
        "update_reservation_baggages", reservation_id="NO6JO3", total_baggages=2, nonfree_baggages=0,
        payment_id=payment_id,
    )  # fmt: skip


def calcs(n: int, start: int = 0) -> str:
    return "Let me compute a few things. " + "".join(
        call("calculate", expression=f"{i} + 1") for i in range(start, start + n)
    )


YES = user("Yes, please go ahead.")
CONFIRMED_CANCEL = [HELLO, GUD, GRD, ASK, YES, CANCEL]  # the honest way to cancel: look up, ask, get a yes, act
BARE_CANCEL_CALL = call("cancel_reservation", reservation_id="NO6JO3")
PASSENGERS = "Updating the passenger. " + call(
    "update_reservation_passengers",
    reservation_id="NO6JO3",
    passengers=[{"first_name": "Mia", "last_name": "Li", "dob": "1990-04-06"}],
)  # fmt: skip  (a dob one day off the record's 1990-04-05: a value nobody ever said)

# (rule, steps, turn index, expected count in that turn); expected 0 = the rule must not fire in that turn.
# Every rule of v1 has a firing case and its anti-hacking (silent) cases; V2_CASES does the same for every rule that
# v2 changed or added (the others are the same functions).
CASES: dict[str, tuple[str, list[Any], int, int]] = {
    # P1 placeholder_arguments
    "P1-template": ("P1", [HELLO, "Looking you up. " + call("get_user_details", user_id="<user_id>")], 0, 1),
    "P1-example-id": ("P1", [HELLO, "Looking you up. " + call("get_user_details", user_id="sara_doe_496")], 0, 1),
    "P1-nested-own-name": (
        "P1",
        [
            HELLO,
            GUD,
            GRD,
            "Changing the flight. "
            + call(
                "update_reservation_flights",
                reservation_id="NO6JO3",
                cabin="business",
                flights=[{"flight_number": "flight_number", "date": "2024-05-16"}],
                payment_id="credit_card_4421486",
            ),
        ],
        2,
        1,
    ),  # fmt: skip
    "P1-real-values": ("P1", [HELLO, GUD, GRD, bags("credit_card_4421486")], 2, 0),
    # P2 redundant_call
    "P2-repeat-success": ("P2", [HELLO, GUD, "Checking again. " + GUD_CALL], 1, 1),
    "P2-repeat-failure": ("P2", [HELLO, BAD_GRD, "Trying again. " + BAD_GRD_CALL], 1, 0),
    "P2-same-turn": ("P2", [HELLO, "Looking twice. " + GUD_CALL + GUD_CALL], 0, 1),
    # P3 repeat_failed_call
    "P3-repeat-failure": ("P3", [HELLO, BAD_GRD, "Trying again. " + BAD_GRD_CALL], 1, 1),
    "P3-earlier-failure": ("P3", [HELLO, BAD_GRD, GUD, "Trying again. " + BAD_GRD_CALL], 2, 1),
    "P3-repeat-success": ("P3", [HELLO, GUD, "Checking again. " + GUD_CALL], 1, 0),
    "P3-changed-call": ("P3", [HELLO, BAD_GRD, "Trying your profile. " + GUD_CALL], 1, 0),
    # P4 no_reasoning_before_action: a write the user was not told about
    "P4-silent-write": ("P4", [HELLO, GUD, GRD, YES, BARE_CANCEL_CALL], 2, 1),
    "P4-asked-before": ("P4", [HELLO, GUD, GRD, ASK, YES, BARE_CANCEL_CALL], 3, 0),
    "P4-said-in-turn": ("P4", [HELLO, GUD, GRD, "Cancelling NO6JO3 now. " + BARE_CANCEL_CALL], 2, 0),
    "P4-silent-read": ("P4", [HELLO, GUD_CALL], 0, 0),
    # P5 unconfirmed_write
    "P5-not-yet": ("P5", [HELLO, GUD, GRD, ASK, user("No, not yet."), CANCEL], 3, 1),
    "P5-unsure": ("P5", [HELLO, GUD, GRD, ASK, user("I'm not sure about that."), CANCEL], 3, 1),
    "P5-never-asked": ("P5", [user("Hi, I am mia_li_3668, please cancel NO6JO3."), CANCEL], 0, 1),
    "P5-confirmed": ("P5", CONFIRMED_CANCEL, 3, 0),
    # P6 unseen_id: a hallucinated id that reaches no record
    "P6-hallucinated": ("P6", [HELLO, BAD_GRD], 0, 1),
    "P6-nested-payment": ("P6", [HELLO, GUD, GRD, bags("credit_card_9999999")], 2, 1),
    "P6-lucky-guess": ("P6", [HELLO, GRD], 0, 0),  # an unseen id that works is not charged (gold does it)
    "P6-seen-id-failing": (
        "P6",
        [
            HELLO,
            GUD,
            "Changing passengers. " + call("update_reservation_passengers", reservation_id="NO6JO3", passengers=[]),
        ],
        1,
        0,
    ),  # fmt: skip
    "P6-from-tool-result": ("P6", [HELLO, GUD, GRD], 1, 0),
    "P6-nested-seen": ("P6", [HELLO, GUD, GRD, bags("credit_card_4421486")], 2, 0),
    "P6-from-user": ("P6", [HELLO, GUD], 0, 0),
    # P7 premature_transfer
    "P7-blind-transfer": ("P7", [HELLO, TRANSFER], 0, 1),
    "P7-user-asked": ("P7", [user("I want to talk to a human agent. I am mia_li_3668."), TRANSFER], 0, 0),
    "P7-after-read": ("P7", [HELLO, GUD, TRANSFER], 1, 0),
    "P7-blind-refusal": ("P7", [HELLO, "I'm sorry, but I can't help with that request. Goodbye!"], 0, 1),
    "P7-refusal-after-read": ("P7", [HELLO, GRD, "I'm sorry, we are unable to cancel this reservation."], 1, 0),
    "P7-cannot-find-is-no-refusal": ("P7", [HELLO, "I can't find that. What is your reservation id?"], 0, 0),
    # P8 excess_tool_calls (length penalty)
    "P8-ninth-call": ("P8", [HELLO, calcs(9)], 0, 1),
    "P8-tenth-call": ("P8", [HELLO, calcs(10)], 0, 2),
    "P8-across-turns": ("P8", [HELLO, calcs(5), calcs(5, start=5)], 1, 2),
    "P8-cut-turn": ("P8", [HELLO, ("cut", "Let me think about this at great length " * 20)], 0, TRUNCATED_TURN_COST),
    "P8-eight-calls": ("P8", [HELLO, calcs(8)], 0, 0),
    # B1 recovery_after_error
    "B1-recovered": ("B1", [HELLO, BAD_GRD, GRD], 1, 1),
    "B1-other-tool": ("B1", [HELLO, BAD_GRD, GUD], 1, 0),
    "B1-same-turn": ("B1", [HELLO, "Checking. " + BAD_GRD_CALL + GRD_CALL], 0, 0),
    "B1-no-error": ("B1", [HELLO, GUD, GRD], 1, 0),
    "B1-still-failing": ("B1", [HELLO, BAD_GRD, "Trying again. " + BAD_GRD_CALL], 1, 0),
    "B1-once-per-episode": (
        "B1",
        [
            HELLO,
            BAD_GRD,
            GRD,
            "Another. " + call("get_reservation_details", reservation_id="YYY888"),
            "The other one. " + call("get_reservation_details", reservation_id="AIXC49"),
        ],
        3,
        0,
    ),  # fmt: skip
    # B2 data_chain: paid at the write that uses an id from a tool result
    "B2-chained-write": ("B2", CONFIRMED_CANCEL, 3, 1),
    "B2-chained-read": ("B2", [HELLO, GUD, GRD], 1, 0),
    "B2-id-from-user": (
        "B2",
        [user("Hi, I am mia_li_3668 and my reservation is NO6JO3."), GUD, GRD, ASK, YES, CANCEL],
        3,
        0,
    ),  # fmt: skip
    "B2-pays-once": ("B2", [HELLO, GUD, GRD, bags("credit_card_4421486"), CANCEL], 3, 0),
    "B2-failed-call": (
        "B2",
        [
            HELLO,
            GUD,
            "Changing passengers. " + call("update_reservation_passengers", reservation_id="NO6JO3", passengers=[]),
        ],
        1,
        0,
    ),  # fmt: skip
    # B3 read_diversity: each read tool credited once, when a write follows
    "B3-credited-at-write": ("B3", CONFIRMED_CANCEL, 3, 2),
    "B3-read-alone": ("B3", [HELLO, GUD], 0, 0),
    "B3-credited-once": ("B3", [HELLO, GUD, GRD, bags("credit_card_4421486"), CANCEL], 3, 0),
    "B3-failed-write": ("B3", [HELLO, GUD, GRD, bags("credit_card_9999999")], 2, 0),
    # B4 conditional_reasoning: text before a write that works
    "B4-explained-write": ("B4", CONFIRMED_CANCEL, 3, 1),
    "B4-explained-read": ("B4", [HELLO, GUD], 0, 0),
    "B4-bare-write": ("B4", [HELLO, GUD, GRD, ASK, YES, BARE_CANCEL_CALL], 3, 0),
    "B4-text-after-call": ("B4", [HELLO, GUD, GRD, ASK, YES, BARE_CANCEL_CALL + " Done."], 3, 0),
    # B5 confirmed_write
    "B5-confirmed": ("B5", CONFIRMED_CANCEL, 3, 1),
    "B5-not-yet": ("B5", [HELLO, GUD, GRD, ASK, user("No, not yet."), CANCEL], 3, 0),
    "B5-failed-write": (
        "B5",
        [HELLO, GUD, ASK, user("Yes, I confirm."), "Cancelling. " + call("cancel_reservation", reservation_id="XX1")],
        2,
        0,
    ),
    # B6 verified_before_write
    "B6-verified": ("B6", CONFIRMED_CANCEL, 3, 1),
    "B6-bags-after-read": ("B6", [HELLO, GUD, GRD, bags("credit_card_4421486")], 2, 1),
    "B6-unverified": ("B6", [HELLO, GUD, ASK, YES, CANCEL], 2, 0),
    "B6-same-turn-read": (
        "B6",
        [
            user("Hi, I am raj_sanchez_7340."),
            ASK,
            YES,
            "Checking, then cancelling. " + GRD_CALL + call("cancel_reservation", reservation_id="NO6JO3"),
        ],
        1,
        0,
    ),  # fmt: skip
    "B6-invented-value": ("B6", [HELLO, GUD, GRD, PASSENGERS], 2, 0),
    "B6-cancelled-record": ("B6", [*CONFIRMED_CANCEL, bags("credit_card_4421486")], 4, 0),
    # B7 grounded_reply
    "B7-reports-ids": ("B7", [HELLO, GUD, "You have reservations NO6JO3, AIXC49 and HKEG34. Which one?"], 1, 1),
    "B7-reports-amount": ("B7", [HELLO, GUD, GRD, "You paid $2,504 for it."], 2, 1),
    "B7-already-said": (
        "B7",
        [HELLO, GUD, "You have NO6JO3, AIXC49 and HKEG34.", user("Which ones?"), "Again: NO6JO3, AIXC49, HKEG34."],
        2,
        0,
    ),
    "B7-once-per-episode": ("B7", [HELLO, GUD, "You have NO6JO3.", user("Ok."), GRD, "You paid $2,504 for it."], 3, 0),
    "B7-not-looked-up": ("B7", [HELLO, "Thanks! What about reservation ABC123 and the $100?"], 0, 0),
    "B7-turn-with-call": ("B7", [HELLO, GUD, "You have NO6JO3; let me open it. " + GRD_CALL], 1, 0),
}


# mia_li_3668 (gold): NO6JO3 is business and insured (cancellable), AIXC49 basic economy, uninsured, booked 2024-05-03
# (not cancellable, flights not changeable), HKEG34 business.
GRD_BASIC = "Let me check that reservation. " + call("get_reservation_details", reservation_id="AIXC49")
CANCEL_BASIC = "Cancelling it now. " + call("cancel_reservation", reservation_id="AIXC49")
ASK_BASIC = "Shall I cancel reservation AIXC49? (yes/no)"
NUMBER_REFUSAL = "I'm sorry, but I cannot change the number of passengers on a reservation."


def bags_on(reservation_id: str, total: int, nonfree: int) -> str:
    return f"Setting {total} bags on {reservation_id}. " + call(
        "update_reservation_baggages", reservation_id=reservation_id, total_baggages=total, nonfree_baggages=nonfree,
        payment_id="credit_card_4421486",
    )  # fmt: skip


THIRD_BAG = "3 checked bags on AIXC49, 1 of them paid with credit_card_4421486:"
THIRD_BAG_CALL = bags_on("AIXC49", 3, 1)
LIMIT_40 = user("Hi, my user id is mia_li_3668. I can spend at most $40 on this.")


V2_CASES: dict[str, tuple[str, list[Any], int, int]] = {
    # P4 unlisted_write: details listed in words count
    "P4-silent-write": ("P4", [HELLO, GUD, GRD, YES, BARE_CANCEL_CALL], 2, 1),
    "P4-listed-in-words": (
        "P4",
        [
            HELLO,
            GUD,
            GRD,
            "Shall I set your checked bags to 2 at no charge?",
            YES,
            call(
                "update_reservation_baggages",
                reservation_id="NO6JO3",
                total_baggages=2,
                nonfree_baggages=0,
                payment_id="credit_card_4421486",
            ),
        ],
        3,
        0,
    ),  # fmt: skip
    # P5 unconfirmed_write: agreement in other words, but not the opening request
    "P5-other-words": ("P5", [HELLO, GUD, GRD, ASK, user("Sounds good to me."), CANCEL], 3, 0),
    "P5-opening-request": ("P5", [user("Hi, I am mia_li_3668, please cancel NO6JO3."), CANCEL], 0, 1),
    "P5-not-yet": ("P5", [HELLO, GUD, GRD, ASK, user("No, not yet."), CANCEL], 3, 1),
    # P7: a refusal the policy always makes is not premature
    "P7-policy-refusal": ("P7", [HELLO, NUMBER_REFUSAL], 0, 0),
    "P7-blind-refusal": ("P7", [HELLO, "I'm sorry, but I can't help with that request. Goodbye!"], 0, 1),
    # P8: reads and failures past the budget cost, a write does not
    "P8-ninth-read": ("P8", [HELLO, calcs(8), GUD], 1, 1),
    "P8-write-past-budget": ("P8", [HELLO, calcs(8), GUD, GRD, ASK, YES, CANCEL], 3, 0),
    # P9 policy_violating_write, judged on the records read
    "P9-not-cancellable": ("P9", [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC], 3, 1),
    "P9-cancellable": ("P9", CONFIRMED_CANCEL, 3, 0),
    "P9-unread": ("P9", [HELLO, ASK_BASIC, YES, CANCEL_BASIC], 1, 0),  # nothing shown, nothing judged
    "P9-remove-bags": ("P9", [HELLO, GUD, GRD, bags_on("NO6JO3", 1, 0)], 2, 1),
    "P9-free-bags-charged": ("P9", [HELLO, GUD, GRD_BASIC, bags_on("AIXC49", 2, 1)], 2, 1),  # gold: 2 free
    "P9-bags-within-allowance": ("P9", [HELLO, GUD, GRD_BASIC, bags_on("AIXC49", 2, 0)], 2, 0),
    "P9-extra-bag-free": ("P9", [HELLO, GUD, GRD_BASIC, bags_on("AIXC49", 3, 0)], 2, 1),
    # P10 misquoted_charge: the charge (from the write's own result) against the amounts of the listing the user
    # answered; AIXC49 has one passenger, a gold member's basic economy allowance is 2, so a third bag charges $50
    "P10-misquoted": (
        "P10",
        [HELLO, GUD, GRD_BASIC, f"A third bag is {THIRD_BAG} $75 in total. Shall I?", YES, THIRD_BAG_CALL],
        3,
        1,
    ),  # fmt: skip
    "P10-quoted": (
        "P10",
        [HELLO, GUD, GRD_BASIC, f"A third bag is {THIRD_BAG} $50. Shall I?", YES, THIRD_BAG_CALL],
        3,
        0,
    ),  # fmt: skip
    "P10-no-amount-quoted": ("P10", [HELLO, GUD, GRD_BASIC, "Shall I add a third bag?", YES, THIRD_BAG_CALL], 3, 0),
    "P10-unread-reservation": ("P10", [HELLO, GUD, "A third bag is $75. Shall I?", YES, THIRD_BAG_CALL], 2, 0),
    "P10-refund-not-judged": (
        "P10",
        [HELLO, GUD, GRD, "Shall I cancel NO6JO3? You get $5 back.", YES, CANCEL],
        3,
        0,
    ),  # fmt: skip
    # P11 over_budget: the latest limit the user stated
    "P11-over": ("P11", [LIMIT_40, GUD, GRD_BASIC, "A third bag is $50. Shall I?", YES, THIRD_BAG_CALL], 3, 1),
    "P11-within": (
        "P11",
        [
            user("I am mia_li_3668, my budget is $60."),
            GUD,
            GRD_BASIC,
            "A third bag is $50. Shall I?",
            YES,
            THIRD_BAG_CALL,
        ],
        3,
        0,
    ),  # fmt: skip
    "P11-raised-limit": (
        "P11",
        [
            LIMIT_40,
            GUD,
            GRD_BASIC,
            "A third bag is $50. Shall I?",
            user("Fine, I can go up to $100. Yes."),
            THIRD_BAG_CALL,
        ],
        3,
        0,
    ),  # fmt: skip
    "P11-no-limit": ("P11", [HELLO, GUD, GRD_BASIC, "A third bag is $50. Shall I?", YES, THIRD_BAG_CALL], 3, 0),
    # bonuses are not paid for a forbidden write, nor for one charging what the user did not agree to
    "B5-misquoted-write": ("B5", [HELLO, GUD, GRD_BASIC, "A third bag is $75. Shall I?", YES, THIRD_BAG_CALL], 3, 0),
    "B5-quoted-write": ("B5", [HELLO, GUD, GRD_BASIC, "A third bag is $50. Shall I?", YES, THIRD_BAG_CALL], 3, 1),
    "B6-over-budget-write": (
        "B6",
        [LIMIT_40, GUD, GRD_BASIC, "A third bag is $50. Shall I?", YES, THIRD_BAG_CALL],
        3,
        0,
    ),  # fmt: skip
    "B5-forbidden-write": ("B5", [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC], 3, 0),
    "B5-other-words": ("B5", [HELLO, GUD, GRD, ASK, user("Sounds good to me."), CANCEL], 3, 1),
    "B2-forbidden-write": ("B2", [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC], 3, 0),
    "B2-chained-write": ("B2", CONFIRMED_CANCEL, 3, 1),
    "B3-forbidden-write": ("B3", [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC], 3, 0),
    "B3-credited-at-write": ("B3", CONFIRMED_CANCEL, 3, 2),
    "B4-forbidden-write": ("B4", [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC], 3, 0),
    "B4-explained-write": ("B4", CONFIRMED_CANCEL, 3, 1),
    "B6-forbidden-write": ("B6", [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC], 3, 0),
    "B6-verified": ("B6", CONFIRMED_CANCEL, 3, 1),
    # B8 justified_refusal: the records read back the refusal
    "B8-justified": (
        "B8",
        [HELLO, GRD_BASIC, "I'm sorry, but this basic economy reservation cannot be cancelled."],
        1,
        1,
    ),  # fmt: skip
    "B8-unjustified": ("B8", [HELLO, GRD, "I'm sorry, we are unable to cancel this reservation."], 1, 0),
    "B8-blind": ("B8", [HELLO, "I'm sorry, we are unable to cancel this reservation."], 0, 0),
    "B8-once": (
        "B8",
        [HELLO, GRD_BASIC, "This reservation cannot be cancelled.", user("Please?"), "It cannot be cancelled."],
        2,
        0,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_rule_on_real_episode(env: DomainEnv, case: str) -> None:
    rule_id, steps, turn, expected = CASES[case]
    record = play(env, steps)
    result = score_episode(record, rules="v1")
    assert len(result.turn_scores) == len(record.turns) == len(result.fired)
    assert result.fired[turn].get(rule_id, 0) == expected, result.fired


@pytest.mark.parametrize("case", list(V2_CASES))
def test_v2_rule_on_real_episode(env: DomainEnv, case: str) -> None:
    rule_id, steps, turn, expected = V2_CASES[case]
    result = score_episode(play(env, steps), rules="v2")
    assert result.fired[turn].get(rule_id, 0) == expected, result.fired


def test_every_rule_has_a_firing_and_a_silent_case() -> None:
    for cases, rules in ((CASES, RULES_V1), (V2_CASES, {k: r for k, r in RULES_V2.items() if r != RULES_V1.get(k)})):
        fires = {rule for rule, _, _, expected in cases.values() if expected}
        silent = {rule for rule, _, _, expected in cases.values() if not expected}
        assert fires == silent == set(rules)
    assert set(RULES_V2) - {"P9", "P10", "P11", "B8"} == set(RULES_V1)
    assert RULES is RULES_V2 and set(RULE_SETS) == {"v1", "v2"}


def test_v1_and_v2_differ_where_the_real_set_said(env: DomainEnv) -> None:
    """The same records, both versions: v1 pays a forbidden cancellation and charges a refusal straight from the
    policy and a confirmation in other words; v2 does the opposite."""
    forbidden = play(env, [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC])
    assert score_episode(forbidden, rules="v1").process_score > 0 > score_episode(forbidden, rules="v2").process_score
    refusal = play(env, [HELLO, NUMBER_REFUSAL])
    assert score_episode(refusal, rules="v1").process_score < 0 == score_episode(refusal, rules="v2").process_score
    agreed = play(env, [HELLO, GUD, GRD, ASK, user("Sounds good to me."), CANCEL])
    assert score_episode(agreed, rules="v1").rule_counts["P5"] == 1 and "P5" not in score_episode(agreed).fired[3]
    with pytest.raises(KeyError, match="unknown PRM-Lite rule set 'v3'; valid: v1, v2"):
        score_episode(agreed, rules="v3")


def test_turn_score_is_weighted_sum_and_totals_add_up(env: DomainEnv) -> None:
    record = play(env, [HELLO, GUD_CALL, GRD, ASK, user("Yes, go ahead."), CANCEL, "Done: NO6JO3 is cancelled."])
    result = score_episode(record, rules="v1")
    assert result.fired[0] == {} and result.fired[1] == {}  # reads earn nothing by themselves
    assert result.fired[3] == {"B2": 1, "B3": 2, "B4": 1, "B5": 1, "B6": 1}  # the confirmed, verified cancellation
    assert result.turn_scores[3] == pytest.approx(0.02 + 2 * 0.01 + 0.005 + 0.04 + 0.02)
    for scores, fired in zip(result.turn_scores, result.fired, strict=True):
        assert scores == pytest.approx(sum(RULES_V1[r].weight * n for r, n in fired.items()))
    for rule_id in RULES_V1:
        assert result.rule_counts[rule_id] == sum(fired.get(rule_id, 0) for fired in result.fired)
    assert result.raw_score == pytest.approx(sum(result.turn_scores))
    assert result.process_score == pytest.approx(result.raw_score)  # well inside the default clip
    assert result.to_dict()["rule_counts"] == result.rule_counts


def test_clip(env: DomainEnv) -> None:
    record = play(env, [HELLO, GUD, GRD, YES, BARE_CANCEL_CALL])  # P4 and B2 + 2 B3 + B5 + B6: raw +0.06
    assert score_episode(record).process_score == pytest.approx(0.06)  # the same in v1 and v2 (P4: no id / detail)
    tight = score_episode(record, clip=(-0.01, 0.01))
    assert tight.process_score == pytest.approx(0.01) and tight.raw_score == pytest.approx(0.06)
    low = score_episode(record, weights={"P4": -3.0})
    assert low.raw_score == pytest.approx(-2.9) and low.process_score == pytest.approx(-0.5)
    high = score_episode(record, weights={"B5": 3.0})
    assert high.raw_score == pytest.approx(3.02) and high.process_score == pytest.approx(0.5)
    with pytest.raises(ValueError, match="low <= high"):
        score_episode(record, clip=(0.5, -0.5))


def test_weights_override_and_unknown_id(env: DomainEnv) -> None:
    record = play(env, [HELLO, BAD_GRD])  # P6
    result = score_episode(record, weights={"P6": -0.2, "B3": 0.0})
    assert result.turn_scores == [pytest.approx(-0.2)]
    zero = score_episode(record, weights={"P6": 0.0})
    assert zero.fired == [{"P6": 1}] and zero.turn_scores == [0.0]  # a zero weight still reports the firing
    assert RULES["P6"].weight == -0.05  # the override does not leak into the table
    with pytest.raises(KeyError, match=r"unknown PRM-Lite rule id\(s\) \['P9'\]; valid ids: P1, P2, .*B7$"):
        score_episode(record, weights={"P9": 1.0}, rules="v1")
    with pytest.raises(KeyError, match=r"unknown PRM-Lite rule id\(s\) \['Q1'\]; valid ids: P1, .*P11, B1, .*B8"):
        score_episode(record, weights={"Q1": 1.0})
    with pytest.raises(ValueError, match="finite"):
        score_episode(record, weights={"P1": float("nan")})


def test_rule_table() -> None:
    assert list(RULES_V1) == [f"P{i}" for i in range(1, 9)] + [f"B{i}" for i in range(1, 8)]
    assert list(RULES_V2) == [f"P{i}" for i in range(1, 12)] + [f"B{i}" for i in range(1, 9)]
    for rules in (RULES_V1, RULES_V2):
        names = [rule.name for rule in rules.values()]
        assert names[:2] == ["placeholder_arguments", "redundant_call"] and len(set(names)) == len(rules)
        for rule_id, rule in rules.items():
            assert rule.rule_id == rule_id and rule.trigger and rule.rationale and callable(rule.fn)
            assert (rule.weight < 0) == rule_id.startswith("P") and rule.weight != 0
    assert get_rule("B2") is RULES["B2"] and get_rule("B5").weight == 0.04 and get_rule("P4", "v1") is RULES_V1["P4"]
    with pytest.raises(KeyError, match="valid ids: P1, P2, P3, P4, P5, P6, P7, P8, B1, B2, B3, B4, B5, B6, B7$"):
        get_rule("X1", "v1")


def test_id_arguments_come_from_the_schemas() -> None:
    assert VOCAB.id_argument_names == {"user_id", "reservation_id", "payment_id", "flight_number"}
    assert VOCAB.lookup_tools == {"get_user_details": "user_id", "get_reservation_details": "reservation_id"}
    described = " ".join(str(tool["function"]["parameters"]) for tool in TOOL_SCHEMAS)
    for example in ("sara_doe_496", "ZFA04Y", "credit_card_7815826", "2024-01-01"):
        assert example in described and is_placeholder("x", example, VOCAB)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("user_id", "<user_id>", True),
        ("reservation_id", "{reservation_id}", True),
        ("payment_id", "[payment id]", True),
        ("user_id", "user_id", True),
        ("reservation_id", "XXXXXX", True),
        ("payment_id", "your_payment_id", True),
        ("summary", "PLACEHOLDER", True),
        ("reservation_id", "...", True),
        ("user_id", "N/A", True),
        ("date", "2024-01-01", True),
        ("reservation_id", "8jx2wo", True),
        ("user_id", " ", True),
        ("user_id", "None", True),
        ("user_id", "mia_li_3668", False),
        ("flight_number", "HAT001", False),
        ("summary", "User wants to cancel NO6JO3; policy does not allow it.", False),
        ("insurance", "no", False),
        ("expression", "2 + 2", False),
    ],
)
def test_placeholder_detector(name: str, value: str, expected: bool) -> None:
    assert is_placeholder(name, value, VOCAB) is expected


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Yes, please go ahead.", True),
        ("yeah do it", True),
        ("Yep.", True),
        ("I confirm.", True),
        ("Please proceed with the change.", True),
        ("Sure, thanks!", True),
        ("That's correct.", True),
        ("Please do.", True),
        ("That\u2019s right", True),
        ("No problem, yes go ahead.", True),
        ("No, not yet.", False),
        ("Not yet, I need to think.", False),
        ("I'm not sure.", False),
        ("Don't proceed.", False),
        ("Please do not go ahead with it.", False),
        ("no", False),
        ("Please don't do it yet, I need to make sure first.", False),
        ("My user id is mia_li_3668.", False),
        ("", False),
    ],
)
def test_confirmation_detector(message: str, expected: bool) -> None:
    assert is_confirmation(message) is expected


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("I'm sorry, but I can't help with that request.", True),
        ("Unfortunately we are unable to cancel a basic economy reservation.", True),
        ("I cannot process a refund for this booking.", True),
        ("I\u2019m not able to change the passenger.", True),
        ("I can't find that reservation; could you check the id?", False),
        ("I can help you cancel it. Shall I proceed?", False),
        ("", False),
    ],
)
def test_decline_detector(message: str, expected: bool) -> None:
    assert declines_request(message) is expected


def test_mentionable_values() -> None:
    values = mentionable_values('{"reservation_id": "NO6JO3", "flights": [{"flight_number": "HAT083", "price": 483}]}')
    assert values == {"no6jo3", "hat083", "483"}
    assert mentionable_values("It costs $1,250.00 on 2024-05-16 at 06:00, see HATHAT, please.") == {"1250", "hathat"}
    assert mentionable_values("Total 3 bags, user mia_li_3668") == {"mia_li_3668"}


class _AskThenLookUp:
    """A minimal agent for ``run_episodes``: asks for the user id, looks it up, says goodbye."""

    def act(self, episodes: list[Any]) -> list[str]:
        texts = []
        for episode in episodes:
            turn = len(episode.record.turns)
            if turn == 0:
                texts.append("Could you please provide your user id?")
            elif turn == 1:
                last_user = [m["content"] for m in episode.messages if m["role"] == "user"][-1]
                found = re.search(r"\b[a-z]+(?:_[a-z]+)*_\d{3,}\b", last_user)
                user_id = found.group() if found else "unknown"
                texts.append("Let me look that up. " + call("get_user_details", user_id=user_id))
            else:
                texts.append("Thank you, goodbye! ###STOP###")
        return texts


def test_records_from_the_runner(env: DomainEnv) -> None:
    records = run_episodes(env, _AskThenLookUp(), ScriptedUser(), [("1", 0), ("5", 0)], score=outcome_reward)
    for record in records:
        result = score_episode(record)
        assert len(result.fired) == len(record.turns) == 3
        assert result.fired[1] == {}  # a read that changes nothing earns nothing (and the id came from the user)
        assert result.process_score == 0.0


def test_empty_record() -> None:
    record = EpisodeRecord(task_id="x", seed=0, messages=[{"role": "system", "content": "s"}])
    result = score_episode(record)
    assert result.turn_scores == [] and result.process_score == 0.0 and set(result.rule_counts) == set(RULES)
    assert not any(result.rule_counts.values())


def test_inconsistent_record_is_rejected(env: DomainEnv) -> None:
    record = play(env, [HELLO, GUD])
    record.messages = [m for m in record.messages if m["role"] != "assistant"]
    with pytest.raises(ValueError, match="assistant messages"):
        score_episode(record)


def test_docs_table_matches_code() -> None:
    text = DOCS.read_text(encoding="utf-8")
    table = text.split(DOCS_START, 1)[1].split(DOCS_END, 1)[0]
    assert table.strip() == rules_markdown().strip()
    assert re.search(r"\| P5 \| `unconfirmed_write` \| -0\.04 \|", table)


def test_markdown_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--markdown"]) == 0
    out = capsys.readouterr().out
    assert out == rules_markdown()
    # per set: title, blank, header, separator, one line per rule; a blank line between sets; the reference last;
    # then each domain's P9 checks, a line and a blank line each (a policy variant's are its domain's)
    tables = [*RULE_SETS.values(), REFERENCE_TERMS]
    domains = [name for name in DOMAINS if not get_domain(name).variant_of]
    assert out.count("\n") == sum(4 + len(rules) for rules in tables) + len(tables) - 1 + 2 * len(domains)
    assert "P9's checks on airline: " in out and "P9's checks on retail: none (off)" in out
    assert "**Rule set reference** (the task's gold actions: training only, and `prm_rules`' default" in out


def _result(*fired_rules: str) -> PRMResult:
    counts = dict.fromkeys(RULES, 0) | dict.fromkeys(fired_rules, 1)
    return PRMResult(turn_scores=[], fired=[], process_score=0.0, raw_score=0.0, rule_counts=counts)


def test_episode_rule_stats() -> None:
    results = [_result("B2", "B5"), _result("B2"), _result("P5"), _result("P5", "B2")]
    stats = episode_rule_stats(results, [True, True, False, False])
    assert len(stats) == 2 * len(RULES)
    assert stats["prm/B2/fire_rate"] == pytest.approx(0.75)
    assert stats["prm/B2/discriminativeness"] == pytest.approx(1.0 - 0.5)
    assert stats["prm/P5/fire_rate"] == pytest.approx(0.5)
    assert stats["prm/P5/discriminativeness"] == pytest.approx(-1.0)
    assert stats["prm/B5/discriminativeness"] == pytest.approx(0.5)
    assert stats["prm/P1/fire_rate"] == 0.0 and stats["prm/P1/discriminativeness"] == 0.0
    one_sided = episode_rule_stats(results[:2], [True, True])
    assert one_sided["prm/B2/fire_rate"] == 1.0 and one_sided["prm/B2/discriminativeness"] == 0.0
    assert episode_rule_stats([], [])["prm/B2/fire_rate"] == 0.0
    with pytest.raises(ValueError, match="success flags"):
        episode_rule_stats(results, [True])


def test_joint_charges_a_policy_violating_write_on_its_turn(env: DomainEnv) -> None:
    """Joint's per-turn credit follows the rules: the turn that cancels a reservation the policy says cannot be
    cancelled (basic economy, uninsured, booked 12 days before) carries the charge, the turns before it do not; v1
    paid that turn instead."""
    import torch

    from tau2_rl.trainers.variants import token_advantages

    record = play(env, [HELLO, GUD, GRD_BASIC, ASK_BASIC, YES, CANCEL_BASIC])
    v2, v1 = score_episode(record), score_episode(record, rules="v1")
    write_turn = 3
    assert v2.fired[write_turn] == {"P9": 1} and v2.turn_scores[write_turn] == pytest.approx(-0.10)
    assert all(score >= 0 for k, score in enumerate(v2.turn_scores) if k != write_turn)
    assert v1.turn_scores[write_turn] > 0  # B2 + B3 + B4 + B5 + B6: the forbidden write was the best turn
    turns = len(record.turns)
    policy_mask = torch.ones(1, 2 * turns, dtype=torch.long)  # two policy tokens per turn
    turn_index = torch.arange(turns).repeat_interleave(2).unsqueeze(0)
    zero = torch.zeros(1)  # a group advantage of 0: only the per-turn credit is left
    for scores, sign in ((v2, -1.0), (v1, 1.0)):
        advantages = token_advantages(
            "joint", zero, policy_mask, turn_index, torch.tensor([scores.turn_scores]), turn_credit_coef=0.3,
            prm_clip=0.5,
        )[0]  # fmt: skip
        write_tokens = advantages[2 * write_turn : 2 * write_turn + 2]
        assert torch.all(torch.sign(write_tokens) == sign)
        if sign < 0:
            assert torch.all(write_tokens < advantages.min() + 1e-9)  # the most negative tokens of the episode
            assert torch.all(advantages[: 2 * write_turn] >= 0)


def test_a_misquoted_charge_is_charged_on_its_own_turn(env: DomainEnv) -> None:
    """The same for a write the user agreed to at another price: its turn carries P10 and earns no write bonus."""
    quoted = score_episode(play(env, [HELLO, GUD, GRD_BASIC, "A third bag is $50. Shall I?", YES, THIRD_BAG_CALL]))
    misquoted = score_episode(play(env, [HELLO, GUD, GRD_BASIC, "A third bag is $75. Shall I?", YES, THIRD_BAG_CALL]))
    write_turn = 3
    assert misquoted.fired[write_turn] == {"P10": 1} and misquoted.turn_scores[write_turn] == pytest.approx(-0.10)
    assert quoted.turn_scores[write_turn] > 0 and "P10" not in quoted.fired[write_turn]
    assert all(score >= 0 for k, score in enumerate(misquoted.turn_scores) if k != write_turn)  # only its own turn


def test_evaluation_samples_carry_the_process_score(env: DomainEnv) -> None:
    """evaluate.py stores PRM-Lite's verdict with every episode, which its prm_* metrics read."""
    from tau2_rl.evaluation.results import sample_entry

    record = play(env, CONFIRMED_CANCEL)
    entry = sample_entry(record, 0, AIRLINE)["prm"]
    result = score_episode(record)
    assert entry == {"rules": "v2", "process_score": result.process_score, "rule_counts": result.rule_counts}


def test_policy_checks_read_only_what_the_tool_results_showed() -> None:
    """``policy.write_violations`` on hand-made records: each check is one sentence of the policy."""
    import json as _json

    from tau2_rl.domains.airline.policy_checks import PolicyFacts, write_violations
    from tau2_rl.envs.episode import ToolCallRecord

    def seen(name: str, result: object, **arguments: Any) -> ToolCallRecord:
        return ToolCallRecord(turn=0, name=name, arguments=arguments, result=_json.dumps(result), error=False)

    def write(name: str, **arguments: Any) -> ToolCallRecord:
        return ToolCallRecord(turn=1, name=name, arguments=arguments, result="{}", error=False, is_write=True)

    user = {"user_id": "u_1", "membership": "regular", "payment_methods": {
        "credit_card_1": {"source": "credit_card"}, "gift_card_1": {"source": "gift_card", "amount": 50.0},
        "certificate_1": {"source": "certificate", "amount": 100.0}, "certificate_2": {"source": "certificate",
        "amount": 100.0}}}  # fmt: skip
    reservation = {"reservation_id": "ABC123", "user_id": "u_1", "origin": "JFK", "destination": "LAX",
                   "flight_type": "one_way", "cabin": "economy", "created_at": "2024-05-15T10:00:00",
                   "insurance": "no", "total_baggages": 1, "nonfree_baggages": 0,
                   "flights": [{"flight_number": "HAT001", "origin": "JFK", "destination": "LAX",
                                "date": "2024-05-20"}],
                   "passengers": [{"first_name": "A"}, {"first_name": "B"}]}  # fmt: skip
    facts = PolicyFacts()
    assert write_violations(facts, write("cancel_reservation", reservation_id="ABC123")) == []  # nothing read
    facts.observe(seen("get_user_details", user, user_id="u_1"))
    facts.observe(seen("get_reservation_details", reservation, reservation_id="ABC123"))
    # booked 5 hours ago: cancellable; a week earlier it would not be
    assert write_violations(facts, write("cancel_reservation", reservation_id="abc123")) == []
    facts.reservations["ABC123"]["created_at"] = "2024-05-08T10:00:00"
    assert write_violations(facts, write("cancel_reservation", reservation_id="ABC123")) == ["not_cancellable"]
    facts.observe(seen("get_flight_status", "cancelled", flight_number="HAT001", date="2024-05-20"))
    assert write_violations(facts, write("cancel_reservation", reservation_id="ABC123")) == []  # airline cancelled
    # regular member, economy, 2 passengers: 2 free bags; bags cannot be removed
    bags = {"reservation_id": "ABC123", "payment_id": "credit_card_1"}
    assert write_violations(facts, write("update_reservation_baggages", total_baggages=3, nonfree_baggages=1,
                                         **bags)) == []  # fmt: skip
    assert write_violations(facts, write("update_reservation_baggages", total_baggages=3, nonfree_baggages=0,
                                         **bags)) == ["baggage_fee"]  # fmt: skip
    assert write_violations(facts, write("update_reservation_baggages", total_baggages=0, nonfree_baggages=0,
                                         **bags)) == ["remove_bags"]  # fmt: skip
    assert write_violations(facts, write("update_reservation_passengers", reservation_id="ABC123",
                                         passengers=[{"first_name": "A"}])) == ["passenger_count"]  # fmt: skip
    change = {"reservation_id": "ABC123", "cabin": "economy", "flights": [{"flight_number": "HAT002",
              "date": "2024-05-21"}]}  # fmt: skip
    facts.routes["HAT002"] = ("JFK", "SFO")
    assert write_violations(facts, write("update_reservation_flights", payment_id="gift_card_1", **change)) == [
        "trip_changed"
    ]
    assert "payment_mix" in write_violations(facts, write("update_reservation_flights", payment_id="certificate_1",
                                                          **change))  # fmt: skip
    # booking: payment rules, the allowance, and insurance must have been offered
    booking = {"user_id": "u_1", "cabin": "economy", "flights": [{"flight_number": "HAT009", "date": "2024-05-22"}],
               "passengers": [{"first_name": "A"}], "total_baggages": 1, "nonfree_baggages": 0}  # fmt: skip
    pay_two_certificates = [{"payment_id": "certificate_1", "amount": 100}, {"payment_id": "certificate_2",
                            "amount": 100}]  # fmt: skip
    assert write_violations(facts, write("book_reservation", payment_methods=pay_two_certificates, **booking)) == [
        "insurance_not_offered", "payment_mix"
    ]  # fmt: skip
    facts.agent_said.append("would you like travel insurance for $30 per passenger?")
    over = [{"payment_id": "gift_card_1", "amount": 80}, {"payment_id": "credit_card_9", "amount": 20}]
    assert write_violations(facts, write("book_reservation", payment_methods=over, **booking)) == [
        "balance", "payment_not_in_profile"
    ]  # fmt: skip
    # compensation: a regular member without insurance in economy gets none, and only when asking for it
    certificate = write("send_certificate", user_id="u_1", amount=200)
    assert write_violations(facts, certificate) == ["compensation_ineligible", "compensation_unasked"]
    facts.users["u_1"]["membership"] = "gold"
    facts.user_said.append("my flight was cancelled, i want compensation")
    assert write_violations(facts, certificate) == []  # $100 x 2 passengers for a cancelled flight
    delay = write("send_certificate", user_id="u_1", amount=150)  # 3 x 50 matches no reservation
    assert write_violations(facts, delay) == ["compensation_amount"]
    facts.reservations["ABC123"]["passengers"].append({"first_name": "C"})
    assert write_violations(facts, delay) == ["delay_compensation_without_change"]  # a delay: change or cancel first
    facts.changed.add("ABC123")
    assert write_violations(facts, delay) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The total is $1,023 and $89.50 goes to the card.", {1023.0, 89.5}),
        ("That is 3 bags and 2 passengers, at no charge.", set()),
        ("$ 75 today", {75.0}),
        ("It is 150 dollars, or 75 USD each; flight HAT150 on 2024-05-15.", {150.0, 75.0}),
    ],
)
def test_money_amounts(text: str, expected: set[float]) -> None:
    from tau2_rl.domains.airline.consent import money_amounts

    assert money_amounts(text) == expected


def test_a_charge_that_follows_from_the_quoted_amounts_was_quoted() -> None:
    from tau2_rl.domains.airline.consent import consent_issues, money_amounts, quotes

    fares = money_amounts("The new fare is $172; your old one was $63.")
    assert quotes(109, fares) and quotes(235, fares) and quotes(172, fares) and quotes(3 * 172, fares)
    assert not quotes(1302, money_amounts("The upgrade costs $495 in total."))
    assert consent_issues([1302.0], "The upgrade costs $495 in total.", []) == ["misquoted_charge"]
    assert consent_issues([1302.0], "Shall I upgrade the cabin?", ["keep it under $1,000"]) == ["over_budget"]
    assert consent_issues([], "The upgrade costs $495.", ["under $10"]) == []  # a refund or a free change


def test_stated_budget_is_the_latest_limit_the_user_stated() -> None:
    from tau2_rl.domains.airline.consent import stated_budget

    assert stated_budget(["I need it to fit under $1,000 for any upgrades."]) == 1000.0
    assert stated_budget(["Is there a fee I can pay, specifically up to $100?"]) == 100.0
    assert stated_budget(["My budget is $600.", "Hello"]) == 600.0
    assert stated_budget(["Please keep it below 250 dollars."]) == 250.0
    assert stated_budget(["I don't want to pay more than $300 for the change."]) == 300.0
    assert stated_budget(["I do not mind paying more than $300."]) is None
    assert stated_budget(["Keep it within the $1,000 budget.", "OK, I can go up to $1,500."]) == 1500.0
    assert stated_budget(["If more than $100 of it will be wasted, use my gift card."]) is None  # not a limit
    assert stated_budget(["Within 24 hours, please.", "I have $500 on a certificate."]) is None


def test_write_charges_read_the_payment_entries_the_write_added(env: DomainEnv) -> None:
    from tau2_rl.domains.airline.consent import write_charges
    from tau2_rl.domains.airline.policy_checks import PolicyFacts

    record = play(env, [HELLO, GUD, GRD_BASIC, "A third bag is $50. Shall I?", YES, THIRD_BAG_CALL])
    read, write = record.tool_calls[1], record.tool_calls[2]
    facts = PolicyFacts()
    assert write_charges(facts, write) == []  # the reservation was never read: no earlier payments to compare
    facts.observe(read)
    assert write_charges(facts, write) == [50.0]
    cancel = play(env, [*CONFIRMED_CANCEL]).tool_calls[-1]
    assert write_charges(facts, cancel) == []  # refunds are not charges
