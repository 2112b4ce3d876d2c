"""The first call's checks after state is matched: what matching leaves unsettled, refused.

`infer` matches state (rules 2 to 4 and 8) and hands its run to these checks, which raise the
errors of `hazards` and `state_hazards` in a fixed order: a `state=` position holding its
parameter nested; with `num_steps > 1`, state nested in an output, state spread over a
tuple's items, a container whose types change, a container matched by its type alone; a
parameter passed through at another's place, a bare array given back away from its place;
a per-step argument given back (its slice, or its whole shape from a slice: a carry of a
batch of num_steps); leading axes no rule settled; declared state nothing matched. A check
that needs the step's data flow reads it through the run (`flow_of`), so each is traced at
most once per first call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from .._analysis.analysis import Analysis, Return
from .._errors import STATE_NOT_MATCHED, AutoflatError, OptionError, error
from .._transport.structure import attribute, is_array
from . import matching as _matching
from . import names as _names
from .abstract import abstract_leaves, eval_one_step, positions_of, same_value
from .flow import Flow, scalar_container
from .hazards import (
    check_array_per_step_returned,
    check_per_step_returned,
    check_rebound_per_step,
    check_sliced_fails,
    check_whole_per_step,
    raise_leading_axis_errors,
)
from .nesting import refuse_spread_flat, refuse_spread_state
from .options import Options, Role
from .state_hazards import (
    check_state_at,
    refuse_away_from_place,
    refuse_changed_type,
    refuse_nested_state,
    refuse_passed_through,
    refuse_unlinked,
)


class Run(Protocol):
    """What the checks read of one first call's inference (`infer.Inference`)."""

    analysis: Analysis
    options: Options
    fn: Callable[..., Any]
    params: tuple[str, ...]
    values: dict[str, Any]
    num_steps: int
    returned_at: dict[str, int]
    open: list[str]
    kinds: dict[str, Role]
    for_eval: dict[str, Role]
    deferred: dict[str, Exception]
    declared: set[str]
    pending: list[str]
    state_at: dict[str, int]
    by_value: dict[str, int]
    counters: dict[str, int]
    first: Return | None
    open_positions: list[int]
    outputs: list[Any] | None
    out: Any

    def given_back(self, counters: bool = True) -> dict[str, int]: ...
    def evaluate(self) -> Any: ...
    def carried(self) -> list[str]: ...
    def flow_of(self, returned: Return) -> Callable[[], list[Flow]]: ...
    def new_value_of(self, p: str, pos: int, additions_only: bool = False) -> bool: ...
    def gradients(self) -> dict[int, set[str]]: ...
    def only_gradients(self) -> set[int]: ...


def check_state_positions(run: Run) -> None:
    """A `state={"p": 0}` position must hold `p` itself, not nested in it (`check_state_at`)."""
    if run.state_at:
        outputs = positions_of(run.first, run.evaluate())
        check_state_at(run.analysis, run.values, run.state_at, outputs)


def check_matches(run: Run) -> None:
    """Refuse what matching leaves unsettled, in the order of the module doc."""
    first = run.first
    if run.num_steps > 1 and first is not None and first.kind != "none":
        _check_rebound(run, first)
    if run.num_steps > 1 and run.outputs and first is not None:
        _refuse_carried_readings(run, first)
    if first is not None and first.kind != "none":
        _refuse_places(run, first)
    for p in run.counters:
        run.for_eval[p] = "state"
    given_back = run.given_back()
    if run.num_steps > 1 and first is not None and first.kind != "none":
        run.out = check_per_step_returned(
            run.analysis, run.fn, run.params, run.values, run.kinds, run.for_eval, run.options,
            given_back, run.open_positions, first, run.out, run.num_steps,
        )  # fmt: skip
        _check_arrays_per_step(run, first, set(given_back.values()))
        _check_whole_per_step(run, first, set(given_back.values()))
    raise_leading_axis_errors(
        run.analysis,
        {p: k for p, k in run.kinds.items() if p not in given_back},
        run.deferred,
        run.values,
        run.num_steps,
        run.options,
        None,
    )
    missing = sorted(p for p in run.declared if p not in given_back)
    if missing:
        raise error(
            OptionError,
            STATE_NOT_MATCHED,
            run.analysis,
            param=missing[0],
            returns="; ".join(r.describe() for r in run.analysis.returns) or "no return",
        )


