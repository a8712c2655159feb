"""What the offline scripted parties say in telecom: the oracle's questions and confirmations, the scripted user's
identification.

Telecom's policy identifies a customer by the phone number of the line (``get_customer_by_phone``), or by name and
date of birth; every scenario's ``known_info`` reads "You are <name> with phone number <555-123-2002>". The rest of
both parties is the domain-neutral ``tau2_rl.envs.users.scripted`` and oracle.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task

IDENTIFIERS = "phone number, full name"
"""The identifying details the LLM user's project-protocol prompt lists as examples (``tau2_rl.envs.users.llm``)."""

_PHONE = re.compile(r"\b\d{3}-\d{3}-\d{4}\b")
_NAME = re.compile(r"\bYou are ([A-Z][a-z]+(?: [A-Z][a-z]+)+)")
_REQUEST = re.compile(r"\?|\bplease (?:provide|share|give|tell|confirm)\b|\bi (?:will )?need\b", re.I)
_ASKS_PHONE = re.compile(r"\bphone(?:[ -]?number)?\b|\bnumber\b|\bline\b", re.I)
_ASKS_NAME = re.compile(r"\b(?:full |first |last )?name\b", re.I)


@dataclass(frozen=True)
class TelecomIdentity:
    name: str | None
    phone_number: str | None


def identity(task: Task) -> TelecomIdentity:
    known = task.instructions.known_info
    names, phones = _NAME.findall(known), _PHONE.findall(known)
    return TelecomIdentity(names[0] if names else None, phones[0] if phones else None)


def identity_answer(known: TelecomIdentity, text: str) -> str:
    """The identification the agent asked for, or "" when it asked for none."""
    if not _REQUEST.search(text):
        return ""
    parts = []
    if _ASKS_NAME.search(text) and known.name:
        parts.append(f"My name is {known.name}.")
    if _ASKS_PHONE.search(text) and known.phone_number:
        parts.append(f"My phone number is {known.phone_number}.")
    return " ".join(parts)


def opening_question(task: Task) -> str:
    """The oracle's first question: the line's phone number, which its gold look-up uses."""
    return "I'd be happy to help. Could you please give me your full name and the phone number of your line?"


def describe_action(name: str, args: dict[str, Any]) -> str:
    """A telecom write of the agent in plain words, for the confirmation question the policy requires."""
    line = args.get("line_id")
    if name == "refuel_data":
        return f"add {args.get('gb_amount')} GB of data to line {line}"
    if name in ("enable_roaming", "disable_roaming"):
        return f"{name.split('_')[0]} roaming on line {line}"
    if name in ("suspend_line", "resume_line"):
        return f"{name.split('_')[0]} line {line}"
    if name == "send_payment_request":
        return f"send a payment request for bill {args.get('bill_id')}"
    return f"run {name} with {json.dumps(args, sort_keys=True)}"


# ------------------------------------------------------------- the user's phone: the oracle's asks, the user's acts

_ASKS: dict[str, str] = {
    "toggle_airplane_mode": "Please toggle airplane mode on your phone.",
    "toggle_data": "Please toggle mobile data on your phone.",
    "toggle_roaming": "Please toggle data roaming on your phone.",
    "toggle_data_saver_mode": "Please toggle data saver mode on your phone.",
    "toggle_wifi": "Please toggle Wi-Fi on your phone.",
    "toggle_wifi_calling": "Please toggle Wi-Fi calling on your phone.",
    "reboot_device": "Please restart your phone.",
    "reseat_sim_card": "Please remove your SIM card and re-insert it.",
    "reset_apn_settings": "Please reset your APN settings.",
    "connect_vpn": "Please connect to your VPN.",
    "disconnect_vpn": "Please disconnect your VPN.",
    "make_payment": "Please make the payment the payment request on your phone asks for.",
    "check_status_bar": "Could you check the status bar of your phone and tell me what it shows?",
    "check_network_status": "Could you check the network status of your phone?",
    "check_network_mode_preference": "Could you check your preferred network mode?",
    "check_sim_status": "Could you check your SIM card status?",
    "check_data_restriction_status": "Could you check your data restriction status?",
    "check_apn_settings": "Could you check your APN settings?",
    "check_wifi_status": "Could you check your Wi-Fi status?",
    "check_wifi_calling_status": "Could you check your Wi-Fi calling status?",
    "check_vpn_status": "Could you check your VPN status?",
    "check_installed_apps": "Could you check which apps are installed on your phone?",
    "check_payment_request": "Could you check the payment request on your phone?",
    "can_send_mms": "Could you try sending an MMS message?",
    "run_speed_test": "Could you run a speed test on your phone?",
}
"""How the oracle asks the user for each of the user's tools that takes no arguments."""

