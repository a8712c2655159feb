"""The ``calculate`` tool's arithmetic: τ²-bench's results and error texts, without ``eval``.

τ²-bench filters the expression to the characters ``0123456789+-*/(). `` and then ``eval``s it, so ``2 ** 10`` is
``1024.0`` and ``7 // 2`` is ``3.0``, and a failure shows Python's own message (``division by zero``). A policy model
is adversarial input, so we parse the expression with ``ast`` instead and apply Python's own operators node by node:
the same values and the same exception messages, but nothing outside numbers, ``+ - * / // **``, parentheses and
unary signs ever runs. Two refusals depart from τ², both for inputs where τ² would spend minutes or all memory: a
power whose result would be astronomically large (``9 ** 9 ** 9``) fails with ``Result too large``, and an expression
over 10,000 characters with ``Expression too long``.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

ALLOWED_CHARACTERS = frozenset("0123456789+-*/(). ")
MAX_EXPRESSION_CHARS = 10_000
MAX_POWER_BITS = 100_000  # a power result above 2**100000 (~30000 digits) is refused rather than computed
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculationError(ValueError):
    """The expression cannot be evaluated; the message is what τ² shows after ``Error: ``."""


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * abs(base).bit_length() > MAX_POWER_BITS:
            raise CalculationError("Result too large")


def _eval(node: ast.AST) -> Any:
    """Python's own semantics for the node types the character filter lets through."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Tuple) and not node.elts:  # "()"
        return ()
    if isinstance(node, ast.Call) and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args):
        function = _eval(node.func)  # a number or a tuple: calling it raises Python's "... is not callable"
        return function(*[_eval(arg) for arg in node.args])
    raise CalculationError("Invalid expression")


def calculate(expression: Any) -> str:
    """τ²'s ``calculate``: ``str(round(float(value), 2))``; raises ``CalculationError`` with τ²'s error text."""
    try:
        if not all(char in ALLOWED_CHARACTERS for char in expression):
            raise CalculationError("Invalid characters in expression")
        if not isinstance(expression, str):  # e.g. a list of digit strings gets past the filter, as in τ²
            raise CalculationError("eval() arg 1 must be a string, bytes or code object")
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise CalculationError("Expression too long")
        # eval() skips leading spaces and tabs of a string; compile() would call them an indent.
        tree = ast.parse(expression.lstrip(" \t"), filename="<string>", mode="eval")
        return str(round(float(_eval(tree.body)), 2))
    except CalculationError:
        raise
    except RecursionError as err:
        raise CalculationError("Expression is nested too deeply") from err
    except Exception as err:  # Python's own message, as τ² shows it
        raise CalculationError(str(err)) from err
