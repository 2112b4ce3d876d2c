"""Donating without losing the caller's arrays.

A donating launch hands the state's buffers to the program, which deletes them. Every buffer
the caller may still reach is copied first, and only those:

- a rebuilt handle's object holds its buffers, and the caller may hold the object, a part of
  it or one of its arrays (`caller_held`); under `lazy=False` only arrays something else
  holds too (`held_elsewhere`, by reference count);
- the same handle as two state arguments (`copy_repeats`);
- a handle given as state and also as another argument, read by the same call
  (`keep_shared`: its state copy is donated, the handle itself stays valid, as under
  `jax.jit`).

Copies go through the runtime in one `device_put` (`copy_leaves`): nothing is compiled per
shape.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _jax
from .._handles.lazy import _UNBUILT, LazyHandle
from .._transport.structure import computed_dtype, is_array


def is_handle(x: Any) -> bool:
    return type(x) is LazyHandle


def copy_leaves(arrays: list[Any]) -> list[Any]:
    """Fresh buffers with the same values and placement (so donation never touches the
    caller's own arrays). Weak types are kept: the step sees what `jax.jit` would give it.
    The arrays of this process's devices are copied by the runtime in one `device_put`:
    nothing compiled per shape, as `jnp.array(a, copy=True)` is (a first call compiled once
    per distinct leaf shape); others (spanning hosts, NumPy) by `jnp.array`."""
    local = [a for a in arrays if _local_array(a)]
    copies = iter(jax.device_put(local, may_alias=False) if local else ())
    return [next(copies) if _local_array(a) else _copy(a) for a in arrays]


def copy_at(arrays: list[Any], indices: list[int]) -> list[Any]:
    """`arrays` with the buffers at these indices copied (`copy_leaves`)."""
    copies = iter(copy_leaves([arrays[i] for i in indices]))
    chosen = set(indices)
    return [next(copies) if i in chosen else a for i, a in enumerate(arrays)]


def _copy(a: Any) -> Any:
    return jnp.array(a, dtype=None if _jax.weak_type(a) else computed_dtype(a.dtype), copy=True)


def _local_array(a: Any) -> bool:
    return isinstance(a, jax.Array) and not _jax.is_tracer(a) and a.is_fully_addressable


def uncaught(step: Any, h: LazyHandle, ours: bool) -> list[Any]:
    """The buffers of handle `h` to donate: its own, but copies of those the caller may hold
    too (`caller_held`: after a rebuild, or under `lazy=False`; or, lent to a traversal,
    `jax.tree.leaves(h)`, those something besides the handle still holds)."""
    buffers = h._af_arrays
    held: list[int] = []
    if step.donate and h._af_structure.immutable:
        held = caller_held(h, ours)
    elif step.donate and h._af_lent and h._af_layout is None:
        held = held_elsewhere(buffers, list(range(len(buffers))), 1)
    if not held:
        return buffers
    step._diag.stats.copies += 1
    return copy_at(buffers, held)


def caller_held(h: LazyHandle, ours: bool) -> list[int]:
    """The buffers of `h`, a handle of immutable structure going in on the fast path, that
    the caller may hold too, by index: to be copied before a donating launch.

    Once `h` is rebuilt (its object read, `autoflat.unwrap(h)`), its object holds the
    buffers that are not packed, and the caller may hold the object, a part of it or one of
    its arrays (`w = model.layers[0].weight`, a snapshot for a checkpoint): all of those are
    copied (the Performance page: reading inside a handle between calls). Under `lazy=False`
    (`ours`) the object is the caller's by design and passing it back uses it up, as a
    handle is: only arrays something else also holds (one kept, one passed as another
    argument of the call) are copied."""
    if h._af_obj is _UNBUILT and not ours:
        return []
    buffers = h._af_arrays
    leaves = LazyHandle._af_leaf_arrays(h)
    in_object = {id(x) for x in leaves}
    held = [i for i, b in enumerate(buffers) if id(b) in in_object]
    if not ours or not held:
        return held
    # Holders of a buffer the object holds, when only we hold it: the handle's list, the
    # object's field, and the list of unpacked leaves the object was built from (packed).
    return held_elsewhere(buffers, held, 2 if leaves is buffers else 3)


def held_elsewhere(
    arrays: list[Any], indices: list[int], holders: int | Sequence[int]
) -> list[int]:
    """Of `arrays[i]` for i in `indices`, those that more than `holders` references
    (`arrays` among them; one number for all, or one per index) refer to: something besides
    autoflat holds them."""
    counts = refcounts(arrays, tuple(indices))
    each = [holders] * len(indices) if isinstance(holders, int) else holders
    return [i for i, n, h in zip(indices, counts, each, strict=True) if n > HELD_BY_US - 3 + h]


def refcounts(leaves: list[Any], positions: tuple[int, ...]) -> list[int]:
    return [sys.getrefcount(leaves[i]) for i in positions]


def _calibrate() -> int:
    """References to a leaf of a returned object that only it holds, as `refcounts` counts
    them: its container, the handle's list of arrays and the list of a flatten (counted by
    the same function, so the interpreter's own references are in it)."""
    leaf = object()
    container_and_handle = [[leaf], [leaf]]
    del leaf
    return refcounts(container_and_handle[1][:], (0,))[0]


HELD_BY_US = _calibrate()


def copy_repeats(call: Any, leaves: list[list[Any]]) -> None:
    """The same handle as two state arguments: donating its buffers twice would fail, so the
    repeats take copies."""
    seen: set[int] = set()
    for k, i in enumerate(call.program.state_idx):
        a = call.args[i]
        if type(a) is LazyHandle and id(a) in seen:
            leaves[k] = copy_leaves(leaves[k])
        seen.add(id(a))


def keep_shared(call: Any, leaves: list[list[Any]], handles: dict[int, LazyHandle]) -> None:
    """A handle given as state and also as another argument (broadcast, per-step) would have
    its buffers donated and read in one call: the state takes a copy, which is donated, and
    the handle's own buffers are not (it stays valid after the call, as under `jax.jit`:
    `target = online` kept for a target network). `handles` gives, per state position, the
    handle donated for it: for a `lazy=False` object that stands for its handle
    (`returned.returned`), the object given as a broadcast argument too is found as itself. (A
    per-step array, the usual batch, holds no handle: not searched.)"""
    args, program = call.args, call.program
    in_xs = handles_in(args, program.scanned_idx)
    # (Only Python's containers are searched among broadcast arguments: a teacher model or a
    # method's instance is walked on no call.)
    containers = [i for i in program.bcast_idx if type(args[i]) in (dict, list, tuple)]
    others = in_xs | handles_in(args, containers) | {id(args[i]) for i in program.bcast_idx}
    call.xs_shared = not in_xs.isdisjoint(map(id, call.donated))
    shared = {
        id(h)
        for k, h in handles.items()
        if id(h) in others or id(args[program.state_idx[k]]) in others
    }
    if shared:
        for k, h in handles.items():
            if id(h) in shared:
                leaves[k] = copy_leaves(leaves[k])
        call.donated = [h for h in call.donated if id(h) not in shared]


def handles_in(args: tuple[Any, ...], indices: Any) -> set[int]:
    """The ids of the handles inside these arguments (`{"teacher": params}`)."""
    return {
        id(x)
        for i in indices
        if not is_array(args[i])
        for x in jax.tree_util.tree_leaves(args[i], is_leaf=is_handle)
        if type(x) is LazyHandle
    }
