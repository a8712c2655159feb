"""The ``calculate`` tool: τ²'s results and error texts on arithmetic, and safe refusal of everything else.

τ² evaluates ``str(round(float(eval(expression)), 2))`` after a character filter; we walk the ``ast`` with Python's
own operators instead. The oracle below is τ²'s formula, applied only to expressions this file builds itself (never to
hostile input). ``tests/test_tau2_reference.py`` checks the same against outputs recorded from τ²'s code.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import execute_tool
from tau2_rl.envs.calculator import MAX_EXPRESSION_CHARS, CalculationError, calculate
from tau2_rl.envs.episode import shared_base
from tau2_rl.envs.state import EpisodeState

AIRLINE = get_domain("airline")


def tau2_calculate(expression: str) -> str:
    """τ²-bench's implementation, for trusted test expressions only."""
    if not all(char in "0123456789+-*/(). " for char in expression):
        raise ValueError("Invalid characters in expression")
    return str(round(float(eval(expression, {"__builtins__": None}, {})), 2))


def tau2_outcome(expression: str) -> str:
    try:
        return tau2_calculate(expression)
    except Exception as err:
        return f"Error: {err}"


def our_outcome(expression: str) -> str:
    try:
        return calculate(expression)
    except CalculationError as err:
        return f"Error: {err}"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 2", "4.0"),
        ("10 / 3", "3.33"),
        ("(1911 - 106) / 2", "902.5"),
        ("0.1 + 0.2", "0.3"),
        ("2 * -3", "-6.0"),
        ("+5", "5.0"),
        (".5 * 4", "2.0"),
        ("5.", "5.0"),
        ("((((7))))", "7.0"),
        ("  12  ", "12.0"),
        ("-0", "0.0"),
        ("-0.0", "-0.0"),
        ("2 ** 10", "1024.0"),
        ("7 // 2", "3.0"),
        ("2 ** -2", "0.25"),
        ("1000000 * 1000000 * 1001", "1001000000000000.0"),
        ("10 ** 17", "1e+17"),
    ],
)
def test_results_in_tau2_format(expression: str, expected: str) -> None:
    assert calculate(expression) == expected
    assert tau2_calculate(expression) == expected


# Failures whose text is Python's own; these are safe to eval here, so τ² is the oracle.
PYTHON_ERRORS = ["1/0", "1 // 0", "1.0 / 0", "1.0 // 0", "0 ** -1", "10 ** 400", "10.0 ** 400", "(-8) ** 0.5",
                 "()", "...", "1(2)", "()()", "(1)(2)(3)", "1 +", "(1", "1)", "", " ", "1 2", "1..2", "*"]  # fmt: skip


@pytest.mark.parametrize("expression", PYTHON_ERRORS)
def test_error_texts_are_pythons(expression: str) -> None:
    assert our_outcome(expression) == tau2_outcome(expression)


def _expressions(depth: int) -> st.SearchStrategy[str]:
    number = st.one_of(
        st.integers(0, 9999).map(str),
        st.integers(0, 100000).map(lambda cents: f"{cents / 100:.2f}"),
    )
    if depth == 0:
        return number
    sub = _expressions(depth - 1)
    return st.one_of(
        number,
        st.tuples(sub, st.sampled_from(["+", "-", "*", "/", "//", " + ", " * "]), sub).map("".join),
        st.tuples(sub, st.integers(-3, 3)).map(lambda pair: f"({pair[0]}) ** {pair[1]}"),
        sub.map(lambda e: f"({e})"),
        sub.map(lambda e: f"-{e}"),
    )


@settings(max_examples=1000, deadline=None)
@given(_expressions(3))
def test_matches_tau2_on_random_arithmetic(expression: str) -> None:
    assert our_outcome(expression) == tau2_outcome(expression)


HOSTILE = [
    "__import__('os')",
    "().__class__",
    "lambda: 1",
    "os.system",
    "1e309",
    "١٢٣",  # Arabic-Indic digits
    "１２",  # full-width digits
    "[1]",
    "'1'",
    "1 if 1 else 2",
    "1 < 2",
    "7 % 2",
    "0x10",
]


@pytest.mark.parametrize("expression", HOSTILE, ids=range(len(HOSTILE)))
def test_anything_but_arithmetic_is_refused_by_the_character_filter(expression: str) -> None:
    with pytest.raises(CalculationError, match="^Invalid characters in expression$"):
        calculate(expression)


@pytest.mark.parametrize("expression", ["2**99999999", "9**9**9", "9**9**9**9", "(10**1000)**1000"])
def test_astronomical_powers_are_refused_not_computed(expression: str) -> None:
    with pytest.raises(CalculationError, match="^Result too large$"):
        calculate(expression)


def test_long_and_deep_inputs_fail_cleanly() -> None:
    with pytest.raises(CalculationError, match="too long"):
        calculate("1+" * MAX_EXPRESSION_CHARS + "1")
    for expression in ["(" * 500 + "1" + ")" * 500, "-" * 5000 + "1", "9" * 5000]:
        with pytest.raises(CalculationError):
            calculate(expression)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "'NoneType' object is not iterable"),
        (12, "'int' object is not iterable"),
        (["1", "+", "1"], "eval() arg 1 must be a string, bytes or code object"),
    ],
)
def test_non_string_expression_like_tau2(value: object, message: str) -> None:
    with pytest.raises(CalculationError) as caught:
        calculate(value)
    assert str(caught.value) == message


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789+-*/(). ")), max_size=40) | st.text(max_size=40))
def test_fuzz_only_calculation_errors(expression: str) -> None:
    try:
        result = calculate(expression)
    except CalculationError:
        return
    float(result)  # a number in τ²'s format ("inf" included)


def test_through_execute_tool() -> None:
    state = EpisodeState(shared_base(AIRLINE))
    result = execute_tool(state, "calculate", {"expression": "(1911 - 106) / 2"})
    assert (result.content, result.error) == ("902.5", False)
    result = execute_tool(state, "calculate", {"expression": "1/0"})
    assert (result.content, result.error, result.error_kind) == ("Error: division by zero", True, "execution")
    result = execute_tool(state, "calculate", {})
    assert result.content == "Error: AirlineTools.calculate() missing 1 required positional argument: 'expression'"
    assert result.error_kind == "bad_arguments"
    assert state.fingerprint() == b""
