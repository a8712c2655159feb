"""A deterministic, rule-based user simulator: an offline stand-in for tests and smoke runs, NOT for benchmark numbers.

τ²-bench scores agents against an LLM user that role-plays the task's ``user_scenario``. This simulator needs no
model and no network: it reads the same scenario and answers by rules, so that the environment, the tools, the reward
and the trainer plumbing can be exercised end to end (the oracle agent must score 1 on every task against it) and so
that CPU smoke runs are reproducible. It is far too cooperative and literal to say anything about an agent's quality.

How it decides, on the agent's messages since the user last spoke (tool calls are invisible to it), in this order:

1. the first reply answers the greeting with the reason for the call (its first paragraph, rewritten into the first
   person by word substitutions);
2. after ``max_user_turns`` replies it says ``###STOP###`` (so an untrained policy that babbles still ends);
3. the agent says it is transferring the user → ``###TRANSFER###``;
4. the agent closes (goodbye, "anything else?") or refuses ("I cannot help ...") → ``###STOP###``;
5. a confirmation question ("do you confirm", "shall I proceed", "(yes/no)", "would you like me to") → yes;
6. a request for identifying information (user id, reservation id, name) → the ids and name parsed from
   ``known_info`` (reservation ids also from the reason for the call and the task instructions);
7. any other question → the scenario sentence sharing the most words with it (first person), else a neutral line;
8. anything else → a short acknowledgement (an empty message → "are you still there?").

Replies depend only on (task, conversation, ``episode.seed``): the seed picks among equivalent phrasings. Per-episode
memory (number of replies, sentences already used) lives in ``episode.user_state``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.tool_calls import parse_assistant_text
from tau2_rl.envs.users.base import UserReply, UserSimulator, agent_messages_since_user

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task
    from tau2_rl.envs.episode import Episode

logger = logging.getLogger(__name__)

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"

_TRANSFER = re.compile(
    r"\b(?:i am|i'm|i will|i'll|let me|going to|now|will be)\s+(?:transfer|connect)(?:ring|ing)?\b"
    r"|\b(?:transferring|connecting) you\b|\byou (?:are|will be) (?:being )?transferred\b",
    re.I,
)
_CLOSING = re.compile(
    r"\b(?:good\s?-?bye|bye|farewell|take care)\b|\banything else\b"
    r"|\bhave an? (?:great|nice|good|wonderful) (?:day|trip|flight|one|evening)\b|\bsafe travels\b",
    re.I,
)
_REFUSAL = re.compile(
    r"\bi(?: am|'m)? (?:unable|not able) to (?:help|assist|do|process|proceed|make|offer|cancel|change|modify|book)"
    r"|\bi (?:cannot|can't|can not) (?:help|assist|do|process|proceed|make|offer|cancel|change|modify|book|issue)",
    re.I,
)
_CONFIRMATION = re.compile(
    r"do you confirm|can you confirm|could you confirm|please confirm|\bconfirm (?:that|this|the)\b"
    r"|shall i (?:proceed|go ahead)|should i (?:proceed|go ahead)|would you like (?:me )?to (?:proceed|go ahead)"
    r"|would you like me to"
    r"|do you want me to|\(\s*yes\s*/\s*no\s*\)|\byes or no\b|may i proceed|can i proceed|ok to proceed",
    re.I,
)

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_STOPWORDS = frozenset(
    "the and for with that this have what which how want are any there help need let know will may can could would "
    "you your yours please like also just about from into then than them they their tell when where who why does did "
    "not but all our has had was were been being its it's i'm i'd i'll okay sure thank thanks great some more one "
    "get got make made should shall able sir madam hello here provide give share confirm".split()
)

_ACKS = ("Okay, thank you.", "Alright, thanks.", "Okay, I see.", "Thanks, got it.")
_NEUTRAL = (
    "I'm not sure about that. I'd just like help with my request.",
    "I don't know. Could you help me with my request, please?",
    "I'm not sure. I just want my request handled.",
)
_YES = ("Yes, please go ahead.", "Yes, I confirm.", "Yes, please proceed.")
_EMPTY = ("Hello? Are you still there?", "Sorry, I didn't get anything. Can you help me?")

# Word substitutions that turn the scenario's second person ("You want to ...") into the user's first person.
_PERSON_SUBS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.I), repl)
    for pattern, repl in (
        (r"\byou're\b", "I'm"),
        (r"\byou've\b", "I've"),
        (r"\byou'll\b", "I'll"),
        (r"\byou'd\b", "I'd"),
        (r"\byou are\b", "I am"),
        (r"\byou were\b", "I was"),
        (r"\byourself\b", "myself"),
        (r"\byours\b", "mine"),
        (r"\byour\b", "my"),
        (r"\byou to\b", "me to"),  # "allows you to", "asks you to": object position
        (r"\b(to|for|with|tell|tells|told|help|helps|ask|asks|asked|give|gives|let|lets|call|at|from|about|by|of)"
         r" you\b", r"\1 me"),
        (r"(?<!thank )\byou\b", "I"),
    )
)  # fmt: skip


def to_first_person(text: str) -> str:
    """Rewrites a scenario sentence from "you" to "I" (simple word substitutions; good enough for a stand-in)."""
    for pattern, repl in _PERSON_SUBS:
        text = pattern.sub(lambda m, r=repl: _keep_case(m.group(0), m.expand(r)), text)
    return text


def _keep_case(original: str, replacement: str) -> str:
    if original[:1].isupper() and replacement[:1].islower():
        return replacement[:1].upper() + replacement[1:]
    return replacement


def _sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+|\n+", text)
    return [" ".join(p.split()) for p in parts if p.strip()]


def _stem(word: str) -> str:
    """Crude suffix stripping so that "payment" meets "pay" and "bags" meets "bag"."""
    for suffix in ("ment", "ing", "ed", "es", "s"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


def _content_words(text: str) -> set[str]:
    return {_stem(w) for w in _WORD.findall(text.lower()) if len(w) >= 3 and w not in _STOPWORDS}


@dataclass(frozen=True)
class UserProfile:
    """What the scripted user knows, parsed once per task from its scenario."""

    identity: Any
    """What identifies the user in the task's domain (``DomainSpec.dialogue.identity``: the airline's user id and
    reservation ids, retail's email or name and zip code)."""
    opening: str
    facts: tuple[str, ...]


