"""cluster/label_selector.py: Ray's label selector values, matched as Ray matches them (Ray's own
matcher is the oracle), and the values refused before Ray sees them."""

from __future__ import annotations

import pytest

from cluster.label_selector import admits, problems

NODES = [
    {},
    {"zone": "a"},
    {"zone": "b"},
    {"zone": "c", "gpu": "H200"},
    {"zone": "", "gpu": "A100"},
]
SELECTORS = [
    {},
    {"zone": "a"},
    {"zone": "!a"},
    {"zone": "in(a,b)"},
    {"zone": "!in(a,b)"},
    {"zone": "in(c)"},
    {"zone": ""},
    {"gpu": "!H200"},
    {"zone": "!in(a,b)", "gpu": "in(H200,A100)"},
    {"missing": "!x", "zone": "c"},
    {"zone": "in(a, b)"},  # (refused by the config: Ray reads " b", so zone b is not admitted)
]


@pytest.mark.parametrize("selector", SELECTORS, ids=str)
def test_matches_as_ray_does(selector: dict[str, str]) -> None:
    raylet = pytest.importorskip("ray._raylet")
    ray_matches = getattr(raylet, "node_labels_match_selector", None)
    if ray_matches is None:
        pytest.skip("this Ray has no node_labels_match_selector")
    for labels in NODES:
        assert admits(selector, labels) == ray_matches(labels, selector), labels


def test_what_each_operator_admits() -> None:
    def admitted(selector: dict[str, str]) -> list[int]:
        return [i for i, labels in enumerate(NODES) if admits(selector, labels)]

    assert admitted({"zone": "a"}) == [1]
    assert admitted({"zone": "!a"}) == [0, 2, 3, 4]  # a node without the label too
    assert admitted({"zone": "in(a,b)"}) == [1, 2]
    assert admitted({"zone": "!in(a,b)"}) == [0, 3, 4]
    assert admitted({"zone": "!in(a,b)", "gpu": "in(H200,A100)"}) == [3, 4]
    assert admitted({}) == [0, 1, 2, 3, 4]


def test_refused_values_say_what_to_write() -> None:
    assert problems({"zone": "a", "ray.io/accelerator-type": "!in(H100,H200)", "x": ""}) == []
    assert problems({"zone": "in(a, b)"}) == [
        "zone: 'in(a, b)': no spaces after the commas (Ray keeps them in the next value, which "
        "then matches no node): write 'in(a,b)'"
    ]
    assert problems({"zone": "!(a,b)"}) == [
        "zone: '!(a,b)': a list of values needs 'in': write in(...) or !in(...)"
    ]
    assert problems({"zone": "in()", "-k": "a"}) == [
        "zone: 'in()': expected a label value v, !v, in(a,b) or !in(a,b) (a value: 1 to 63 "
        "characters, alphanumeric at both ends, '-', '_' and '.' between)",
        "key '-k': its name must be 1 to 63 characters, alphanumeric at both ends, '-', '_' and "
        "'.' between",
    ]
