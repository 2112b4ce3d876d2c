"""The role rules: the table in code (`RULES`) is the table of docs/roles.md, and each rule
decides its case, naming itself in `show()`: ahead of a later rule that would also apply,
where one can (rules 3 and 4, 4 and 5, 5 and 6, 8 and 9, 10 and 11 overlap; the others read disjoint
facts, and their order is held by the page's table)."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import tree_allclose

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
    # rule 6 before rule 13: changed in place
    "changed-in-place": Case(
        _changed, lambda: ({"s": jnp.zeros(2)}, jnp.ones(2)), "totals", "state"
    ),
    # rule 7 before rule 13: a Flax NNX module its method changes
    "mutable-module": Case(_mutated, lambda: (Counter(), jnp.ones(2)), "counter", "state"),
    # rule 8 before rules 9 and 12: a string (a leaf JAX cannot trace), with no leading axis
    "python-scalar": Case(
        _scalar, lambda: (jnp.zeros(()), jnp.ones((4, 3)), "relu"), "act", "static", num_steps=4
    ),
    # rule 9 before rule 12: an optax GradientTransformation, with no leading axis
    "untraceable": Case(
        _untraceable,
        lambda: (jnp.zeros(()), jnp.ones((4, 3)), optax.sgd(0.1)),
        "tx",
        "broadcast",
        num_steps=4,
    ),
    # rule 10 before rule 11: bound by a functools.partial, with a leading axis of num_steps
    "bound-argument": Case(
        functools.partial(_per_step, xs=jnp.ones((4, 3))),
        lambda: (jnp.zeros(()),),
        "xs",
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


def _named_in_some(p, x, frozen=False):
    if frozen:
        return p, jnp.sum(x)
    new_p = {"w": p["w"] - 0.1 * x}
    return new_p, jnp.sum(x)


def _page_evidence(rule: str) -> set[str]:
    """The evidence forms the page's table lists for `rule`, positions written as `N`."""
    text = ROLES_PAGE.read_text(encoding="utf-8").split("## Where roles come from", 1)[1]
    row = next(line for line in text.splitlines() if f"| `{rule}` |" in line)
    cell = re.split(r"(?<!\\)\|", row.strip())[-2]
    return {re.sub(r"\d+", "N", form) for form in re.findall(r"`([^`]*)`", cell)}


@pytest.mark.parametrize("k", [1, 4])
def test_a_parameter_returned_by_name_in_some_returns_has_the_pages_evidence(k):
    """Returned by name in one `return` and under another name in the other: rule 2 leaves it
    to rule 3, whose evidence on the page is "matched by value"; `show()` said "returned by
    name at return position 0 in some returns", which the page's rule 3 does not promise."""
    step = autoflat.step(_named_in_some, num_steps=k)
    x = jnp.ones((k, 2)) if k > 1 else jnp.ones(2)
    step({"w": jnp.zeros(2)}, x)
    line = _role_line(step, "p")
    assert line == (
        "# p: state (matched by value to return position 0, returned by name there in some "
        "returns) [rule: matched-by-value]"
    )
    evidence = re.sub(
        r"\d+", "N", line.removeprefix("# p: ").removesuffix(" [rule: matched-by-value]")
    )
    assert evidence in _page_evidence("matched-by-value")
    new_name = autoflat.step(_new_name, num_steps=4)
    new_name({"w": jnp.zeros(2)}, jnp.ones((4, 2)))
    line = _role_line(new_name, "p").removeprefix("# p: ").removesuffix(" [rule: matched-by-value]")
    assert re.sub(r"\d+", "N", line) in _page_evidence("matched-by-value")


def test_before_the_first_call_what_the_source_leaves_open_is_as_passed():
    step = autoflat.step(_scalar, num_steps=4, broadcast="xs")
    assert _role_line(step, "w") == "# w: scanned (per-step input) [rule: as-passed]"
    assert _role_line(step, "xs") == "# xs: broadcast (broadcast=) [rule: option-or-self]"
    roles = assign_roles(analyse(_scalar), Options(broadcast=frozenset({"xs"})))
    assert roles.rules == ("as-passed", "option-or-self", "as-passed")