def _check_rebound(run: Run, first: Return) -> None:
    """A parameter returned by name, bound again from itself alone, that looks per-step
    (`hazards.check_rebound_per_step`); the step's data flow read only for such a one."""
    state = {*run.returned_at, *run.given_back()}
    moving = frozenset(q for q, role in run.for_eval.items() if role == "scanned") | state

    def varying(p: str) -> frozenset[str]:
        return moving - {p}

    check_rebound_per_step(
        run.analysis, run.options, run.returned_at, run.values, run.num_steps, varying,
        lambda pos: run.flow_of(first)()[pos],
    )  # fmt: skip


def _refuse_carried_readings(run: Run, first: Return) -> None:
    """With num_steps > 1, what a `lax.scan` carry cannot be or would get wrong: state nested
    in an output or spread over a tuple's items, a container whose types change, a
    container matched by its type alone (`state_hazards`, `nesting`)."""
    analysis, values, num_steps, outputs = run.analysis, run.values, run.num_steps, run.outputs
    assert outputs
    flow = run.flow_of(first)
    given = run.given_back(counters=False)
    if not first.derivative:  # (`return jax.value_and_grad(f)(params, x)`: gradients inside)
        refuse_nested_state(
            analysis, values, run.pending, given, run.open_positions, outputs, num_steps, flow
        )
    refuse_spread_state(
        analysis, values, run.pending, {**run.returned_at, **run.given_back()}, outputs, num_steps
    )
    _refuse_spread_flat(run)
    per_step = frozenset(p for p, role in run.for_eval.items() if role == "scanned")
    refuse_changed_type(
        analysis, values, run.pending, given, run.open_positions, outputs, num_steps,
        run.new_value_of, flow, per_step,
    )  # fmt: skip
    models = frozenset(p for p in run.given_back() if _of_a_model(values[p]))
    refuse_unlinked(
        analysis, values, run.by_value, outputs, flow,
        lambda p, pos: _names.named_as_gradients(p, pos, first.names),
        lambda p, pos: _names.named_within(p, pos, first.names),
        run.new_value_of, run.only_gradients(), num_steps, per_step, per_step | models,
    )  # fmt: skip


def _refuse_places(run: Run, first: Return) -> None:
    """A parameter passed through at another's place; with num_steps > 1, a bare array given
    back away from its place (`state_hazards`)."""
    carried = [p for p in run.params if p in run.carried()]
    places = _matching.places(carried, first)
    refuse_passed_through(
        run.analysis, run.options, run.values, run.returned_at, places, run.num_steps
    )
    if run.num_steps > 1 and run.outputs:
        refuse_away_from_place(
            run.analysis, run.values, run.pending, run.given_back(counters=False),
            run.open_positions, run.outputs, run.flow_of(first), places, first.names,
            run.gradients(), run.num_steps,
        )  # fmt: skip


def _refuse_spread_flat(run: Run) -> None:
    """`nesting.refuse_spread_flat`, over the written tuple's positions, or over the items
    of the tuple one returned expression gives where nothing matched inside it
    (`return _inner(*train_state, x, y)`)."""
    first, outputs = run.first, run.outputs
    given_back = {**run.returned_at, **run.given_back()}
    assert first is not None and outputs
    if first.kind == "single" and type(outputs[0]) is tuple and not given_back:
        first = dataclasses.replace(
            first, kind="tuple", names=(None,) * len(outputs[0]), gradients=(), updates=()
        )
        outputs = list(outputs[0])
    elif first.kind != "tuple" or first.nest is not None:
        return
    refuse_spread_flat(
        run.analysis, run.values, run.pending, given_back, outputs, run.num_steps,
        run.flow_of(first), first.names, items_of_one=first is not run.first,
    )  # fmt: skip


def _check_arrays_per_step(run: Run, first: Return, taken: set[int]) -> None:
    """A bare array taken per-step by its leading axis (rule 10), whose place among the
    parameters that could be state (counted as if it were one) is an open return position,
    returned there under a name that shares a word with it (`v2`): refused where both
    readings type-check (`hazards`). An expression there (`x + noise`) is a per-step output
    of a per-step input, as the leading axis says."""
    left = [pos for pos in run.open_positions if pos not in taken]
    bare = [
        p
        for p in run.open
        if run.kinds.get(p) == "scanned"
        and is_array(run.values[p])
        and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(run.values[p]))
    ]
    if not (left and bare):
        return
    carried = run.carried()
    places = {}
    for p in bare:
        found = _matching.places(
            [q for q in run.params if q in carried or q in run.counters or q == p], first
        )
        # Only under a name that may be its own (`v2`, `updated`, `p_next` for `params`):
        # read off the source before any evaluation.
        if found.get(p) in left and _names.may_name(p, found[p], first.names):
            places[p] = found[p]
    if not places:
        return

    whole = functools.partial(_carried_whole, run, first)

    try:
        outputs = positions_of(first, run.evaluate())
    except AutoflatError:
        raise  # (asked already, by the evaluation: `infer.Inference.evaluate`)
    except Exception as e:
        traces = [
            p
            for p in places
            if (back := whole(p)) is not None and same_value(run.values[p], back[places[p]])
        ]
        check_sliced_fails(run.analysis, traces, e, run.num_steps)
        return  # the step's own trace raises it again, with its line
    if not outputs:
        return
    check_array_per_step_returned(run.analysis, run.values, places, outputs, whole, run.num_steps)


