"""The ``calculate`` tool: τ²'s results and format on arithmetic, and safe, fast refusal of everything else.

τ² evaluates ``str(round(float(eval(expression)), 2))`` after a character filter; we parse with ``ast`` instead. The
oracle below is τ²'s formula, applied only to expressions this file builds itself (never to hostile input).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airline_rl.envs.calculator import MAX_EXPRESSION_CHARS, CalculationError, calculate
from airline_rl.envs.episode import shared_base
from airline_rl.envs.state import AirlineState
from airline_rl.envs.tools import execute_tool


def tau2_calculate(expression: str) -> str:
    """τ²-bench's implementation, for trusted test expressions only."""
    return str(round(float(eval(expression, {"__builtins__": None}, {})), 2))


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 2", "4.0"),
        ("10 / 3", "3.33"),
        ("2/3", "0.67"),
        ("(1911 - 106) / 2", "902.5"),
        ("0.1 + 0.2", "0.3"),
        ("2 * -3", "-6.0"),
        ("-(4 - 10)", "6.0"),
        ("+5", "5.0"),
        (".5 * 4", "2.0"),
        ("5.", "5.0"),
        ("((((7))))", "7.0"),
        ("  12  ", "12.0"),
        ("1.005 * 1000", "1005.0"),
        ("100 - 0.001", "100.0"),
        ("-0", "0.0"),
        ("0 * -1", "0.0"),
        ("-0.0", "-0.0"),
        ("1000000 * 1000000 * 1000", "1000000000000000.0"),
        ("3 * (196 + 134) - 2 * 169", "652.0"),
    ],
)
def test_results_in_tau2_format(expression: str, expected: str) -> None:
    assert calculate(expression) == expected
    assert tau2_calculate(expression) == expected


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
        st.tuples(sub, st.sampled_from(["+", "-", "*", "/", " + ", " * "]), sub).map("".join),
        sub.map(lambda e: f"({e})"),
        sub.map(lambda e: f"-{e}"),
    )


@settings(max_examples=1500, deadline=None)
@given(_expressions(4))
def test_matches_tau2_on_random_arithmetic(expression: str) -> None:
    try:
        expected: str | None = tau2_calculate(expression)
    except ZeroDivisionError:
        expected = None
    try:
        result = calculate(expression)
    except CalculationError as err:
        # refused: a division by zero (τ² raises too) or a value beyond our magnitude bound
        assert expected is None or "out of range" in str(err), (expression, expected, err)
        return
    assert result == expected


HOSTILE = [
    "__import__('os')",
    "__import__('os').system('true')",
    "().__class__",
    "().__class__.__bases__[0].__subclasses__()",
    "lambda: 1",
    "(lambda x: x)(1)",
    "os.system",
    "a.b",
    "2**10000",
    "2**99999999",
    "9**9**9**9",
    "9" * 5000,
    "9" * 999,
    "9" * 400 + "*" + "9" * 400,
    "9" * 300 + "/" + "0." + "0" * 300 + "1",
    "(" * 500,
    "(" * 500 + "1" + ")" * 500,
    "-" * 999 + "1",
    "1" + "*1" * 499,
    "1/0",
    "1 / (3 - 3)",
    "1/0.0",
    "1e309",
    "1e3",
    "١٢٣",  # Arabic-Indic digits
    "１２",  # full-width digits
    "²",
    "",
    " ",
    "   \t\n",
    "\t1+1",
    "()",
    "(,)",
    "1 2",
    "1..2",
    "3 // 2",
    "7 % 2",
    "1_000",
    "0x10",
    "01",
    "[1]",
    "{}",
    "'1'",
    "1 if 1 else 2",
    "1 < 2",
    "1; 2",
    "*",
    "/",
    "1 +",
    "(1",
    "1)",
    ".",
    "+",
    "-",
]


@pytest.mark.parametrize("expression", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_inputs_fail_fast_with_calculation_error(expression: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CalculationError):
        calculate(expression)
    assert time.perf_counter() - start < 0.5  # generous: each of these takes well under a millisecond


def test_specific_refusal_messages() -> None:
    cases = {
        "__import__('os')": "Invalid characters in expression",
        "().__class__": "Invalid characters in expression",
        "1e309": "Invalid characters in expression",
        "١٢": "Invalid characters in expression",
        "2**10000": "only numbers",
        "1/0": "Division by zero",
        "9" * 5000: f"longer than {MAX_EXPRESSION_CHARS} characters",
        "9" * 999: "out of range",
        "-" * 999 + "1": "nested too deeply",
        "": "Invalid expression",
    }
    for expression, fragment in cases.items():
        with pytest.raises(CalculationError, match=fragment):
            calculate(expression)


def test_magnitude_is_bounded() -> None:
    assert calculate("999999999999999") == "999999999999999.0"
    with pytest.raises(CalculationError, match="out of range"):
        calculate("1000000 * 1000000 * 1001")
    with pytest.raises(CalculationError, match="out of range"):
        calculate("99999999 * 99999999 * 99999999 * 99999999")


@pytest.mark.parametrize("value", [None, 12, 1.5, b"1+1", ["1+1"]])
def test_non_string_expression(value: object) -> None:
    with pytest.raises(CalculationError, match="must be a string"):
        calculate(value)  # type: ignore[arg-type]


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789+-*/(). eE_x")), max_size=60) | st.text(max_size=60))
def test_fuzz_only_calculation_errors(expression: str) -> None:
    try:
        result = calculate(expression)
    except CalculationError:
        return
    assert float(result) == float(result)  # a finite number in τ²'s format
    assert abs(float(result)) <= 1e15


@pytest.mark.parametrize("expression", ["__import__('os')", "2**99999999", "9" * 5000, "(" * 500, "1/0", ""])
def test_through_execute_tool_errors_become_observations(expression: str) -> None:
    state = AirlineState(shared_base())
    result = execute_tool(state, "calculate", {"expression": expression})
    assert result.error and result.error_kind == "execution"
    assert result.content.startswith("Error: ")
    assert state.fingerprint() == b""


def test_through_execute_tool_success_and_bad_arguments() -> None:
    state = AirlineState(shared_base())
    result = execute_tool(state, "calculate", {"expression": "(1911 - 106) / 2"})
    assert (result.content, result.error) == ("902.5", False)
    result = execute_tool(state, "calculate", {"expression": 5})
    assert result.error and result.error_kind == "bad_arguments"
    assert result.content == "Error: Argument 'expression' must be a string, got int"
    result = execute_tool(state, "calculate", {})
    assert result.error and "'expression'" in result.content
