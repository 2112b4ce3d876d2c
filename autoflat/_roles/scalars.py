"""Python numbers at a step's first call (`infer`): which stay static and which are traced.

With `num_steps=1` Python numbers are traced, as `jax.jit` traces them, unless the step needs
one concrete (`settle_scalars`). Python scalars inside state that a step changes become arrays
before the first call, so the step compiles once; scalars it gives back unchanged stay
static (`scalars_to_array`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._analysis.analysis import Return
from .._handles.writeback import is_mutable_module
from .abstract import SCALARS, eval_one_step, positions_of
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
