"""The helpers that generated code calls, inside the trace: `HELPERS`.

Generated code (see `autoflat.show`) calls them by the names in `HELPERS`: `unflatten` turns a
state argument's leaves back into the user's object, `flatten` turns the state a step returns
into leaves of the structure it came in with (or raises, naming what changed) and `resolved`
does it again once the step has returned (after a `finally` block), and `scan`
runs the steps of one call as a `lax.scan`, checking the leading axis of per-step inputs and
that the state keeps its shapes and dtypes from step to step, by `lax.scan`'s own rule: a
weakly typed leaf (made from a Python number) may come back of another dtype, and the scan
carries it promoted to that dtype from the first step.

`capturing(spec)` records, while `spec` is traced, one step's return value as the user's step
gives it, abstract (`_roles.abstract.abstract_return`): what a first call's role inference
reads, taken from the program's own trace (`_runtime.trial`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax
from .._errors import (
    BAD_SCAN_LENGTH,
    NNX_SHARED_ANEW,
    PER_STEP_AFTER_BROADCAST,
    PER_STEP_ECHO,
    STRUCTURE_BROADCAST,
    STRUCTURE_BROADCAST_LONGER,
    STRUCTURE_BROADCAST_SHORTER,
    STRUCTURE_CHANGED,
    STRUCTURE_FIXED,
    STRUCTURE_RETURNED_PER_STEP,
    STRUCTURE_SCALAR,
    ShapeError,
    StateError,
    error,
)
from .._handles import nnx as _nnx
from .._handles.lazy import LazyHandle
from .._roles.abstract import abstract_return
from .._transport import structure as _structure
from .._transport.structure import FlatState, flatten

# Per thread, a stack of scopes, one per traced call (`linking`): the Variables of Flax NNX
# state that later state imports (`_nnx.Link`), by state position; and the call's broadcast
# arguments, which a structure error may name (`_read_as_broadcast`).
_scopes = threading.local()


@contextlib.contextmanager
def linking(broadcast: tuple[FlatState, ...] = ()) -> Iterator[None]:
    """The scope in which one traced call's state arguments share Flax NNX Variables, and in
    which its `broadcast` arguments are known."""
    stack = _scopes.__dict__.setdefault("stack", [])
    bcast = _scopes.__dict__.setdefault("broadcast", [])
    stack.append({})
    bcast.append(broadcast)
    try:
        yield
    finally:
        stack.pop()  # no tracer outlives its trace here
        bcast.pop()


@contextlib.contextmanager
def capturing(spec: Any) -> Iterator[list[Any]]:
    """While `spec` is traced in this context, the first step's return value (see the module
    doc) lands in the list given (left empty if the trace never got there)."""
    found: list[Any] = []
    before = _scopes.__dict__.get("capture")
    _scopes.capture = (spec, found)
    try:
        yield found
    finally:
        _scopes.capture = before


def captured(spec: Any, state: tuple[FlatState, ...], outputs: tuple[Any, ...]) -> None:
    """One step of `spec` returned `state` (flattened) and `outputs` (in the trace): recorded
    when `capturing(spec)` asks, as the user's step returned them."""
    capture = _scopes.__dict__.get("capture")
    layout = spec.program.roles.layout
    if capture is None or capture[0] is not spec or capture[1] or layout.kind == "unpacked":
        return
    items = [
        state[i].structure.unflatten(state[i].arrays) if kind == "state" else outputs[i]
        for kind, i in layout.entries
    ]
    capture[1].append(abstract_return(layout.build(items)))


def _unflatten(flat: FlatState) -> Any:
    value = flat.structure.unflatten(flat.arrays)
    if flat.link is not None:
        value = _nnx.relink(flat.link, value, _scopes.stack[-1])
    return value


class _Pending:
    """A state value a `return` gives back, flattened again once the step has returned
    (`resolved`): after a `finally` block that changes it, as `jax.jit` flattens what the
    function returned. (Both happen while the step is traced, never per call.)"""

    __slots__ = ("spec", "index", "value")

    def __init__(self, spec: Any, index: int, value: Any) -> None:
        self.spec, self.index, self.value = spec, index, value


def _flatten(spec: Any, index: int, value: Any) -> _Pending:
    _flat(spec, index, value)  # (a state it cannot carry raises here, at the user's `return`)
    return _Pending(spec, index, value)


def resolved(state: tuple[Any, ...]) -> tuple[FlatState, ...]:
    """The state a step returned, flattened now that the step has returned."""
    return tuple(_flat(p.spec, p.index, p.value) if type(p) is _Pending else p for p in state)


