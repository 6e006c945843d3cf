"""The calculator tool: integer and float arithmetic, evaluated by walking Python's `ast`.

    {"expression": "(3 + 4) * -2 ** 3 // 5"}  ->  "-12"

Grammar (Python's own precedence and semantics; anything else is refused):

    expr := number | expr OP expr | (+|-) expr | ( expr )      OP in + - * / // % **
    number := an int or float literal (no bool, complex or string)

The tree is walked with a whitelist, never `eval`: names, calls, attributes, subscripts
(`__import__('os')`, `(1).__class__`) are refused before anything runs. Limits keep one call
cheap, each a refusal (an error result), not an exception:

    len(expression)                <= max_chars
    |exponent| of int ** int       <= max_exponent, and bits(base) * exponent <= the bits of
                                      a max_digits number (checked before computing)
    digits of every int result     <= max_digits
    float results                  finite (overflow, inf and nan are errors)

Results print as Python prints them: `7 / 2` is "3.5", `6 / 3` is "2.0", `7 // 2` is "3".
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import time
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl.envs.tools import ToolResult, string_argument

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _Refused(Exception):
    """Why an expression is not evaluated (becomes the error result's text)."""


@dataclasses.dataclass(frozen=True)
class Calculator:
    """Arithmetic on ints and floats (module docstring); one argument, "expression"."""

    max_chars: int = 200
    max_exponent: int = 10_000
    max_digits: int = 100
    name: str = "calculator"
    description: str = ("Evaluates an arithmetic expression of integers and decimals with "
                        "+ - * / // % ** and parentheses, e.g. (3 + 4) * 2 ** 3.")
    argument: str = "expression"

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        start = time.perf_counter()
        expression = string_argument(arguments, self.argument)
        if isinstance(expression, ToolResult):
            return expression
        try:
            text = repr(self.evaluate(expression))
            error = False
        except _Refused as e:
            text, error = f"error: {e}", True
        return ToolResult(text, error=error, latency_s=time.perf_counter() - start)

    def evaluate(self, expression: str) -> int | float:
        """The value of `expression`; raises _Refused with the reason when it is not allowed."""
        expression = expression.strip()
        if len(expression) > self.max_chars:
            raise _Refused(f"expression longer than {self.max_chars} characters")
        if not expression:
            raise _Refused("empty expression")
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError as e:
            raise _Refused(f"invalid syntax: {e.msg}") from None
        return self._walk(tree.body)

    def _walk(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise _Refused(f"{type(node.value).__name__} values are not allowed, only "
                               "numbers")
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._checked(_UNARY[type(node.op)](self._walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._walk(node.left), self._walk(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                return self._checked(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise _Refused("division by zero") from None
            except OverflowError:
                raise _Refused("the result is too large") from None
        raise _Refused(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** "
                       "and parentheses")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.max_exponent:
            raise _Refused(f"exponent {exponent} is larger than {self.max_exponent}")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
            # bits(base ** e) <= bits(base) * e: refuse before computing a huge int.
            if (abs(base).bit_length() - 1) * exponent > self.max_digits * math.log2(10):
                raise _Refused(f"the result has more than {self.max_digits} digits")

    def _checked(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise _Refused("the result is a complex number")
        if isinstance(value, float) and not math.isfinite(value):
            raise _Refused("the result is not a finite number")
        if isinstance(value, int) and abs(value).bit_length() > self.max_digits * 3.3 and \
                len(str(abs(value))) > self.max_digits:
            raise _Refused(f"the result has more than {self.max_digits} digits")
        return value