_MODES = {"4g_5g_preferred": r"4g[_ /-]?5g[_ ]preferred|5g/4g", "4g_only": r"4g[_ ]only|lte only",
          "3g_only": r"3g[_ ]only", "2g_only": r"2g[_ ]only"}  # fmt: skip
_APPS = ("messaging", "browser", "camera", "settings", "phone", "email", "maps")
_PERMISSIONS = ("sms", "storage", "camera", "location", "contacts", "microphone", "network", "phone")
_TOGGLE = r"(?:toggle|turn(?:ing)?|switch(?:ing)?|disable|enable|deactivate|activate|put)"
_CHECK = r"(?:check|look|see|tell me|what(?:'s| is| does)|verify|confirm|read|view|let me know)"

# (tool, clause pattern): a clause asking for the tool; the first pattern of each tool that a clause matches decides
_ACTS: list[tuple[str, str]] = [
    ("toggle_wifi_calling", rf"{_TOGGLE}\b.*\bwi-?fi calling|\bwi-?fi calling\b.*\b(?:on|off)\b"),
    ("check_wifi_calling_status", rf"{_CHECK}\b.*\bwi-?fi calling"),
    ("toggle_wifi", rf"{_TOGGLE}\b.*\bwi-?fi\b(?! calling)"),
    ("check_wifi_status", rf"{_CHECK}\b.*\bwi-?fi\b(?! calling)"),
    ("toggle_airplane_mode", rf"{_TOGGLE}\b.*\bairplane mode|\bairplane mode\b.*\b(?:on|off)\b"),
    ("toggle_data_saver_mode", rf"{_TOGGLE}\b.*\bdata saver"),
    ("check_data_restriction_status", rf"{_CHECK}\b.*\b(?:data saver|data restriction)"),
    ("toggle_roaming", rf"{_TOGGLE}\b.*\broaming\b"),
    ("toggle_data", rf"{_TOGGLE}\b.*\b(?:mobile|cellular) data\b"),
    ("set_network_mode_preference", r"\b(?:set|change|switch)\b.*\b(?:network mode|network type|preferred network)"),
    ("check_network_mode_preference", rf"{_CHECK}\b.*\b(?:network mode|preferred network)"),
    ("reset_apn_settings", r"\breset\b.*\bapn\b"),
    ("check_apn_settings", rf"{_CHECK}\b.*\bapn\b"),
    ("reseat_sim_card", r"\b(?:reseat|re-?insert|re-?seat)\b.*\bsim\b|\bsim\b.*\b(?:reseat|re-?insert)"),
    ("check_sim_status", rf"{_CHECK}\b.*\bsim\b"),
    ("reboot_device", r"\b(?:restart|reboot|power cycle)\b"),
    ("disconnect_vpn", r"\bdisconnect\b.*\bvpn\b|\b(?:turn|switch) off\b.*\bvpn\b"),
    ("connect_vpn", r"\bconnect\b.*\bvpn\b"),
    ("check_vpn_status", rf"{_CHECK}\b.*\bvpn\b"),
    ("grant_app_permission", r"\b(?:grant|allow|give)\b.*\bpermission"),
    ("check_app_permissions", rf"{_CHECK}\b.*\bpermission"),
    ("check_installed_apps", r"\binstalled apps\b|\bwhich apps\b"),
    ("make_payment", r"\b(?:make|complete|accept)\b.*\bpayment\b|\bpay (?:the|your|that|this) bill\b"),
    ("check_payment_request", rf"{_CHECK}\b.*\bpayment request"),
    ("can_send_mms", r"\b(?:send|sending)\b.*\bmms\b|\bmms\b.*\b(?:send|work)"),
    ("run_speed_test", r"\bspeed test\b"),
    ("check_status_bar", r"\bstatus bar\b"),
    ("check_network_status", rf"{_CHECK}\b.*\b(?:network status|connection status|signal)"),
]
_ACT_PATTERNS = [(tool, re.compile(pattern)) for tool, pattern in _ACTS]
_CLAUSE = re.compile(r"[^.!?\n;]+[.!?]?")
_ASKING = re.compile(
    r"\b(?:please|could you|can you|would you|will you|try|you (?:need to|should|can|must|will need to)|go (?:to|into)"
    r"|make sure|let's|i need you to)\b|^\s*(?:(?:then|and|now|next|also|first|finally|after that),?\s+)?"
    r"(?:toggle|turn|switch|restart|reboot|reset|reseat|re-?insert|remove"
    r"|connect|disconnect|grant|allow|set|change|check|run|open|enable|disable|make|pay|send)\b"
)
"""A clause that asks the user to do something (a statement of the agent's own action is no request): a polite form,
or an imperative verb opening the clause, after a connective such as "then"."""


