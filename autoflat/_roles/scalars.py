"""Python numbers at a step's first call (`infer`): which stay static, which are traced, and
which are state (rule 8: counters and accumulators at `num_steps > 1`).

With `num_steps=1` Python numbers are traced, as `jax.jit` traces them, unless the step needs
one concrete (`settle_scalars`). Python scalars inside state that a step changes become arrays
before the first call, so the step compiles once; scalars it gives back unchanged stay
static (`scalars_to_array`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._analysis.analysis import Analysis, Return
from .._errors import NUMBER_ADDED, NUMBER_RENAMED, OptionError, error
from .._handles.writeback import is_mutable_module
from .._transport.structure import attribute
from .abstract import SCALARS, eval_one_step, positions_of
from .flow import SUMS, Flow
from .names import name_at, renamed
from .options import Role
from .roles import Roles

# What tracing a value the step needs concrete raises (`nn.Dense(n)`, `range(n)`, `if n:`).
_NEEDS_CONCRETE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
    TypeError,
)


def settle_scalars(
    fn: Callable[..., Any],
    params: tuple[str, ...],
    values: dict[str, Any],
    for_eval: dict[str, Role],
    scalars: list[str],
) -> tuple[Any, dict[str, str]]:
    """With num_steps=1, Python scalars are traced, as `jax.jit` traces them (a step counter
    compiles once). One the step needs as a concrete value (a layer size, a Python branch)
    fails to trace: it is made static, as `static_argnames` or `eqx.filter_jit` would (each
    value then compiles once; rule 8). Returns one step's abstract output, and the scalars
    made static with the name of the error tracing them raised."""
    try:
        return eval_one_step(fn, params, values, for_eval, 1), {}
    except _NEEDS_CONCRETE as e:
        failure: Exception = e
    trials = [[p] for p in scalars] + ([scalars] if len(scalars) > 1 else [])
    for trial in trials:
        roles = {**for_eval, **dict.fromkeys(trial, "static")}
        try:
            out = eval_one_step(fn, params, values, roles, 1)  # type: ignore[arg-type]
        except _NEEDS_CONCRETE:
            continue
        for p in trial:
            for_eval[p] = "static"
        return out, dict.fromkeys(trial, type(failure).__name__)
    raise failure


def scalars_to_array(
    fn: Callable[..., Any],
    roles: Roles,
    values: dict[str, Any],
    positions: dict[str, int],
    for_eval: dict[str, Role],
    num_steps: int,
    out: Any,
    first: Return | None,
) -> tuple[tuple[int, ...], ...]:
    """Per state position, the leaves that are Python scalars going in and come out as arrays
    or as other values (`step + 1` on a Python int): left static, they would change the state's
    structure every step. Scalars that come back unchanged stay static. "Come out": returned,
    or, for a dict changed in place, as the step leaves it.

    A Flax NNX object written back has all its Python scalar leaves (Variables holding a
    Python number, such as `Count(0)`) made arrays, changed or not, as `nnx.jit` traces them."""
    state = roles.state
    written = set(roles.written_back)
    leaves = {p: jax.tree_util.tree_leaves(values[p]) for p in state}
    scalars = {p: [i for i, x in enumerate(leaves[p]) if isinstance(x, SCALARS)] for p in state}
    nnx = {p for p in written if scalars[p] and is_mutable_module(values[p])}
    after: dict[str, Any] = {p: None for p in written - nnx if scalars[p]}
    if not after and not any(scalars[p] for p in positions if p in scalars):
        return tuple(tuple(scalars[p]) if p in nnx else () for p in state)
    if out is None or after:
        out = eval_one_step(fn, roles.params, values, for_eval, num_steps, after or None)
    outputs = positions_of(first, out)
    result: list[tuple[int, ...]] = []
    for p in state:
        if p in nnx:
            result.append(tuple(scalars[p]))
            continue
        if p in after:
            outs = after[p]
        elif p in positions and outputs:
            outs = jax.tree_util.tree_leaves_with_path(outputs[positions[p]])
        else:
            outs = None
        if not scalars[p] or outs is None:
            result.append(())
            continue
        # Leaves matched by key path: the step may add or drop keys (`d.setdefault(...)`).
        by_path = dict(outs)
        ins = jax.tree_util.tree_leaves_with_path(values[p])
        changed = []
        for i in scalars[p]:
            path, x = ins[i]
            y = by_path.get(path, x)
            if isinstance(y, jax.ShapeDtypeStruct) or (type(y), y) != (type(x), x):
                changed.append(i)
        result.append(tuple(changed))
    return tuple(result)


def counters(
    analysis: Analysis,
    trace: Callable[..., list[Flow] | None],
    num_steps: int,
    numbers: list[str],
    values: dict[str, Any],
    positions: list[int],
    outputs: list[Any],
    places: dict[str, int],
    names: tuple[str | None, ...],
) -> dict[str, int]:
    """With num_steps > 1, Python numbers the step gives back changed at their place among
    the parameters that could be state (`return w, step + 1, lr` for `(w, step, x)`): a
    counter or a decayed rate, carried as an array. Left static (as other Python numbers),
    every step of a call saw the first value, silently. Only a Python number of the same
    type at that place counts: an array there (a loss) says nothing about a static
    `num_classes`, nor a constant `0` about a float rate. Where a number's place holds no
    such value (a broadcast teacher before it among the parameters shifted it), the one
    open position giving back its int plus one (`step + 1`) or a changed number under its
    name (`step = step + 1; return params, step`): a metric made from a static number
    (`epoch // 10 + 1`, `x.shape[0] * n_devices`) is neither. An expression counts for a
    number only if it is computed from it, read off the step traced with the numbers
    traced (`trace`): `step + 1` at the place of an `epoch` before `step` is `step`'s."""
    traced = functools.cache(lambda: trace(frozenset(numbers)))

    def changed(p: str, pos: int) -> bool:
        out = outputs[pos]
        if type(out) is not type(values[p]) or out == values[p]:
            return False
        if name_at(names, pos) is not None:
            return True  # (under a name: `_refuse_renamed` or `renamed` decide)
        flows = traced()  # (None where the step needs a number concrete: the values decide)
        return flows is None or p in flows[pos].sources

    def counted(p: str, pos: int) -> bool:
        plus_one = type(values[p]) is int and outputs[pos] == values[p] + 1
        return changed(p, pos) and (plus_one or renamed(p, pos, names))

    found = {p: places[p] for p in numbers if places.get(p, -1) in positions}
    found = {p: pos for p, pos in found.items() if changed(p, pos)}
    for p, pos in found.items():
        _refuse_renamed(analysis, p, pos, values[p], outputs[pos], names, num_steps)
    open_ = [pos for pos in positions if pos not in found.values()]
    spots = {p: [pos for pos in open_ if counted(p, pos)] for p in numbers if p not in found}
    for p, at in spots.items():  # (one position, claimed by no other number)
        if len(at) == 1 and sum(at[0] in other for other in spots.values()) == 1:
            found[p] = at[0]
    return found


