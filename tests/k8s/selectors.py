"""Label and field selectors as the Kubernetes API server parses them (the subset clients send).

Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``,
comma-separated (a comma inside parentheses belongs to the set). Field selectors: ``path=v``,
``path==v``, ``path!=v`` where ``path`` is a dotted path into the object's JSON
(``metadata.name``, ``status.phase``, ``involvedObject.name``, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Predicate = Callable[[Mapping[str, Any]], bool]


class SelectorError(ValueError):
    """A selector the API server would refuse (400 BadRequest)."""


def _split_terms(selector: str) -> list[str]:
    terms: list[str] = []
    current: list[str] = []
    depth = 0
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    terms.append("".join(current).strip())
    return [t for t in terms if t]


_SET = re.compile(r"^(?P<key>[^\s!=()]+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_EQ = re.compile(r"^(?P<key>[^\s!=()]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=(),]*)$")
_EXISTS = re.compile(r"^(?P<neg>!?)\s*(?P<key>[^\s!=(),]+)$")


def _label_check(term: str) -> Callable[[Mapping[str, str]], bool]:
    if match := _SET.match(term):
        key, op = match["key"], match["op"]
        values = {v.strip() for v in match["values"].split(",") if v.strip()}
        return lambda labels: (labels.get(key) in values) == (op == "in")
    if match := _EQ.match(term):
        key, value, equal = match["key"], match["value"], match["op"] != "!="
        return lambda labels: (labels.get(key) == value) == equal
    if match := _EXISTS.match(term):
        key, present = match["key"], not match["neg"]
        return lambda labels: (key in labels) == present
    raise SelectorError(f"unable to parse requirement: {term!r}")


def label_predicate(selector: str | None) -> Predicate:
    """A predicate over a whole object that matches its ``metadata.labels`` against ``selector``."""
    checks = [_label_check(term) for term in _split_terms(selector or "")]

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return matches


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The value at dotted ``path`` as a field selector compares it ('' when absent)."""
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return ""
        value = value.get(part)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _field_check(term: str) -> Predicate:
    match = _EQ.match(term)
    if not match:
        raise SelectorError(f"invalid field selector: {term!r}")
    path, value, equal = match["key"], match["value"], match["op"] != "!="
    return lambda obj: (field_value(obj, path) == value) == equal


def field_predicate(selector: str | None) -> Predicate:
    """A predicate over a whole object for a field selector."""
    checks = [_field_check(term) for term in _split_terms(selector or "")]
    return lambda obj: all(check(obj) for check in checks)