def _of_a_model(value: Any) -> bool:
    """Whether state is more than scalars (a counter, a schedule's step, a tuple of them):
    what a loss is computed from, with the batch (`state_hazards._weighs`)."""
    return not (scalar_container(value) or (is_array(value) and value.shape == ()))


def _check_whole_per_step(run: Run, first: Return, taken: set[int]) -> None:
    """An argument taken per-step by its leading axis (rule 10) that one step gives back
    with its whole structure and shapes (`_partly_whole`) at an open return position that
    looks like a carry's new value (`_carried_there`: a contraction taking its own value,
    `h @ wh`, as a recurrent cell computes its new state, or a name sharing a word with
    it), an expression or a container written in the return as much as a name: refused
    where carried whole it is given back so too (`hazards.check_whole_per_step`). A per-step
    schedule, label or shift broadcast against a batch of num_steps (`beta * per_example`,
    `x + shift`) gives back that shape too, only elementwise: a per-step output, as the
    leading axis says. The data flow is read only where such a shape is given back."""
    left = [pos for pos in run.open_positions if pos not in taken]
    scanned = [
        p for p in run.open if run.kinds.get(p) == "scanned" and p not in run.options.per_step
    ]
    if not (left and scanned):
        return
    try:
        outputs = positions_of(first, run.evaluate())
    except AutoflatError:
        raise  # (the question of an argument the step fails on sliced)
    except Exception:
        return  # (the step's own trace raises it, with its line)
    there = [pos for pos in left if pos < len(outputs)]
    shaped = {
        p: [pos for pos in there if _partly_whole(run.values[p], outputs[pos])] for p in scanned
    }
    if not any(shaped.values()):
        return
    flows = run.flow_of(first)()
    hits = {
        p: [pos for pos in at if _carried_there(p, pos, flows[pos], first)]
        for p, at in shaped.items()
    }
    check_whole_per_step(
        run.analysis, run.values, hits, functools.partial(_carried_whole, run, first),
        run.num_steps,
    )  # fmt: skip


def _carried_there(p: str, pos: int, here: Flow, first: Return) -> bool:
    """Whether return position `pos` looks like the new value of a carry `p`: computed from a
    contraction taking its own value (`Flow.mixed`: `h @ wh`), or from it under a name
    sharing a word with it (`names.named_after`: `new_state` for `state`, BatchNorm
    statistics updated elementwise; not `upd` for a per-step `lr`, `upd = lr * g`)."""
    return p in here.mixed or (p in here.sources and _names.named_after(p, pos, first.names))


def _partly_whole(value: Any, out: Any) -> bool:
    """Whether `out` has `value`'s structure, each leaf of its whole shape and dtype or its
    slice's, one whole at least: a carry `(h, t)` whose hidden state comes back whole and
    whose counter `t + 1` keeps one step's shape."""
    if same_value(value, out):
        return True
    rebuild, sliced = abstract_leaves(value, drop_axis=True)
    _, whole = abstract_leaves(value, drop_axis=False)
    leaves, treedef = jax.tree_util.tree_flatten(out)
    structure: Any = jax.tree_util.tree_structure(rebuild(sliced))
    if structure != treedef or len(leaves) != len(whole):
        return False
    kinds = [
        "whole" if _fits(o, w) else "slice" if _fits(o, s) else None
        for o, w, s in zip(leaves, whole, sliced, strict=True)
    ]
    return None not in kinds and "whole" in kinds


def _fits(out: Any, abstract: Any) -> bool:
    return np.shape(out) == abstract.shape and attribute(out, "dtype") == abstract.dtype


def _carried_whole(run: Run, first: Return, p: str) -> list[Any] | None:
    """One step's return positions with `p` carried whole, as state; None where so the step
    does not evaluate (then `p` is not state)."""
    try:
        out = eval_one_step(
            run.fn, run.params, run.values, {**run.for_eval, p: "state"}, run.num_steps
        )
    except Exception:
        return None
    return positions_of(first, out)