# --- a parameter returned at several positions (`return p, p`) -------------------------------
# State also returned as a per-step output, to log its trajectory: the first position that
# names it is its state, the others per-step outputs (stacked at num_steps > 1). It was a
# SourceError saying the returns disagree, naming one line twice.

TX = optax.adam(0.1)


def _loss(params, x):
    return jnp.mean((x * params["w"] + params["b"] - 1.0) ** 2)


def _log_twice(p, x):  # a bare array, returned as state and as its trajectory
    p = p - 0.1 * (p * x - 1.0)
    return p, p


def _log_params(params, opt_state, x):  # optax's quick-start step, params logged too
    loss_value, grads = jax.value_and_grad(_loss)(params, x)
    updates, opt_state = TX.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, params


def _log_in_a_dict(params, x):
    grads = jax.grad(_loss)(params, x)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return {"params": params, "log": params}


def _log_in_branches(p, x, frozen=False):
    if frozen:
        return p, p
    new_p = jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x))
    return new_p, new_p


def _log_old_and_new(p, x, frozen=False):  # `p` named at 0 and 1; at 0 `new_p` in the other
    if frozen:
        return p, p
    new_p = jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x))
    return new_p, p


def _log_beside_an_anchor(params, anchor, x):  # `anchor` alike: never matched to the log
    def loss(p):
        return _loss(p, x) + jnp.sum((p["w"] - anchor["w"]) ** 2)

    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))
    return params, params


def _params():
    return {"b": jnp.zeros(()), "w": jnp.zeros(3)}


def _tuple(n_state):
    return lambda result: (result[:n_state], result[n_state:])


def _dict(result):
    return (result["params"],), result["log"]


_REPEATS = {
    # name: (step, first arguments, unpack(result) -> (state, outputs), `p: ...` header line,
    # the returns line with `{out}` for "output" / "output (stacked)")
    "p, p": (
        _log_twice,
        lambda: (jnp.ones(3),),
        _tuple(1),
        "# p: state (returned at return position 0; position 1 also returns it: a per-step "
        "output) [rule: returned-by-name]",
        "# returns: state p, {out}",
    ),
    "params, opt_state, params": (
        _log_params,
        lambda: (_params(), TX.init(_params())),
        _tuple(2),
        "# params: state (returned at return position 0; position 2 also returns it: a "
        "per-step output) [rule: returned-by-name]",
        "# returns: state params, state opt_state, {out}",
    ),
    "{'params': params, 'log': params}": (
        _log_in_a_dict,
        lambda: (_params(),),
        _dict,
        "# params: state (matched by value to return key 'params'; return key 'log' gives "
        "back the same value: a per-step output) [rule: matched-by-value]",
        "# returns: 'log': {out}, 'params': state params",
    ),
    "p, p | new_p, new_p": (
        _log_in_branches,
        lambda: (_params(),),
        _tuple(1),
        "# p: state (matched by value to return position 0, returned by name there in some "
        "returns) [rule: matched-by-value]",
        "# returns: state p, {out}",
    ),
    "p, p | new_p, p": (
        _log_old_and_new,
        lambda: (_params(),),
        _tuple(1),
        "# p: state (matched by value to return position 0, returned by name there in some "
        "returns) [rule: matched-by-value]",
        "# returns: state p, {out}",
    ),
    "params, params beside an anchor alike": (
        _log_beside_an_anchor,
        lambda: (_params(), {"b": jnp.ones(()), "w": jnp.ones(3)}),
        lambda result: (result[:1], result[1:]),
        "# params: state (returned at return position 0; position 1 also returns it: a "
        "per-step output) [rule: returned-by-name]",
        "# returns: state params, {out}",
    ),
}


