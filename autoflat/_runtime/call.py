"""The call path of a decorated step before the launch: bind, take in state and broadcast
arguments. `Step.__call__` is three calls: `prepare` (here), `launch.launch` and
`finish.finish`.

`prepare` turns the call's arguments into what the compiled program takes, with no effect on
the caller's objects:

- *bind*: positional and keyword arguments to the parameter order (skipped when a call passes
  exactly the positional parameters);
- *state*, per argument, the first that applies: a Flax NNX object unchanged since this step's
  last call (`_nnx`: no graph traversal); an unconsumed lazy handle (its interned structure and
  leaf list as they are: no `tree_flatten`), or with `lazy=False` the object the step returned
  last call standing for its handle (`returned`: by identity, and a dict checked unchanged
  with one `tree_flatten`); anything else is flattened once and its structure
  interned, then packed (`_transport`) or, with donation on, copied unless autoflat wrote those
  very buffers into this object and nothing else holds them (`_writeback.all_ours`), so the
  caller's own arrays are never donated;
- *broadcast*: an unconsumed handle's leaves, the same immutable object as last call by
  identity, or a flatten;
- *spec*: the interned `CallSpec` (`_program.SpecCache`).

`Call` is the prepared call, which `launch` runs and `finish` completes.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import BAD_CALL, CallError, error
from .._handles import nnx as _nnx
from .._handles import writeback as _writeback
from .._handles.lazy import _UNBUILT, LazyHandle, holds_handles
from .._roles.abstract import SCALARS
from .._transport import host as _host
from .._transport.layout import Layout, PackMode
from .._transport.structure import (
    Placement,
    Structure,
    flatten,
    intern,
    is_array,
    leaf_paths,
    placement_of,
)
from .donation import (
    copy_at,
    copy_leaves,
    copy_repeats,
    held_elsewhere,
    is_handle,
    keep_shared,
    uncaught,
)
from .instance import instance_attributes
from .program import Program
from .returned import returned
from .specs import CallSpec


class Call:
    """One call, prepared: what the compiled program takes and what `finish` needs."""

    __slots__ = (
        "args",
        "program",
        "spec",
        "leaves",
        "xs",
        "bcast_leaves",
        "donated",
        "nnx_hit",
        "nnx_vars",
        "links",
        "copies",
        "landed",
        "donating",
        "xs_shared",
        "claim",
        "claimed",
        "handed",
    )

    args: tuple[Any, ...]  # in parameter order
    program: Program
    spec: CallSpec
    leaves: tuple[list[Any], ...]  # per state argument, the buffers the program takes
    xs: tuple[Any, ...]  # per-step inputs
    bcast_leaves: tuple[list[Any], ...]
    donated: list[LazyHandle]  # handles whose buffers a donating launch consumes
    nnx_hit: _nnx.NnxCache | None  # the Flax NNX cache, when this call's objects hit it
    nnx_vars: dict[int, list[Any]]  # per state position, the Flax NNX Variables to write
    links: tuple[_nnx.Link | None, ...] | None  # Flax NNX Variables shared between state
    copies: list[int]  # state positions holding the caller's own buffers (copied if donated)
    landed: collections.deque[Any]  # the program's results, as they land (`_launch.launch`)
    donating: bool  # whether the launch donated the state leaves (set by `launch`)
    xs_shared: bool  # a per-step input holds a handle donated as state (`donation.keep_shared`)
    claim: tuple[int, Any]  # (call number, step's Origin): marks this call's claims
    claimed: list[LazyHandle]  # the handles this call marked consumed (`_launch._claim`)
    handed: collections.deque[Any]  # the finished result, until the caller has it

    def __init__(self) -> None:
        self.landed = collections.deque(maxlen=1)
        self.handed = collections.deque(maxlen=1)
        self.claimed = []
        self.donating = False
        self.xs_shared = False

    def inputs(self) -> tuple[Any, ...]:
        """The arguments of the compiled program, after the static spec."""
        return (self.leaves, self.xs, self.bcast_leaves)


def bind(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's arguments in parameter order, defaults applied."""
    try:
        bound = step._signature.bind(*args, **kwargs)
    except TypeError as e:
        raise error(
            CallError, BAD_CALL, step._analysis, reason=str(e), signature=str(step._signature)
        ) from None
    bound.apply_defaults()
    return tuple(bound.arguments[p] for p in step._params)