def _flat(spec: Any, index: int, value: Any) -> FlatState:
    if type(value) is LazyHandle:
        value = LazyHandle._af_get(value)
    structure, arrays = flatten(value)
    if not (spec.links and spec.links[index]):
        shared = _nnx.shared_anew(value)
        if shared is not None:
            param = spec.program.roles.state[index]
            first, second = (f"{param}{path}" for path in shared)
            raise error(StateError, NNX_SHARED_ANEW, spec.fn, first=first, second=second)
    expected = spec.structures[index]
    if structure is not expected and structure.key == expected.key:
        structure = expected  # equal, though interned apart (after `autoflat.clear_caches()`)
    if spec.num_steps > 1 and structure is not expected:
        _changed(spec, index, expected, None, structure, arrays)
    # The scan's carry keeps the link of the state it came in as.
    return FlatState(structure, arrays, None, spec.links[index] if spec.links else None)


def _scan(
    step: Callable[..., Any], spec: Any, init: tuple[FlatState, ...], xs: tuple[Any, ...]
) -> Any:
    names = spec.program.roles.of("scanned")
    lengths: dict[int, str] = {}  # leading axis -> the first input (by path) that has it
    for path, leaf in jax.tree_util.tree_flatten_with_path(xs)[0]:
        shape = np.shape(leaf)
        where = _input_name(names, path)
        if not shape:
            _bad_length(spec, f"the per-step input `{where}` is a scalar, with no leading axis")
        lengths.setdefault(shape[0], where)
    if len(lengths) > 1:
        found = ", ".join(f"`{w}` has {n}" for n, w in sorted(lengths.items()))
        _bad_length(spec, f"per-step inputs disagree on their leading axis: {found}")
    length = next(iter(lengths)) if lengths else spec.num_steps
    if length > spec.num_steps:
        _bad_length(spec, f"per-step inputs have a leading axis of {length}, more than num_steps")

    def checked(carry: Any, x: Any) -> Any:
        new_carry, ys = step(carry, x)
        new_carry = resolved(new_carry)
        captured(spec, new_carry, ys)
        for i, (old, new) in enumerate(zip(carry, new_carry, strict=True)):
            for a, b in zip(old.arrays, new.arrays, strict=True):
                if (a.shape, a.dtype) != (jnp.shape(b), jnp.result_type(b)) and not (
                    _jax.weak_type(a) and a.shape == jnp.shape(b)
                ):
                    _changed(spec, i, old.structure, old.arrays, new.structure, new.arrays, carry)
        # (A weakly typed leaf of another dtype: `lax.scan` promotes it and traces again.)
        return new_carry, ys

    return jax.lax.scan(checked, init, xs, length=length, unroll=spec.unroll)


def _changed(
    spec: Any,
    index: int,
    old: Any,
    old_arrays: Any,
    new: Any,
    new_arrays: Any,
    carry: Any = None,
) -> None:
    param = spec.program.roles.state[index]
    advice = _read_as_broadcast(spec, old_arrays, new_arrays)
    if advice is None and carry is not None and _reshaped(old_arrays, new_arrays):
        advice = _returned_per_step(spec, carry)
    if advice is None:
        advice = STRUCTURE_SCALAR if _structure.static_changed(old, new) else STRUCTURE_FIXED
    raise error(
        ShapeError,
        STRUCTURE_CHANGED,
        spec.fn,
        param=param,
        diff=_structure.describe_difference(param, old, old_arrays, new, new_arrays),
        num_steps=spec.num_steps,
        advice=advice,
    )


def _read_as_broadcast(spec: Any, old_arrays: Any, new_arrays: Any) -> str | None:
    """Where the state's new shapes hold the leading axis of an argument read as broadcast by
    its shape (rule `no-leading-axis`: a leading axis other than num_steps), the advice that
    names it; else None."""
    scopes = _scopes.__dict__.get("broadcast")
    if not scopes or old_arrays is None:
        return None
    dims = {
        d
        for a, b in zip(old_arrays, new_arrays, strict=True)
        if tuple(np.shape(a)) != tuple(np.shape(b))
        for d in np.shape(b)
    }
    roles = spec.program.roles
    by_shape = {
        p: rule == "no-leading-axis"
        for p, role, rule in zip(roles.params, roles.roles, roles.rules, strict=True)
        if role == "broadcast"
    }
    k = spec.num_steps
    for p, flat in zip(roles.of("broadcast"), scopes[-1], strict=False):
        axes = {np.shape(a)[0] for a in flat.arrays if np.ndim(a)}
        if not by_shape[p] or len(axes) != 1:
            continue
        axis = axes.pop()
        if axis != k and axis in dims:
            fix = STRUCTURE_BROADCAST_LONGER if axis > k else STRUCTURE_BROADCAST_SHORTER
            fields = {"arg": p, "axis": axis, "num_steps": k}
            return STRUCTURE_BROADCAST.format(fix=fix.format(**fields), **fields)
    return None


