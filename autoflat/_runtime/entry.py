"""The traced entry that a step's `jax.jit` compiles, and the jits themselves.

`entry(spec, state leaves, xs, broadcast leaves)` is what is traced: it unpacks the state,
fills in Flax NNX Variables that state arguments share (`_nnx.Link`), runs the generated
function, pins each state output to its input's sharding, and packs the state again when the
transport packs it. Weak types travel as under `jax.jit`: a weakly typed state leaf reaches the
step weakly typed (a buffer of its own is, a packed one is unpacked so: `Layout.weak`), and
leaves as the step gives it back (the next call compiles again where `jax.jit`'s would). It
returns its result flat (`flat_result`; `landed` rebuilds it on the host). `relinked` is the
host-side counterpart for shared Variables; `calls_back` finds host callbacks in a traced
program (`_launch` runs those without donation). At one step a call, `entry` hands the step's
return to `tracing.captured`, which a first call's trial reads (`_runtime.trial`); a scan
hands each step's in `tracing`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _jax
from .._handles import writeback as _writeback
from .._handles.nnx import Link
from .._transport import host as _host
from .._transport import layout as _transport
from .._transport import segments as _segments
from .._transport import wholes as _wholes
from .._transport.structure import FlatState, pinned, strongly_typed
from .diagnostics import Stats
from .specs import CallSpec
from .tracing import captured, linking, refuse_per_step_arrays, resolved


def entry(
    note_trace: Callable[[CallSpec, Any], Stats] | None,
    spec: CallSpec,
    state_leaves: tuple[list[Any], ...],
    xs: tuple[Any, ...],
    bcast_leaves: tuple[list[Any], ...],
    *,
    repack: bool = True,
    as_list: bool = True,
) -> Any:
    """The traced function: leaves in, leaves and stacked outputs out (see the module doc):
    `(state, outputs)`, or with `as_list` as `flat_result` gives it.

    `jax.jit` takes it as `functools.partial(entry, note_trace)` with `spec` static;
    `note_trace` is told of each trace and gives the counters it adds to."""
    stats = None if note_trace is None else note_trace(spec, (state_leaves, xs, bcast_leaves))
    if spec.program.by_shape_bcast:
        refuse_per_step_arrays(spec, bcast_leaves)
    if repack and _segmented(spec):
        leaving, outputs, leaf_by_leaf = _segments_entry(spec, state_leaves, xs, bcast_leaves)
        if stats is not None:
            stats.leaf_by_leaf += leaf_by_leaf
    else:
        unpacked = tuple(
            a if layout is None else _transport.unpack(layout, a)
            for a, layout in zip(state_leaves, spec.layouts, strict=True)
        )
        leaving, outputs = _body(spec, unpacked, xs, bcast_leaves)
        if repack:
            leaving = tuple(_repacked(spec, k, flat) for k, flat in enumerate(leaving))
    return flat_result(spec, leaving, outputs) if as_list else (leaving, outputs)


def _body(
    spec: CallSpec, state_leaves: Any, xs: tuple[Any, ...], bcast_leaves: tuple[list[Any], ...]
) -> tuple[tuple[FlatState, ...], Any]:
    """The generated function on unpacked leaves: the state as it leaves (not packed), and
    the outputs."""
    state = tuple(FlatState(s, a) for s, a in zip(spec.structures, state_leaves, strict=True))
    if spec.links is not None:
        state = _linked(spec.links, state)
    bcast = tuple(FlatState(s, a) for s, a in zip(spec.bcast_structures, bcast_leaves, strict=True))
    roles = spec.program.roles
    names = (*roles.state, *roles.of("broadcast"), *spec.static)
    values = (*spec.structures, *spec.bcast_structures, *spec.static.values())
    with linking(bcast), _writeback.untouched(names, values, spec.fn):
        state_out, outputs = spec.program.fn(spec, state, xs, bcast)
        state_out = resolved(state_out)
    if spec.num_steps == 1:
        captured(spec, state_out, outputs)
    leaving = tuple(_leaving(spec, k, flat) for k, flat in enumerate(state_out))
    if spec.links is not None:
        # A shared Variable's new value leaves once, with the argument it came in with.
        leaving = tuple(
            flat if link is None else FlatState(flat.structure, link.drop(flat.arrays))
            for flat, link in zip(leaving, spec.links, strict=True)
        )
    return leaving, outputs


def _segmented(spec: CallSpec) -> bool:
    """Whether the step runs with packed leaves as views (`_segments`): something is packed."""
    return SEGMENTS and any(layout is not None and layout.groups for layout in spec.layouts)


# `_segments` on (True) or off (the leaves unpacked before the step, as in a scan).
SEGMENTS = True


def _segments_entry(
    spec: CallSpec,
    state_leaves: tuple[list[Any], ...],
    xs: tuple[Any, ...],
    bcast_leaves: tuple[list[Any], ...],
) -> tuple[tuple[FlatState, ...], Any, int]:
    """`_body` traced to a jaxpr on the unpacked leaves, then evaluated with the packed
    leaves as views (`_segments`) and the state packed again from them; with the number of
    equations on views that ran leaf by leaf."""
    args = tuple(
        a if layout is None else _wholes.views(layout, a)
        for a, layout in zip(state_leaves, spec.layouts, strict=True)
    )
    avals = tuple(
        a if layout is None else _view_avals(layout, a)
        for a, layout in zip(args, spec.layouts, strict=True)
    )
    meta: list[Any] = []

    def traced(state_leaves: Any, xs: Any, bcast_leaves: Any) -> Any:
        leaving, outputs = _body(spec, state_leaves, xs, bcast_leaves)
        out_leaves, out_tree = jax.tree_util.tree_flatten(outputs)
        meta.append((leaving, out_tree))
        return [f.arrays for f in leaving], out_leaves

    closed = jax.make_jaxpr(traced)(avals, xs, bcast_leaves)
    leaving, out_tree = meta[0]
    interpreter = _segments.Interpreter()
    values = interpreter.eval(
        *_jax.opened(closed), jax.tree_util.tree_leaves((args, xs, bcast_leaves))
    )
    layouts = [_layout_out(spec, j, flat) for j, flat in enumerate(leaving)]
    # What leaves as an array of its own (not packed into a buffer) is cut out of its view,
    # and typed as traced: computed on views, it can lose the weak type the step gave it.
    cut = [layout is None for layout, f in zip(layouts, leaving, strict=True) for _ in f.arrays]
    cut += [True] * (len(values) - len(cut))
    values = [
        _typed_as(_wholes.leaf(x), aval) if c else x
        for x, aval, c in zip(values, closed.out_avals, cut, strict=True)
    ]
    packed = []
    k = 0
    for flat, layout in zip(leaving, layouts, strict=True):
        arrays = values[k : k + len(flat.arrays)]
        k += len(flat.arrays)
        if layout is None:
            packed.append(FlatState(flat.structure, arrays))
        else:
            packed.append(FlatState(flat.structure, _wholes.pack(layout, arrays), layout))
    outputs = out_tree.unflatten(values[k:])
    return tuple(packed), outputs, interpreter.leaf_by_leaf


def _view_avals(layout: _transport.Layout, leaves: list[Any]) -> list[Any]:
    """The abstract values a packed state's leaves (views of its buffers, or buffers of their
    own) are traced with: as `_transport.unpack` would give them, weak types included."""
    return [
        jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak)
        for x, weak in zip(leaves, layout.weak, strict=True)
    ]


def _typed_as(x: Any, aval: Any) -> Any:
    """`x` weakly typed if `aval` is, else strongly typed."""
    if getattr(aval, "weak_type", False):
        return _jax.weakly_typed(x)
    return strongly_typed(x) if _jax.weak_type(x) else x


def flat_result(spec: CallSpec, leaving: tuple[FlatState, ...], outputs: Any) -> Any:
    """The program's result as JAX hands it back: a list `[state arrays, output leaves]`,
    which JAX builds without running Python, its meaning kept in `spec.landing`.

    A result holding `FlatState`s (or the user's own pytree classes among the outputs) is
    built by Python functions that JAX calls after the program ran, after it consumed the
    donated inputs: an interrupt there would lose the inputs and the results alike. A list of
    lists is built in C, and lands in the step before any Python runs (`_launch.launch`).

    A spec traced again (per-step inputs of other shapes) whose state or outputs then differ
    in structure (code that branches on a shape) returns the tuple `(state, outputs)` instead,
    as it is: `landed` tells the two apart by type."""
    out_leaves, out_tree = jax.tree_util.tree_flatten(outputs)
    landing = (tuple((f.structure, f.layout) for f in leaving), out_tree)
    if spec.landing is None:
        spec.landing = landing
    elif spec.landing != landing:
        return leaving, outputs
    return [tuple(f.arrays for f in leaving), out_leaves]


def landed(spec: CallSpec, result: Any) -> tuple[tuple[FlatState, ...], Any]:
    """A launch's `(state, outputs)` from its result (see `flat_result`)."""
    if type(result) is tuple:
        return result  # type: ignore[no-any-return]
    arrays, out_leaves = result
    parts, out_tree = spec.landing  # type: ignore[misc]
    state = tuple(FlatState(s, a, layout) for (s, layout), a in zip(parts, arrays, strict=True))
    return state, out_tree.unflatten(out_leaves)


def _linked(links: tuple[Link | None, ...], state: tuple[FlatState, ...]) -> tuple[FlatState, ...]:
    """The state with the leaves it shares filled in and its links set (see `_nnx.Link`)."""
    full: list[list[Any]] = []
    out = []
    for flat, link in zip(state, links, strict=True):
        arrays = flat.arrays if link is None else link.expand(flat.arrays, full)
        full.append(arrays)
        out.append(FlatState(flat.structure, arrays, None, link))
    return tuple(out)


def relinked(spec: CallSpec, state_out: tuple[FlatState, ...]) -> tuple[FlatState, ...]:
    """A launch's state outputs with the shared leaves filled in again (the host side of
    `entry`'s `link.drop`)."""
    if spec.links is None:
        return state_out
    full: list[list[Any]] = []
    out = []
    for flat, link in zip(state_out, spec.links, strict=True):
        if link is not None and link.imports:
            flat = FlatState(flat.structure, link.expand(flat.arrays, full))
        full.append(flat.arrays)
        out.append(flat)
    return tuple(out)


def _leaving(spec: CallSpec, k: int, flat: FlatState) -> FlatState:
    """State output `k` as it leaves the step: pinned (not packed), weak types as the step
    gives them (as `jax.jit`'s outputs keep them)."""
    placement = spec.placements[k]
    arrays = flat.arrays
    if placement is not None and flat.structure is spec.structures[k]:
        arrays = [
            a if s is None else pinned(a, s)
            for a, s in zip(arrays, placement.shardings, strict=True)
        ]
    return FlatState(flat.structure, arrays)


def _layout_out(spec: CallSpec, k: int, flat: FlatState) -> _transport.Layout | None:
    """The layout state output `k` leaves in (None: a buffer per leaf): its input's, or a
    new one if the structure changed."""
    written_back = any(j == k for j, _ in spec.program.written_back_idx)
    linked = spec.links is not None and spec.links[k] is not None
    pack = not linked and _host.mode_for(spec.pack, written_back, spec.num_steps)
    if not pack or jax.tree_util.treedef_is_leaf(flat.structure.treedef):
        return None
    placement = spec.placements[k]
    multi = (
        [s is not None for s in placement.shardings]
        if placement is not None and flat.structure is spec.structures[k]
        else [False] * len(flat.arrays)
    )
    avals = [(tuple(jnp.shape(a)), jnp.result_type(a)) for a in flat.arrays]
    weak = [bool(_jax.weak_type(a)) for a in flat.arrays]
    return _transport.layout_for(avals, multi, pack, weak)


def _repacked(spec: CallSpec, k: int, flat: FlatState) -> FlatState:
    """State output `k` packed in its layout."""
    layout = _layout_out(spec, k, flat)
    if layout is None:
        return flat
    return FlatState(flat.structure, _transport.pack(layout, flat.arrays), layout)


# Primitives that run Python on the host while the program runs: it can fail there, after
# the inputs were donated (`jax.pure_callback`, `io_callback`, `jax.debug.callback`/`print`,
# and what builds on them: `eqx.error_if`, host-side checks).
_CALLBACKS = frozenset(
    {"pure_callback", "io_callback", "debug_callback", "debug_print", "callback"}
)


def calls_back(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr, or any jaxpr inside it, calls back to the host."""
    return any(name in _CALLBACKS for name in _jax.primitive_names(jaxpr))


def jitted(note_trace: Callable[[CallSpec, Any], Stats], donate: Any) -> tuple[Any, Any]:
    """A step's `jax.jit`s of `entry`, spec static: the one it runs (state leaves donated if
    `donate`) and, with `donate` on, one that does not donate, for programs that must keep
    their inputs (`_launch.runner`). Both wrap the same function, so JAX traces a spec once for
    the two."""
    fn = functools.partial(entry, note_trace)
    jit = jax.jit(fn, static_argnums=0, donate_argnums=(1,) if donate else ())
    return jit, jax.jit(fn, static_argnums=0) if donate else None
