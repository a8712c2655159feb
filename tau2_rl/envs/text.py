"""What text may enter a conversation: valid Unicode only, so every render and tokenisation of it succeeds.

A model can write the JSON escape ``\\ud800`` (plain ASCII) inside a tool-call argument; ``json.loads`` turns it into
a lone UTF-16 surrogate, a Python ``str`` that no UTF-8 encoder accepts. Echoed into a tool observation it made the
next turn's tokenisation raise inside the shared episode loop (and a results file written with
``ensure_ascii=False`` fail). Every string that enters an episode's messages or records passes ``clean_text``.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def clean_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD (valid text is returned unchanged, same object)."""
    return _SURROGATE.sub(REPLACEMENT, text) if _SURROGATE.search(text) else text


def clean_value(value: Any) -> Any:
    """``clean_text`` applied to every string (dict keys included) of a JSON-like value."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_value(k): clean_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_value(v) for v in value]
    return value