def _reshaped(old_arrays: Any, new_arrays: Any) -> bool:
    """Whether a leaf of the state changed its shape (not only its dtype)."""
    return old_arrays is not None and any(
        tuple(np.shape(a)) != tuple(np.shape(b))
        for a, b in zip(old_arrays, new_arrays, strict=True)
    )


def _returned_per_step(spec: Any, carry: Any) -> str | None:
    """Where a parameter is state because the step returns it by name (rule 2) and every
    array in it leads with num_steps (a per-step input normalised, then returned), the
    advice that names it: carried whole, every step saw the whole chunk; else None."""
    roles, k = spec.program.roles, spec.num_steps
    rules = dict(zip(roles.params, roles.rules, strict=True))
    for p, flat in zip(roles.state, carry, strict=True):
        arrays = flat.arrays
        if (
            rules.get(p) == "returned-by-name"
            and arrays
            and all(np.ndim(a) and np.shape(a)[0] == k for a in arrays)
        ):
            return STRUCTURE_RETURNED_PER_STEP.format(arg=p, num_steps=k)
    return None


def refuse_per_step_arrays(spec: Any, leaves: tuple[list[Any], ...]) -> None:
    """In a trace (a call with new structures or shapes): raise a `ShapeError` where an
    argument read as broadcast by its shapes at the first call (rule `no-leading-axis`: no
    array with a leading axis of num_steps, or no array at all) now holds one with that axis
    (`*extra` given one more item, a dict one more key, a mask of other shape): nothing says
    it is the same for every step, and read so, every step would see the whole chunk."""
    program, k = spec.program, spec.num_steps
    params = program.roles.of("broadcast")
    reasons = dict(zip(program.roles.params, program.roles.reasons, strict=True))
    for j in program.by_shape_bcast:
        per_step = [a for a in leaves[j] if np.ndim(a) >= 1 and np.shape(a)[0] == k]
        if per_step:
            p = params[j]
            raise error(
                ShapeError,
                PER_STEP_AFTER_BROADCAST,
                spec.fn,
                param=p,
                first=reasons[p].removesuffix(" at the first call"),
                shape=f"{per_step[0].dtype}{list(np.shape(per_step[0]))}",
                num_steps=k,
                echo=_echo(p, dict(program.roles.echoes), k),
            )


def _echo(param: str, echoes: dict[str, int], k: int) -> str:
    """PER_STEP_AFTER_BROADCAST's third reading, where a per-step output could be the new
    value of `param` (`Roles.echoes`): those outputs, stacked, passed back in."""
    pos = echoes.get(param)
    if pos is None:
        return ""
    return PER_STEP_ECHO.format(param=param, pos=pos, num_steps=k)


def _input_name(names: tuple[str, ...], path: tuple[Any, ...]) -> str:
    """`batch['label']`: a leaf of the per-step inputs (a tuple, one per scanned parameter)."""
    first = path[0] if path else None
    index = getattr(first, "idx", None)
    if index is None or index >= len(names):
        return jax.tree_util.keystr(path)
    return names[index] + jax.tree_util.keystr(tuple(path[1:]))


def _bad_length(spec: Any, reason: str) -> None:
    raise error(
        ShapeError,
        BAD_SCAN_LENGTH,
        spec.fn,
        num_steps=spec.num_steps,
        reason=reason,
        scanned=", ".join(spec.program.roles.of("scanned")) or "(none)",
        last=spec.num_steps - 1,
    )


def _items(value: Any, keys: tuple[Any, ...]) -> tuple[Any, ...]:
    """The values of the dict a step returns (`return {"params": ..., "loss": ...}`), in the
    order of the keys it had at the first call, which are its return positions."""
    if not isinstance(value, dict) or set(value) != set(keys):
        got = sorted(map(repr, value)) if isinstance(value, dict) else type(value).__name__
        raise ShapeError(
            f"the step returned {got}, where its first call returned a dict with the keys "
            f"{sorted(map(repr, keys))}, which are its return positions: return the same keys "
            "from every call"
        )
    return tuple(value[k] for k in keys)


HELPERS = {"unflatten": _unflatten, "flatten": _flatten, "scan": _scan, "items": _items}