def build_profile(task: Task) -> UserProfile:
    """Parses the identification, the opening line and the answerable sentences out of the task's scenario."""
    instr = task.instructions
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", instr.reason_for_call.strip()) if p.strip()]
    first = " ".join((paragraphs[0] if paragraphs else "I need some help with my booking.").split())
    opening = f"Hi! {to_first_person(first)}"
    facts: list[str] = []
    for text in (instr.known_info, instr.unknown_info, instr.task_instructions, instr.reason_for_call):
        for sentence in _sentences(text):
            rewritten = to_first_person(sentence)
            if rewritten not in facts:
                facts.append(rewritten)
    return UserProfile(identity=task.spec.dialogue.identity(task), opening=opening, facts=tuple(facts))


def _own_results(episode: Episode) -> list[tuple[str, Any, str]]:
    """The user's own calls since it last spoke, with their results: (tool, arguments, result)."""
    count = 0
    for message in reversed(episode.messages):
        if message.get("requestor") != "user" or message["role"] != "tool":
            break
        count += 1
    calls = episode.record.user_tool_calls[-count:] if count else []
    return [(call.name, call.arguments, call.result) for call in calls]


class ScriptedUser(UserSimulator):
    """Rule-based user simulator (see the module docstring); never raises, always ends by ``max_user_turns``."""

    name = "scripted"

    def __init__(self, max_user_turns: int = 15) -> None:
        if max_user_turns < 2:  # the first reply always states the reason for the call
            raise ValueError(f"max_user_turns must be at least 2, got {max_user_turns}")
        self.max_user_turns = max_user_turns
        self._profiles: dict[tuple[int, str], UserProfile] = {}

    def _profile(self, task: Task) -> UserProfile:
        key = (id(task), task.task_id)
        if key not in self._profiles:
            self._profiles[key] = build_profile(task)
        return self._profiles[key]

    def reply(self, episode: Episode) -> UserReply:
        try:
            acted = _own_results(episode)
            if acted:  # it acted on its phone: it says what the phone showed (and whether that solved it), a turn
                episode.user_state["turns"] = episode.user_state.get("turns", 0) + 1
                return UserReply.from_text(self._report(episode, acted))
            text = self._reply_text(episode)
            return text if isinstance(text, UserReply) else UserReply.from_text(text)
        except Exception as err:  # a stand-in must never crash a run; end the conversation instead
            logger.exception("scripted user failed on task %s", episode.task.task_id)
            return UserReply(error=f"scripted user failed: {err!r}")

    @staticmethod
    def _report(episode: Episode, acted: list[tuple[str, Any, str]]) -> str:
        dialogue = episode.task.spec.dialogue
        text = dialogue.report(acted)  # type: ignore[attr-defined]  # a dialogue of a user who holds tools
        return f"{text} It works now, thank you! {STOP}" if dialogue.satisfied(episode.task, acted) else text

    def _reply_text(self, episode: Episode) -> str | UserReply:
        state = episode.user_state
        if "turns" not in state:  # a conversation resumed from a task's history: what the user said there counts
            state["turns"] = sum(m["role"] == "user" and m.get("requestor") != "user" for m in episode.messages)
        turn = state["turns"]
        state["turns"] = turn + 1
        profile = self._profile(episode.task)
        if turn == 0:
            return profile.opening
        if turn + 1 >= self.max_user_turns:
            return STOP
        visible = [parse_assistant_text(text).text for text in agent_messages_since_user(episode)]
        text = " ".join(t for t in visible if t).strip()
        pick = _Picker(episode.seed, episode.task.task_id, turn)
        if not text:
            return pick(_EMPTY)
        if _TRANSFER.search(text):
            return TRANSFER
        if _CLOSING.search(text) or _REFUSAL.search(text):
            return STOP
        acts = getattr(episode.task.spec.dialogue, "user_actions", None)  # a user who holds tools: do what is asked
        calls = acts(episode.task, text) if acts is not None and not _CONFIRMATION.search(text) else []
        if calls:
            state["turns"] = turn  # acting is not a turn of talk: the report that follows is
            return UserReply(tool_calls=calls)
        if _CONFIRMATION.search(text):
            return pick(_YES)
        ids = episode.task.spec.dialogue.identity_answer(profile.identity, text)
        if ids:
            return ids
        if "?" in text:
            return self._answer(profile, text, state) or pick(_NEUTRAL)
        return pick(_ACKS)

    @staticmethod
    def _answer(profile: UserProfile, question: str, state: dict[str, Any]) -> str:
        """The scenario sentence sharing most content words with the question (unused ones first), or ""."""
        words = _content_words(question)
        used: list[str] = state.setdefault("used_facts", [])
        best, best_key = "", (0, 0)
        for fact in profile.facts:
            overlap = len(words & _content_words(fact))
            key = (overlap, 0 if fact in used else 1)
            if overlap and key > best_key:
                best, best_key = fact, key
        if best and best not in used:
            used.append(best)
        return best


class _Picker:
    """Chooses among equivalent phrasings from a hash of (seed, task, turn): stable across processes and runs."""

    def __init__(self, seed: int, task_id: str, turn: int) -> None:
        digest = hashlib.sha256(f"{seed}:{task_id}:{turn}".encode()).digest()
        self.value = int.from_bytes(digest[:8], "big")

    def __call__(self, options: tuple[str, ...]) -> str:
        return options[self.value % len(options)]
