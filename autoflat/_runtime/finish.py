"""The call path of a decorated step after the launch: its results handed to the caller.

`finish` marks donated handles consumed, wraps state outputs in new lazy handles without
unflattening (`new_handles`), writes mutation-style state back into the caller's objects, and
assembles the result in the user's order. `hand_over` returns it so that no interrupt can
come between the step letting go of it and the caller having it (until then, `Step.recover`
finds it).
"""

from __future__ import annotations

from typing import Any

import jax

from .._handles import writeback as _writeback
from .._handles.lazy import LazyHandle, new_handle, register_with_flax
from .._transport.structure import FlatState, placement_of
from .call import Call
from .entry import relinked
from .specs import CallSpec


def finish(step: Any, call: Call, state_out: tuple[FlatState, ...], outputs: Any) -> Any:
    """After the launch: consume, wrap, write back; the step's result in the user's order."""
    program, spec, args = call.program, call.spec, call.args
    state_out = relinked(spec, state_out)
    if not call.donating:
        for h in call.donated:  # claimed by `launch`, not donated after all
            object.__setattr__(h, "_af_consumed_by", 0)
    handles = new_handles(step, spec, state_out)
    nnx_vars, hit = call.nnx_vars, call.nnx_hit
    written: dict[int, list[Any]] = {}
    for k, i in program.written_back_idx:
        variables = nnx_vars.get(k)
        if variables is not None and state_out[k].structure is spec.structures[k]:
            # An object with no arrays (an NNX module of no Variables) comes back as itself.
            new_arrays = (
                LazyHandle._af_leaf_arrays(handles[k]) if type(handles[k]) is LazyHandle else []
            )
            step._nnx.write(hit, variables, new_arrays)
            written[k] = new_arrays
            if hit is not None:
                continue  # the NNX cache records them as ours
        else:
            _writeback.write_back(args[i], handles[k], program.roles.state[k], step._analysis)
        if type(args[i]) is not LazyHandle and type(handles[k]) is LazyHandle:
            # The caller's object now holds buffers this call produced: a later call (of this
            # step or another) may donate them without a copy while they are still these.
            _writeback.record_written(LazyHandle._af_leaf_arrays(handles[k]), args[i])
    for k, i in program.given_back_idx:
        handles[k] = args[i]  # (returned as the caller's object, written into above)
    if hit is not None or nnx_vars:
        step._nnx.remember(
            program,
            args,
            nnx_vars,
            written,
            list(spec.structures),
            list(spec.placements),
            spec.links,
            hit,
        )
    if not step.lazy:
        _real_objects(step, handles)
    register_with_flax()
    step._fed_back.remember(program, args, outputs)
    return program.result(handles, outputs)


def _real_objects(step: Any, handles: list[Any]) -> None:
    """`lazy=False`: each handle becomes its real object, and what comes back next call is
    not taken in again from scratch: the object, by identity, stands for its handle
    (`step._last`), as it is where its structure is immutable, and while it holds what it
    was built from where it is mutable (a dict, checked by `returned.returned`). Nothing per
    leaf is done here beyond the rebuild itself."""
    last = step._last
    last.clear()
    for k, h in enumerate(handles):
        if type(h) is not LazyHandle:
            continue  # state that is one array, or holds none, is returned as it is
        obj = LazyHandle._af_get(h)
        last[k] = (obj, h)
        handles[k] = obj


def hand_over(call: Call, result: Any) -> Any:
    """Return a finished call's `result` to its caller, with no point an interrupt could come
    at after the step lets go of it and before the caller has it.

    The step keeps its last call (`Step._in_flight`) so that `Step.recover` finds the results
    of a call that a KeyboardInterrupt stopped after its program ran. The result goes into
    the call first (`recover()` returns it from there); then what the call held for the
    launch and the caller's objects are let go (the step keeps only this small record, which
    has no `spec` any more). A caller hands over the same way, as its last act: `return
    hand_over(call, finish(...))`, on one line."""
    handed = call.handed
    handed.append(result)
    call.landed.clear()
    call.args = call.leaves = call.xs = call.bcast_leaves = ()
    call.donated = call.claimed = []
    call.nnx_hit, call.nnx_vars, call.links = None, {}, None
    if hasattr(call, "spec"):
        del call.spec  # (its static arguments may be the caller's objects: an instance)
    # The result leaves `handed` by `del` (no Python runs, and Python takes no signal, in it)
    # right before the return, which adds no line of its own. `taken` is set on the line of
    # the return: an interrupt at that line, or at any line of the `finally` before the
    # `del`, leaves the result in `handed`.
    taken = False
    try:
        return handed[0] if (taken := True) else None
    finally:
        if taken:
            del handed[0]


def new_handles(step: Any, spec: CallSpec, state_out: tuple[FlatState, ...]) -> list[Any]:
    """New lazy handles over a call's state outputs; state that is one array, or has no
    arrays (`None`, a Python int or string), is returned as it is."""
    origin = step._origin
    names = spec.program.roles.state
    handles: list[Any] = []
    for k, flat in enumerate(state_out):
        structure = flat.structure
        if flat.layout is None and (
            structure.n_arrays == 0 or jax.tree_util.treedef_is_leaf(structure.treedef)
        ):
            handles.append(structure.unflatten(flat.arrays))
            continue
        placement = spec.placements[k]
        if placement is not None and flat.structure is not spec.structures[k]:
            placement = placement_of(flat.arrays)
        handles.append(
            new_handle(flat.structure, flat.arrays, placement, origin, names[k], flat.layout)
        )
    return handles
