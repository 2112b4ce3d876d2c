"""The role rules: the table in code (`RULES`) is the table of docs/roles.md, and each rule
decides its case, naming itself in `show()`: ahead of a later rule that would also apply,
where one can (rules 3 and 4, 4 and 5, 5 and 6, 8 and 9 overlap; the others read disjoint
facts, and their order is held by the page's table)."""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import autoflat
from autoflat._analysis.analysis import analyse
from autoflat._roles.roles import Options, assign_roles
from autoflat._roles.rules import RULES

ROLES_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "roles.md"


def _page_table() -> list[tuple[int, str]]:
    """(order, name) of each row of the rules table under "Where roles come from"."""
    text = ROLES_PAGE.read_text(encoding="utf-8")
    section = text.split("## Where roles come from", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) >= 2 and cells[0].isdigit():
            rows.append((int(cells[0]), cells[1].strip("`")))
        elif rows and not line.startswith("|"):
            break  # the end of the table
    return rows


def test_the_roles_page_lists_the_rules_of_the_code_in_their_order():
    rows = _page_table()
    assert [order for order, _ in rows] == list(range(1, len(rows) + 1))
    assert [name for _, name in rows] == [rule.name for rule in RULES]


# --- one case per rule ----------------------------------------------------------------------


class Counter(nnx.Module):
    def __init__(self):
        self.n = nnx.BatchStat(jnp.zeros(()))

    def bump(self, x):
        self.n[...] = self.n[...] + jnp.sum(x)


@dataclasses.dataclass(frozen=True)
class Case:
    """A step, its options and first call's arguments, and the role and rule of `param`."""

    fn: Callable[..., Any]
    args: Callable[[], tuple[Any, ...]]
    param: str
    role: str
    num_steps: int = 1
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _returned_and_broadcast(w, x):
    return w - x


def _returned_and_assigned(d, x):
    d["w"] = d["w"] + x
    return d


def _new_name(p, x):
    new_p = {"w": p["w"] + jnp.sum(x)}
    return new_p


def _declared_and_assigned(d, x):
    d["w"] = d["w"] + x


def _assigned_and_changed(d, x):
    d["w"] = d["w"] + x
    d.update({"v": x})


def _changed(totals, x):
    totals.update({"s": totals["s"] + x})


def _mutated(counter, x):
    counter.bump(x)


def _scalar(w, xs, act):
    return getattr(jax.nn, act)(w + jnp.sum(xs))


def _untraceable(w, xs, tx):
    return w + jnp.sum(xs)


def _per_step(w, xs):
    return w + jnp.sum(xs)


def _per_step_and_full(w, xs, full):
    return w + jnp.sum(xs) + jnp.sum(full)


def _as_passed(w, x):
    return w + x


CASES = {
    # rule 1 before rule 2: returned by name, but named broadcast=
    "option-or-self": Case(
        _returned_and_broadcast,
        lambda: (jnp.zeros(2), jnp.ones(2)),
        "w",
        "broadcast",
        options={"broadcast": "w"},
    ),
    # rule 2 before rule 5: assigned into, and returned by name
    "returned-by-name": Case(
        _returned_and_assigned, lambda: ({"w": jnp.zeros(2)}, jnp.ones(2)), "d", "state"
    ),
    # rule 3 before rule 4: named state=, and given back under another name
    "matched-by-value": Case(
        _new_name,
        lambda: ({"w": jnp.zeros(2)}, jnp.ones((4, 2))),
        "p",
        "state",
        num_steps=4,
        options={"state": "p"},
    ),
    # rule 4 before rule 5: assigned into, and named state=
    "state-option": Case(
        _declared_and_assigned,
        lambda: ({"w": jnp.zeros(2)}, jnp.ones(2)),
        "d",
        "state",
        options={"state": "d"},
    ),
    # rule 5 before rule 6: changed in place, and assigned into
    "assigned-into": Case(
        _assigned_and_changed,
        lambda: ({"w": jnp.zeros(2), "v": jnp.zeros(2)}, jnp.ones(2)),
        "d",
        "state",
    ),
    # rule 6 before rule 12: changed in place
    "changed-in-place": Case(
        _changed, lambda: ({"s": jnp.zeros(2)}, jnp.ones(2)), "totals", "state"
    ),
    # rule 7 before rule 12: a Flax NNX module its method changes
    "mutable-module": Case(_mutated, lambda: (Counter(), jnp.ones(2)), "counter", "state"),
    # rule 8 before rules 9 and 11: a string (a leaf JAX cannot trace), with no leading axis
    "python-scalar": Case(
        _scalar, lambda: (jnp.zeros(()), jnp.ones((4, 3)), "relu"), "act", "static", num_steps=4
    ),
    # rule 9 before rule 11: an optax GradientTransformation, with no leading axis
    "untraceable": Case(
        _untraceable,
        lambda: (jnp.zeros(()), jnp.ones((4, 3)), optax.sgd(0.1)),
        "tx",
        "broadcast",
        num_steps=4,
    ),
    "leading-axis": Case(
        _per_step, lambda: (jnp.zeros(()), jnp.ones((4, 3))), "xs", "scanned", num_steps=4
    ),
    "no-leading-axis": Case(
        _per_step_and_full,
        lambda: (jnp.zeros(()), jnp.ones((4, 3)), jnp.ones((3, 2))),
        "full",
        "broadcast",
        num_steps=4,
    ),
    "as-passed": Case(_as_passed, lambda: (jnp.zeros(2), jnp.ones(2)), "x", "scanned"),
}