def _steps(step, state, rest, xs, k, unpack):
    """8 steps, `k` a call, state carried by the caller; the outputs stacked along steps."""
    logs = []
    for start in range(0, 8, k):
        x = xs[start : start + k] if k > 1 else xs[start]
        state, out = unpack(step(*state, *rest, x))
        logs.append(out if k > 1 else jax.tree.map(lambda a: a[None], out))
    return state, jax.tree.map(lambda *a: jnp.concatenate(a), *logs)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("variant", list(_REPEATS))
def test_state_also_returned_as_a_per_step_output_runs_as_under_jax_jit(variant, k):
    fn, args, unpack, role_line, returns_line = _REPEATS[variant]
    first = args()
    n_state = 1 if fn in (_log_in_a_dict, _log_beside_an_anchor) else len(first)
    state, rest = first[:n_state], first[n_state:]
    xs = jax.random.normal(jax.random.key(0), (8, 3))
    ref_state, ref_log = _steps(jax.jit(fn), state, rest, xs, 1, unpack)
    step = autoflat.step(fn, num_steps=k)
    got_state, got_log = _steps(step, state, rest, xs, k, unpack)
    tree_allclose(got_state, ref_state)
    tree_allclose(got_log, ref_log)  # the trajectory, one entry a step
    shown = autoflat.show(step)
    assert role_line in shown.splitlines()
    out = "output (stacked)" if k > 1 else "output"
    assert returns_line.format(out=out) in shown.splitlines()
    if fn is _log_beside_an_anchor:
        assert "# anchor: state" not in shown  # it was matched to the log, carried as params


def test_returned_at_two_positions_is_state_at_the_first_at_decoration():
    roles = assign_roles(analyse(_log_twice), Options())
    assert roles.state == ("p",)
    assert roles.layout.entries == (("state", 0), ("out", 0))
    roles = assign_roles(analyse(_log_params), Options())
    assert roles.layout.entries == (("state", 0), ("state", 1), ("out", 0))


def test_state_option_picks_another_of_the_positions():
    """`state={"p": 1}` beside `return p, p`: the state is at 1, position 0 the output."""
    step = autoflat.step(_log_twice, num_steps=4, state={"p": 1})
    xs = jax.random.normal(jax.random.key(0), (4, 3))
    log, p = step(jnp.ones(3), xs)
    assert log.shape == (4, 3) and p.shape == (3,)
    tree_allclose(p, log[-1])
    assert "# returns: output (stacked), state p" in autoflat.show(step).splitlines()


def _two_at_one_position(p, s, x, flag=False):
    if flag:
        return p, jnp.sum(x)
    return s, jnp.sum(x)


def _swapped(p, x, flag=False):
    if flag:
        return p, jnp.sum(x)
    return jnp.sum(x), p


@pytest.mark.parametrize("k", [1, 4])
def test_returns_naming_two_parameters_at_one_position_still_disagree(k):
    """What stays an error: two different parameters named at one position across returns,
    and one parameter named only at different positions; each message names two lines."""
    x = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    line = _two_at_one_position.__code__.co_firstlineno
    with pytest.raises(autoflat.SourceError) as info:
        autoflat.step(_two_at_one_position, num_steps=k)(jnp.ones(3), jnp.ones(3), x)
    assert str(info.value).startswith(
        f"The `return` statements of `_two_at_one_position` ({__file__}:{line}) disagree: "
        f"line {line + 2} returns (p, <expr>) but line {line + 3} returns (s, <expr>).\n"
    )
    line = _swapped.__code__.co_firstlineno
    with pytest.raises(autoflat.SourceError) as info:
        autoflat.step(_swapped, num_steps=k)(jnp.ones(3), x)
    assert (
        f"disagree: line {line + 2} returns (p, <expr>) but line {line + 3} returns (<expr>, p)."
        in str(info.value)
    )
