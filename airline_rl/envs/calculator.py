"""A safe arithmetic evaluator for the ``calculate`` tool.

τ²-bench evaluates the expression with ``eval`` after a character filter; a policy model is adversarial input, so we
parse it with ``ast`` and walk only numbers, ``+ - * /``, parentheses and unary minus/plus. Everything else (names,
calls, attribute access, ``**``, comparisons) is rejected, and magnitudes are bounded so that no input can make the
evaluation slow or huge.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 1000
MAX_MAGNITUDE = 1e15
_ALLOWED_CHARS = frozenset("0123456789+-*/(). ")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculationError(ValueError):
    """The expression is not plain arithmetic or cannot be evaluated."""


def _eval(node: ast.AST, depth: int = 0) -> int | float:
    """Python's own arithmetic (ints stay ints, as in τ²'s ``eval``: ``-0`` is ``0``, not ``-0.0``), range-checked."""
    if depth > 100:
        raise CalculationError("Expression is nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculationError("Division by zero")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    else:
        raise CalculationError("Invalid expression: only numbers, + - * /, parentheses and unary minus are allowed")
    if abs(value) > MAX_MAGNITUDE or not math.isfinite(value):  # abs first: exact for huge ints, no overflow
        raise CalculationError("Result out of range")
    return value


def calculate(expression: str) -> str:
    """Evaluates ``expression`` and returns τ²'s format: ``str(round(float(result), 2))``."""
    if not isinstance(expression, str):
        raise CalculationError("Expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"Expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not set(expression) <= _ALLOWED_CHARS:
        raise CalculationError("Invalid characters in expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CalculationError("Invalid expression") from err
    try:
        return str(round(float(_eval(tree.body)), 2))
    except RecursionError as err:
        raise CalculationError("Expression is nested too deeply") from err
    except OverflowError as err:
        raise CalculationError("Result out of range") from err
