"""The calculator: Python's arithmetic on a whitelisted ast, limits as error results."""

import pytest

from jaxrl.envs.calculator import Calculator


@pytest.mark.parametrize("expression, value", [
    ("(3 + 4) * -2 ** 3 // 5", "-12"),
    ("7 / 2", "3.5"),
    ("6 / 3", "2.0"),
    ("7 // 2", "3"),
    ("-7 % 3", "2"),
    ("2 ** -1", "0.5"),
    ("0.1 + 0.2", "0.30000000000000004"),
    ("+5 - -5", "10"),
    ("2 ** 332", str(2 ** 332)),
    ("  1_000 * 3  ", "3000"),
])
def test_values(expression, value):
    result = Calculator()({"expression": expression})
    assert (result.text, result.error, result.timed_out) == (value, False, False)


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('ls')", "Call is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("[1, 2][0]", "Subscript is not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("'a' * 3", "str values are not allowed"),
    ("True + 1", "bool values are not allowed"),
    ("1j * 2", "complex values are not allowed"),
    ("9 ** 9 ** 9", "exponent 387420489 is larger than 10000"),
    ("10 ** 10000", "more than 100 digits"),
    ("10 ** 100", "more than 100 digits"),
    ("(10 ** 60) * (10 ** 60)", "more than 100 digits"),
    ("2.0 ** 5000", "too large"),
    ("1e308 * 10", "not a finite number"),
    ("(-8) ** 0.5", "complex number"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("1 +", "invalid syntax"),
    ("", "empty expression"),
    ("1+" * 150 + "1", "longer than 200 characters"),
])
def test_refusals_are_error_results(expression, why):
    result = Calculator()({"expression": expression})
    assert result.error and not result.timed_out
    assert result.text.startswith("error: ") and why in result.text


def test_arguments():
    assert Calculator()({"expr": "1+1"}).text == "2"  # a lone argument, whatever its name
    assert Calculator()({"input": "2*3"}).text == "6"  # the tags format's
    missing = Calculator()({})
    assert missing.error and "expected one string argument 'expression'" in missing.text
    wrong = Calculator()({"expression": 12})
    assert wrong.error and "must be a string, got int" in wrong.text


def test_limits_are_fields():
    assert Calculator(max_digits=400)({"expression": "2 ** 1000"}).text == str(2 ** 1000)
    assert Calculator(max_chars=3)({"expression": "1+1+1"}).error
