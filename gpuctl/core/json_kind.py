"""What kind of JSON value a caller sent, in the words an error message uses.

Every validator that refuses a value names what it got the same way ("expected a
string, got an integer"), whether it checks a request body, a record file or a
proxied request's ``model``.
"""

from __future__ import annotations

from typing import Any


def json_kind(value: Any, *, integers: bool = True) -> str:
    """``"null"``, ``"a boolean"``, ``"an integer"``, ``"a number"``, ``"a string"``,
    ``"an array"`` or ``"an object"``; another Python type by its name.

    ``integers=False`` calls an integer ``"a number"``: JSON has one number type, and
    a client of an OpenAI-compatible API thinks in JSON's terms.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: a bool is an int in Python
        return "a boolean"
    if isinstance(value, int):
        return "an integer" if integers else "a number"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