def prepare(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """Everything the launch needs, from the call's arguments (see the module doc)."""
    if kwargs or len(args) != step._n_params:
        args = bind(step, args, kwargs)
    program, to_array, firsts = step._programs.for_args(args, step._may_mutate, step._trial)
    step._fed_back.refuse(step, program, args)
    call = Call()
    call.args = args
    call.program = program
    structures, leaves, placements, layouts = _take_state(step, call, to_array, firsts)
    bcast_structures, call.bcast_leaves = _take_broadcast(step, program, args)
    for k, i in program.written_back_idx:
        if type(args[i]) is not LazyHandle:
            _writeback.check_writable(
                structures[k].treedef, program.roles.state[k], step._analysis, args[i]
            )
    static = program.static_values(args)
    if program.instance_attrs:
        static += instance_attributes(program, args)
    call.spec = step._specs.get(
        program, structures, placements, layouts, call.links, bcast_structures, static
    )
    if call.copies and (step.donate == "always" or not call.spec.keeps_inputs):
        # The caller's own arrays are never donated: a donating launch gets copies.
        for k in call.copies:
            leaves[k] = copy_leaves(leaves[k])
        step._diag.stats.copies += len(call.copies)
    call.leaves = tuple(leaves)
    call.xs = tuple(args[i] for i in program.scanned_idx)
    if call.xs_shared:
        # A handle in a per-step input that is also the donated state goes in as a copy of
        # the tree it stands for: JAX would flatten the handle itself after `launch` claimed
        # it. (The state's leaves are copies then: see `donation.keep_shared`.)
        call.xs = jax.tree_util.tree_map(
            lambda h: _tree_of(h) if type(h) is LazyHandle else h, call.xs, is_leaf=is_handle
        )
    return call


def _tree_of(h: LazyHandle) -> Any:
    """A new tree of the arrays that handle `h` stands for (not cached in the handle)."""
    structure, arrays = LazyHandle._af_leaves(h)
    return structure.unflatten(arrays)


def _take_state(
    step: Any, call: Call, to_array: tuple[tuple[int, ...], ...], firsts: list[Any]
) -> tuple[list[Structure], list[list[Any]], list[Placement | None], list[Layout | None]]:
    """Per state argument, its structure, the buffers the program takes, their placement and
    packing layout, from the first that applies: the Flax NNX cache, an unconsumed handle
    (the fast path, inline here: O(1)), a flatten. Then what Flax NNX and donation need of
    the call as a whole."""
    args, program = call.args, call.program
    stats = step._diag.stats
    structures: list[Structure] = []
    leaves: list[list[Any]] = []
    placements: list[Placement | None] = []
    layouts: list[Layout | None] = []
    unpacked: dict[int, list[Any]] = {}  # the caller's own leaves, for Flax NNX write-back
    call.copies = []  # state positions holding the caller's own buffers
    donated: list[LazyHandle] = []
    call.donated = donated
    last = step._last
    handles: dict[int, LazyHandle] = {}  # per state position, the handle it is donated as
    hit = call.nnx_hit = step._nnx.lookup(program, args) if step._nnx.cache else None
    for k, i in enumerate(program.state_idx):
        a = args[i]
        if hit is not None and k in hit.variables:
            taken = _take_nnx_hit(step, call, hit, k)
        else:
            # lazy=False: the real object this step returned last call stands for its handle
            # while it holds what it was built from (`returned`).
            pair = last.get(k) if last else None
            ours = (
                pair is not None
                and pair[0] is a
                and returned(step, program, call.copies, k, pair[1], a)
            )
            if ours:
                assert pair is not None
                a = pair[1]
            if type(a) is LazyHandle and not a._af_consumed_by:
                fresh = a._af_obj is _UNBUILT or a._af_structure.immutable
                if fresh or ours:
                    structures.append(a._af_structure)
                    leaves.append(uncaught(step, a, ours))
                    placements.append(a._af_placement)
                    layouts.append(a._af_layout)
                    donated.append(a)
                    handles[k] = a
                    stats.fast_path += fresh  # (a dict checked by `returned` was flattened)
                    if firsts[k] is None:
                        firsts[k] = a._af_structure
                    continue
            taken = _take_flattened(step, call, k, a, to_array[k], firsts, unpacked)
        structures.append(taken[0])
        leaves.append(taken[1])
        placements.append(taken[2])
        layouts.append(taken[3])
    if hit is not None:
        call.nnx_vars, call.links = hit.variables, hit.links
    elif step._may_mutate:
        call.nnx_vars = _nnx.variables_of(program, args, unpacked, step._analysis)
        call.links = _nnx.links_of(program, call.nnx_vars)
    else:
        call.nnx_vars, call.links = {}, None
    if call.links is not None:
        _share(step, call, leaves, layouts, unpacked)
    if len(donated) > 1 and len({id(h) for h in donated}) != len(donated):
        copy_repeats(call, leaves)
    if donated and step.donate:
        keep_shared(call, leaves, handles)
    return structures, leaves, placements, layouts


# What `_take_state` takes of one state argument: structure, buffers, placement, layout.
_Taken = tuple[Structure, list[Any], Placement | None, Layout | None]


def _pack_mode(step: Any, call: Call, k: int) -> PackMode:
    """How state argument `k` travels (`_host.mode_for`)."""
    written_back = any(j == k for j, _ in call.program.written_back_idx)
    return _host.mode_for(step.pack, written_back, step.num_steps)


def _take_nnx_hit(step: Any, call: Call, hit: _nnx.NnxCache, k: int) -> _Taken:
    """State argument `k`, the same Flax NNX object as last call, unchanged: no graph
    traversal, and its arrays are the ones we wrote, so they are donated without a copy."""
    arrays, placement = hit.arrays[k], hit.placements[k]
    held = _nnx_kept(hit, arrays) if step.donate else []
    if held:
        arrays = copy_at(arrays, held)
        step._diag.stats.copies += 1
    linked = hit.links is not None and hit.links[k] is not None
    layout = None if linked else _host.host_layout(arrays, placement, _pack_mode(step, call, k))
    if layout is not None:
        arrays = _host.pack_on_device(layout, arrays)
        step._diag.stats.copies += 1
    step._diag.stats.fast_path += 1
    return hit.structures[k], arrays, placement, layout


def _nnx_kept(hit: _nnx.NnxCache, arrays: list[Any]) -> list[int]:
    """The arrays of one Flax NNX argument on the cached path that the caller kept
    (`nnx.clone(model)` shares them), by index: to be copied before a donating launch. Each
    is held by its Variable and the cache's list, once for each leaf it is (tied weights are
    one Variable at several leaves, of one argument or several)."""
    indices = list(range(len(arrays)))
    if hit.links is None:
        return held_elsewhere(arrays, indices, 2)
    # Counted every call, not kept: two Variables may hold one array on one call and not on
    # the next, and a count too high would miss an array the caller kept.
    leaves = collections.Counter(id(a) for held in hit.arrays.values() for a in held)
    return held_elsewhere(arrays, indices, [1 + leaves[id(a)] for a in arrays])


def _nested_built(value: Any) -> Any:
    """A state argument holding handles of other steps' results (`{"params": p, "opt": s}`)
    with each rebuilt in place, so its structure is the one the step gives back (a handle is
    a node type of its own to JAX, and a `lax.scan` carry keeps its structure)."""
    return jax.tree.map(
        lambda x: LazyHandle._af_get(x) if type(x) is LazyHandle else x,
        value,
        is_leaf=lambda x: type(x) is LazyHandle,
    )


def _take_flattened(
    step: Any,
    call: Call,
    k: int,
    a: Any,
    to_array: tuple[int, ...],
    firsts: list[Any],
    unpacked: dict[int, list[Any]],
) -> _Taken:
    """State argument `k` (`a`), anything but an unconsumed handle: flattened once, its
    structure interned, then packed, or (with donation on) marked to be copied unless
    autoflat wrote those very buffers into it (`_writeback.all_ours`)."""
    stats = step._diag.stats
    if type(a) is LazyHandle:
        a = LazyHandle._af_get(a)
    if to_array:
        structure, arrays = _with_arrays(a, to_array, firsts[k])
        stats.flattens += 1
    else:
        structure, arrays = flatten(a)
        if holds_handles(structure):
            a = _nested_built(a)
            structure, arrays = flatten(a)
        if is_array(a) or not arrays:
            # State that is one array, or has none, comes back as it is (not a handle):
            # passing it back is the fast path though it is not a handle (no tree).
            stats.fast_path += 1
        else:
            stats.flattens += 1
    first = firsts[k]
    if first is None:
        firsts[k] = structure
    elif structure is not first:
        late = _late_scalars(first, structure)
        if late:  # (only for a value of the first call's tree)
            structure, arrays = _with_arrays(a, tuple(sorted({*to_array, *late})))
    placement = placement_of(arrays)
    unpacked[k] = arrays
    # One array is one buffer already, and comes back as itself: never packed.
    layout = (
        None if is_array(a) else _host.host_layout(arrays, placement, _pack_mode(step, call, k))
    )
    if layout is not None:
        # Packing makes fresh buffers: they may be donated without a copy.
        arrays = _host.pack_on_device(layout, arrays)
        stats.copies += 1
    elif step.donate and arrays and not _writeback.all_ours(arrays, a):
        call.copies.append(k)  # once the spec says whether the launch donates
    return structure, arrays, placement, layout


def _share(
    step: Any,
    call: Call,
    leaves: list[list[Any]],
    layouts: list[Layout | None],
    unpacked: dict[int, list[Any]],
) -> None:
    """State that shares Flax NNX Variables with other state travels one buffer per leaf, and
    a shared leaf crosses once, with the first argument reaching it (`_nnx.Link`)."""
    assert call.links is not None
    for k, link in enumerate(call.links):
        if link is None:
            continue
        if layouts[k] is not None:  # packed by `pack=True` before the sharing was known
            layouts[k] = None
            leaves[k] = unpacked[k]
            if step.donate and not _writeback.all_ours(
                leaves[k], call.args[call.program.state_idx[k]]
            ):
                call.copies.append(k)
        if link.imports:
            leaves[k] = link.drop(leaves[k])


def _late_scalars(first: Structure, now: Structure) -> tuple[int, ...]:
    """The leaves of `now` that are Python numbers where the first call's value of the same
    tree had arrays (`opt_state.hyperparams["b2"] = 0.95` between calls): they go in as
    arrays, as the step took them then, rather than as constants that would compile again
    (or, in a scan, change the carry's structure when the step makes them arrays)."""
    if now.treedef != first.treedef:
        return ()
    arrays = set(now.array_positions)
    return tuple(
        i
        for i in first.array_positions
        if i not in arrays and isinstance(now.static_leaves[i], SCALARS)
    )


def _with_arrays(
    value: Any, indices: tuple[int, ...], first: Structure | None = None
) -> tuple[Structure, list[Any]]:
    """Flatten `value` with the Python scalars at these leaf indices made arrays (they come
    back from the step as arrays: `TrainState.step`). The indices are those of the first
    call's tree (`first`); for a value of another tree (a new `TrainState` with another
    optimizer, a key added since) the leaves at the same key paths (`_at_paths_of`)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if first is not None and treedef != first.treedef:
        indices = _at_paths_of(value, first.treedef, indices)
    for i in indices:
        if not is_array(leaves[i]):
            leaves[i] = jnp.asarray(leaves[i])
    return intern(treedef, leaves)


def _at_paths_of(value: Any, treedef: Any, indices: tuple[int, ...]) -> tuple[int, ...]:
    """The leaves of `value` at the key paths (`jax.tree_util.keystr`) where `treedef`'s
    leaves `indices` sit; none where `treedef` cannot be rebuilt to read its paths."""
    paths = leaf_paths(treedef)
    if paths is None:
        return ()
    wanted = {paths[i] for i in indices}
    found = jax.tree_util.tree_flatten_with_path(value)[0]
    return tuple(i for i, (path, _) in enumerate(found) if jax.tree_util.keystr(path) in wanted)


def _take_broadcast(
    step: Any, program: Program, args: tuple[Any, ...]
) -> tuple[list[Structure], tuple[list[Any], ...]]:
    structures = []
    leaves = []
    cache = step._bcast_last
    for k, i in enumerate(program.bcast_idx):
        a = args[i]
        if type(a) is LazyHandle and not a._af_consumed_by:
            s, arrays = LazyHandle._af_leaves(a)
        else:
            cached = cache.get(k)
            if cached is not None and cached[0] is a:
                # The same immutable object as last call (a frozen model): no flatten.
                s, arrays = cached[1], cached[2]
            else:
                s, arrays = flatten(a)
                if s.treedef.num_nodes > 1:  # a tree, not one array (a key, a full batch)
                    step._diag.stats.flattens += 1
                if s.immutable:
                    cache[k] = (a, s, arrays)
        structures.append(s)
        leaves.append(arrays)
    return structures, tuple(leaves)