def ask_user_action(name: str, arguments: dict[str, Any]) -> str:
    """The oracle's request that the user do one of the user's gold actions on the phone."""
    if name == "set_network_mode_preference":
        return f"Please set your preferred network mode to {arguments.get('mode')}."
    if name == "grant_app_permission":
        return f"Please grant the {arguments.get('permission')} permission to the {arguments.get('app_name')} app."
    if name in ("check_app_status", "check_app_permissions"):
        what = "status" if name == "check_app_status" else "permissions"
        return f"Could you check the {what} of the {arguments.get('app_name')} app?"
    return _ASKS.get(name, f"Please do this on your phone: {name}.")


def _arguments(tool: str, clause: str) -> dict[str, Any] | None:
    """The arguments a clause gives a tool that takes some (None: it names none the tool could take)."""
    if tool == "set_network_mode_preference":
        mode = next((mode for mode, pattern in _MODES.items() if re.search(pattern, clause)), None)
        return None if mode is None else {"mode": mode}
    if tool in ("grant_app_permission", "check_app_permissions", "check_app_status"):
        app = next((app for app in _APPS if re.search(rf"\b{app}\b", clause)), None)
        if app is None:
            return None
        if tool != "grant_app_permission":
            return {"app_name": app}
        permission = next((p for p in _PERMISSIONS if re.search(rf"\b{p}\b", clause) and p != app), None)
        return None if permission is None else {"app_name": app, "permission": permission}
    return {}


def user_actions(task: Task, text: str) -> list[tuple[str, dict[str, Any]]]:
    """The user's tool calls the agent's ``text`` asks for, in the order asked (one per clause; none: it asks for
    nothing on the phone). A tool the user holds named outright (``reboot_device``) is one."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for clause in _CLAUSE.findall(text.lower()):
        if not _ASKING.search(clause):
            continue
        tool = next((name for name in _user_tool_names(task.spec) if re.search(rf"\b{name}\b", clause)), None)
        if tool is None:
            tool = next((name for name, pattern in _ACT_PATTERNS if pattern.search(clause)), None)
        if tool is None:
            continue
        arguments = _arguments(tool, clause)
        if arguments is not None and (tool, arguments) not in calls:
            calls.append((tool, arguments))
    return calls


@functools.cache
def _user_tool_names(spec: Any) -> tuple[str, ...]:
    """The user's tool names (the task's domain spec: this module is part of it and imports none)."""
    return tuple(spec.user_tool_types()) if spec.user_tool_types is not None else ()


def report(calls: list[tuple[str, dict[str, Any], str]]) -> str:
    """What the user says after acting: each result as the phone showed it (grounded on the tool results)."""
    return " ".join(f"I did that ({name.replace('_', ' ')}). The phone says: {result}" for name, _, result in calls)


_SIGNAL = re.compile(r"📶")


_GOALS = {
    "run_speed_test": re.compile(r"resolved only when (?:the )?speed test returns excellent"),
    "check_status_bar": re.compile(r"resolved when the status bar shows that you have signal"),
    "can_send_mms": re.compile(r"successfully send an mms"),
}
"""The success condition each scenario states (every scenario's grounding guidelines name the status bar and MMS
too, so a bare mention is no goal): the tool whose result decides it."""


def satisfied(task: Task, calls: list[tuple[str, dict[str, Any], str]]) -> bool:
    """Whether the user's own success condition holds on what its phone just showed: an excellent speed test, a
    status bar with signal, or an MMS sent, whichever its scenario asks for."""
    instructions = f"{task.instructions.reason_for_call} {task.instructions.task_instructions}".lower()
    for name, _, result in calls:
        goal = _GOALS.get(name)
        if goal is None or not goal.search(instructions):
            continue
        shown = result.lower()
        if name == "run_speed_test" and "excellent" in shown:
            return True
        if name == "check_status_bar" and _SIGNAL.search(result):
            return "no service" not in shown and "airplane mode" not in shown
        if name == "can_send_mms" and "cannot" not in shown and "can send" in shown:
            return True
    return False
