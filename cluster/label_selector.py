"""Ray node label selectors (a pool's ``resources.label_selector``) as Ray matches them, so that
preflight counts only the nodes a pool may run on.

Every key of a selector is a condition a node must meet (Ray 2.60's ``LabelSelector``):

- ``"v"``: the node has the label, with value v;
- ``"!v"``: it has not the label with value v (a node without the label is admitted);
- ``"in(a,b)"``: it has the label, with one of the values;
- ``"!in(a,b)"``: it has not the label with one of the values (nor, again, without the label).

Ray checks a selector's syntax when an actor or placement group is created; the config refuses
at load what Ray would refuse, and also what Ray accepts but never matches as written: a space
after a comma (Ray keeps it in the next value, and no label value starts with a space) and a
list without ``in``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# Ray's label syntax (ray/_private/label_utils.py, Kubernetes' rules): 63 characters at most,
# alphanumeric at both ends, "-", "_" and "." between.
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
_KEY_PREFIX = re.compile(rf"(?:{_LABEL})?(?:\.(?:{_LABEL})?)*")  # as permissive as Ray's
_VALUE = re.compile(rf"!?(?:in\({_LABEL}(?:,{_LABEL})*\)|{_LABEL})")


@dataclass(frozen=True)
class LabelCondition:
    """One key of a selector: the node's value for ``key`` is one of ``values`` (``negated``:
    none of them, or the node has no such label)."""

    key: str
    values: frozenset[str]
    negated: bool

    @classmethod
    def parse(cls, key: str, value: str) -> LabelCondition:
        """The condition of a selector value that ``problems`` passed."""
        negated = value.startswith("!")
        body = value[1:] if negated else value
        if body.startswith("in(") and body.endswith(")"):
            return cls(key, frozenset(body[3:-1].split(",")), negated)
        return cls(key, frozenset({body}), negated)

    def admits(self, labels: Mapping[str, str]) -> bool:
        if self.negated:
            return labels.get(self.key) not in self.values
        return self.key in labels and labels[self.key] in self.values


def admits(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` meets every condition of ``selector`` (an empty one: yes)."""
    return all(LabelCondition.parse(k, v).admits(labels) for k, v in selector.items())


def problems(selector: Mapping[str, str]) -> list[str]:
    """One line per key or value of ``selector`` that Ray refuses or would never match."""
    found = []
    for key, value in selector.items():
        key_problem = _key_problem(key)
        if key_problem:
            found.append(key_problem)
        # (an empty value is Ray's too: the node has the label, with an empty value)
        elif value and not _VALUE.fullmatch(value):
            found.append(f"{key}: {_value_problem(value)}")
    return found


def _key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (len(prefix) > 253 or not _KEY_PREFIX.fullmatch(prefix)):
        return f"key {key!r}: its prefix must be DNS labels joined by '.', 253 characters at most"
    if not re.fullmatch(_LABEL, name):
        return (
            f"key {key!r}: its name must be 1 to 63 characters, alphanumeric at both ends, "
            f"'-', '_' and '.' between"
        )
    return None


def _value_problem(value: str) -> str:
    if re.fullmatch(rf"!?in\({_LABEL}(?:, *{_LABEL})*\)", value):
        return (
            f"{value!r}: no spaces after the commas (Ray keeps them in the next value, which "
            f"then matches no node): write {value.replace(' ', '')!r}"
        )
    if re.fullmatch(rf"!?\({_LABEL}(?:, *{_LABEL})*\)", value):
        return f"{value!r}: a list of values needs 'in': write in(...) or !in(...)"
    return (
        f"{value!r}: expected a label value v, !v, in(a,b) or !in(a,b) (a value: 1 to 63 "
        f"characters, alphanumeric at both ends, '-', '_' and '.' between)"
    )
