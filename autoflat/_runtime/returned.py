"""`lazy=False`: an object the step returned last call, coming back in as its handle.

A step with `lazy=False` returns real objects built from its handles (`finish`) and keeps
each with its handle (`Step._last`). When the caller passes such an object back, `returned`
says whether it goes in as the handle (its interned structure and buffers, no flatten) and
whether its arrays must be copied before a donating launch.
"""

from __future__ import annotations

import operator
from typing import Any

import jax

from .._handles import writeback as _writeback
from .._handles.lazy import LazyHandle
from .donation import HELD_BY_US, refcounts
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
        and max(refcounts(leaves, structure.array_positions), default=0) > HELD_BY_US
    ):
        copies.append(k)
    return True
