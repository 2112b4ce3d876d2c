"""`lazy=False`: an object the step returned last call, coming back in as its handle.

A step with `lazy=False` returns real objects built from its handles (`finish`) and keeps
each with its handle (`Step._last`). When the caller passes such an object back, `returned`
says whether it goes in as the handle (its interned structure and buffers, no flatten) and
whether its arrays must be copied before a donating launch.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import jax

from .._handles import writeback as _writeback
from .._handles.lazy import _UNBUILT, LazyHandle
from .program import Program


def returned(step: Any, program: Program, copies: list[int], k: int, h: LazyHandle, a: Any) -> bool:
    """`lazy=False`: whether `a`, the object this step returned as state `k` last call, goes in
    as its handle `h` (the fast path: `h`'s interned structure and buffers as they are).

    Of immutable structure (an Equinox module, optax's tuples), always: it cannot have
    changed (`call._take_state` still refuses a consumed `h`). A mutable one (a dict) may have
    been changed in place since: it is flattened, and goes in as `h` only while its tree and
    every leaf, by identity, are still those it was built from, so no structure is interned
    and no placement read again. Its arrays are the caller's too: they are copied before a
    donating launch (`copies`: the call's) unless nothing else holds them (an array the caller kept
    stays valid). Else `a` is taken as any other value (`call._take_flattened`), its arrays still
    ours to donate where unchanged (`_writeback.all_ours`). State written back into the
    caller's objects (Flax NNX) is never taken here."""
    structure = h._af_structure
    if structure.immutable:
        return True
    if h._af_consumed_by or any(j == k for j, _ in program.written_back_idx):
        return False
    leaves, treedef = jax.tree_util.tree_flatten(a)
    arrays = LazyHandle._af_leaf_arrays(h)
    if treedef != structure.treedef or not all(
        map(operator.is_, leaves, structure.all_leaves(arrays))
    ):
        # Changed in place: flattened again there, with the arrays it still holds ours.
        _writeback.record_written(arrays, a)
        return False
    step._diag.stats.flattens += 1
    if (
        step.donate
        and h._af_layout is None  # (packed, the buffers are not the caller's leaves)
        and max(_refcounts(leaves, structure.array_positions), default=0) > _HELD_BY_US
    ):
        copies.append(k)
    return True


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


def held_elsewhere(arrays: list[Any], indices: list[int], holders: int) -> list[int]:
    """Of `arrays[i]` for i in `indices`, those that more than `holders` containers (`arrays`
    among them) refer to: something besides autoflat holds them."""
    expected = _HELD_BY_US - 3 + holders
    counts = _refcounts(arrays, tuple(indices))
    return [i for i, n in zip(indices, counts, strict=True) if n > expected]


def _refcounts(leaves: list[Any], positions: tuple[int, ...]) -> list[int]:
    return [sys.getrefcount(leaves[i]) for i in positions]


def _calibrate() -> int:
    """References to a leaf of a returned object that only it holds, as `returned` counts
    them: its container, the handle's list of arrays and the list of a flatten (counted by
    the same function, so the interpreter's own references are in it)."""
    leaf = object()
    container_and_handle = [[leaf], [leaf]]
    del leaf
    return _refcounts(container_and_handle[1][:], (0,))[0]


_HELD_BY_US = _calibrate()