def _role_line(step: Any, param: str) -> str:
    return next(
        line for line in autoflat.show(step).splitlines() if line.startswith(f"# {param}: ")
    )


def test_every_rule_has_a_case():
    assert sorted(CASES) == sorted(rule.name for rule in RULES)


@pytest.mark.parametrize("name", [rule.name for rule in RULES])
def test_each_rule_decides_its_case_and_names_itself(name):
    case = CASES[name]
    step = autoflat.step(case.fn, num_steps=case.num_steps, **case.options)
    step(*case.args())
    line = _role_line(step, case.param)
    assert line.startswith(f"# {case.param}: {case.role} (") and line.endswith(
        f") [rule: {name}]"
    ), line


def _counter(w, step, x):
    return w - 0.1 * x, step + 1


def _layer(w, n):
    return w + jnp.zeros(n).sum()


WEIGHTS = jnp.ones(4)


def _defaulted(w, x, weights=WEIGHTS):
    return w + jnp.sum(x) * jnp.sum(weights)


def _dict_out(p, x):
    return {"w": p["w"] + x}


@pytest.mark.parametrize(
    "case, evidence",
    [
        (
            Case(_counter, lambda: (jnp.zeros(2), 0, jnp.ones((4, 2))), "step", "state", 4),
            "state (a Python int that return position 1 gives back changed: carried as an "
            "array) [rule: python-scalar]",
        ),
        (
            Case(_layer, lambda: (jnp.zeros(()), 3), "n", "static"),
            "static (a Python int the step needs as a concrete value (traced, it raised "
            "TypeError): static, as with static_argnames) "
            "[rule: python-scalar]",
        ),
        (
            Case(_defaulted, lambda: (jnp.zeros(()), jnp.ones((4, 3))), "weights", "broadcast", 4),
            "broadcast (its default value, the same every step) [rule: leading-axis]",
        ),
        (
            Case(
                _dict_out,
                lambda: ({"w": jnp.zeros(2)}, jnp.ones(2)),
                "p",
                "state",
                options={"state": {"p": 0}},
            ),
            "state (state= at return position 0) [rule: state-option]",
        ),
    ],
)
def test_the_other_evidence_of_a_rule_names_it(case, evidence):
    step = autoflat.step(case.fn, num_steps=case.num_steps, **case.options)
    step(*case.args())
    assert _role_line(step, case.param) == f"# {case.param}: {evidence}"


def test_before_the_first_call_what_the_source_leaves_open_is_as_passed():
    step = autoflat.step(_scalar, num_steps=4, broadcast="xs")
    assert _role_line(step, "w") == "# w: scanned (per-step input) [rule: as-passed]"
    assert _role_line(step, "xs") == "# xs: broadcast (broadcast=) [rule: option-or-self]"
    roles = assign_roles(analyse(_scalar), Options(broadcast=frozenset({"xs"})))
    assert roles.rules == ("as-passed", "option-or-self", "as-passed")