def _refuse_renamed(
    analysis: Analysis,
    p: str,
    pos: int,
    value: Any,
    out: Any,
    names: tuple[str | None, ...],
    num_steps: int,
) -> None:
    """A Python number changed at its place, given back under a name that is neither its
    own (or it with a word for new) nor another parameter's, and not its int plus one:
    `lr = base_lr * 0.1 ** (epoch // 30); return params, lr`. Carried, each step would
    decay the last step's rate again; left static, a count given back under another name
    (`t = step + 2`) would restart every call. Refused, with both fixes."""
    name = name_at(names, pos)
    if name is None or name in analysis.param_names or renamed(p, pos, names):
        return
    if type(value) is int and out == value + 1:
        return
    raise error(
        OptionError, NUMBER_RENAMED, analysis, param=p, pos=pos, returned=name,
        type=type(value).__name__, value=out, old=value, num_steps=num_steps,
    )  # fmt: skip


def accumulated(
    analysis: Analysis,
    trace: Callable[..., list[Flow] | None],
    values: dict[str, Any],
    num_steps: int,
    names: tuple[str | None, ...],
    outs: list[Any],
    positions: list[int],
    numbers: list[str],
    places: dict[str, int],
    found: dict[str, int],
) -> dict[str, int]:
    """With num_steps > 1, Python numbers a return position (at their place, or else the one
    open scalar position made by a sum, `+`) gives back as a scalar array made by an addition
    whose first operand is the number (`total + loss`, from `total=0.0`): accumulators,
    carried as arrays as a `lax.scan` carries them. Read off the step traced with those
    numbers traced, as `jax.jit` traces them (`trace`: `flow.flows_traced` given the
    numbers). Also one computed from the number under its name or it with a word for new
    (`new_ema`). A loss beside a static number (`num_classes`) is not computed from it, a
    product (`loss * scale`) is not a sum, nor is a number added to a loss (`loss + eps`),
    and one the step needs concrete stays static. A sum resumed from a number that is not 0
    may be a constant the step adds to (`eps + loss`): an error names both readings."""
    # Every open scalar position: its place first, then the others (a broadcast batch
    # before it among the parameters shifted it; `return w, loss, total + loss`).
    scalar = [pos for pos in positions if pos not in found.values() and _scalar_array(outs[pos])]
    open_ = [p for p in numbers if p not in found]
    direct = trace(frozenset(open_)) if scalar and open_ else None
    if direct is None:
        return {}
    sums = functools.cache(lambda: trace(frozenset(open_), SUMS))
    added: dict[str, int] = {}
    named: set[str] = set()
    for p in open_:
        # Its own name, or it with a word for new (`new_ema = 0.9 * ema + 0.1 * loss`),
        # computed from it is its new value too, from any start (a shared word alone is
        # not: `loss` beside `loss_weight`).
        by_name = [pos for pos in scalar if p in direct[pos].sources and renamed(p, pos, names)]
        place = places.get(p, -1)
        # Away from its place, only a sum (`target - entropy` is a metric).
        at = by_name or (
            [place]
            if place in scalar and p in direct[place].direct
            else [pos for pos in scalar if pos != place and p in _direct(sums(), pos)]
        )
        if len(at) == 1 and at[0] not in added.values():
            added[p] = at[0]
            named.update([p] if by_name else [])
    for p, pos in added.items():
        if p not in named and values[p] != 0:  # (a sum starts at 0: `eps + loss` may be a constant)
            where = (
                f"sits at the place `{p}` has among the parameters that could be state"
                if pos == places.get(p)
                else "is the one open position so made"
            )
            raise error(
                OptionError, NUMBER_ADDED, analysis, param=p, pos=pos,
                type=type(values[p]).__name__, value=values[p], num_steps=num_steps,
                placed=where,
            )  # fmt: skip
    return added


def _direct(flows: list[Flow] | None, pos: int) -> frozenset[str]:
    """The parameters whose own leaves the last operation making return position `pos`
    takes, or none where the step could not be traced so (`flows_traced` gave None)."""
    return frozenset() if flows is None else flows[pos].direct


def _scalar_array(out: Any) -> bool:
    """A 0-d numeric array (abstract), as a Python number traced becomes."""
    shape, dtype = attribute(out, "shape"), attribute(out, "dtype")
    return shape == () and dtype is not None and jax.dtypes.issubdtype(dtype, np.number)
