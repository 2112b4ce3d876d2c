"""All of autoflat's Flax NNX code: NNX objects as mutation-style state, called again and again.

Each step has one `NnxState`: it finds the Variables of NNX state arguments and how they share
them (`Link`: shared Variables cross `jax.jit` once and are the same objects in the trace),
writes a call's new values into them, and keeps the `NnxCache` below.

A Flax NNX train step is called with the same model and optimizer every time, and updates
them in place. Flattening them costs a Python callback per graph node (about 1 ms for a
ResNet50-structured model with Adam), and so does writing the new values back through
`nnx.update`. After one call has flattened the objects, `NnxCache` keeps:

- their Variables, in leaf order, and the arrays autoflat wrote into them;
- a `GraphSnapshot` (`snapshot`): every container reachable from the objects (each module's
  `__dict__`, plain lists, dicts and sets) with the identity of each value it held.

The next call with the same objects checks the snapshot and the Variables' values by
identity, which is a few microseconds a node, and if nothing changed uses the cached
structure and passes the Variables' arrays straight to the compiled step. Anything else (a
new attribute, `model.eval()` setting a flag, a replaced submodule, a value set by hand, a
restored checkpoint) fails the check and the call takes the slow path, which flattens.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from .._errors import SHARED_VARIABLE, StateError, error
from .._transport.structure import is_array
from .lazy import LazyHandle
from .snapshot import GraphSnapshot
from .writeback import is_mutable_module, register_holder

_is = operator.is_


def take_graph_cache() -> None:
    """Take the graph cache that `nnx.cached_partial(step, model, optimizer)` leaves for the
    call it wraps.

    `cached_partial` clones the cached objects once (the clones hold the caller's own
    Variables) and calls the step inside a Flax context holding a cache of their traversal,
    which only NNX transforms consume: Flax raises when the call returns and nobody took it.
    autoflat keeps its own cache of the objects (`NnxCache`, which the clones hit on every
    call), so it takes Flax's and drops it, as an NNX transform would take it."""
    graphlib = sys.modules.get("flax.nnx.graphlib")
    if graphlib is None:
        return
    context = getattr(graphlib, "GRAPH_CONTEXT", None)
    if getattr(context, "tmp_static_cache", None) is not None:
        context.tmp_static_cache = None  # type: ignore[union-attr]


def get_raw(v: Any) -> Any:
    get = getattr(v, "get_raw_value", None)
    return get() if get is not None else v.raw_value


def set_raw(v: Any, value: Any) -> None:
    set_ = getattr(v, "set_raw_value", None)
    if set_ is not None:
        set_(value)
    else:
        v.raw_value = value


def _raw_slot(variable_types: set[type]) -> Any:
    """The one `_raw_value` slot that every Variable type keeps, with Flax's own
    `get_raw_value` and `set_raw_value` and attribute lookup, or None: then a Variable's value
    is read and set only through its methods."""
    slots = set()
    for t in variable_types:
        owner = next((k for k in t.__mro__ if "_raw_value" in k.__dict__), None)
        if (
            owner is None
            or getattr(t, "set_raw_value", None) is not getattr(owner, "set_raw_value", None)
            or getattr(t, "get_raw_value", None) is not getattr(owner, "get_raw_value", None)
            or t.__getattribute__ is not object.__getattribute__
        ):
            return None
        slots.add(owner.__dict__["_raw_value"])
    if len(slots) != 1:
        return None
    (slot,) = slots
    return slot if hasattr(slot, "__get__") and hasattr(slot, "__set__") else None


def _unchecked_setter(slot: Any) -> Callable[[Any, Any], None]:
    """Set a Variable's value without Flax's per-Variable trace-level check, as Flax's own
    `nnx.jit_partial` applies its updates (the caller checks one Variable per call): the
    slot's own setter, a C function, where `_raw_slot` found one."""
    return set_raw if slot is None else slot.__set__


def _getter(slot: Any, variable_types: set[type]) -> Callable[[Any], Any]:
    """Read a Variable's value: one C call a Variable (an attribute getter of the slot, which
    is what Flax's final `get_raw_value` returns) where `_raw_slot` found the slot."""
    if slot is not None:
        return operator.attrgetter("_raw_value")
    if all(hasattr(t, "get_raw_value") for t in variable_types):
        return operator.methodcaller("get_raw_value")
    return get_raw


def _same(obj: Any) -> Any:
    return obj


class NnxCache:
    """What one step's last call saw of its Flax NNX state arguments (see the module doc).

    `positions` are the state positions (`k`) of the NNX objects; every other state argument
    of that call was a lazy handle, and must be one again for the cache to apply.
    """

    def __init__(
        self,
        program: Any,
        state_idx: tuple[int, ...],
        objects: dict[int, Any],
        variables: dict[int, list[Any]],
        arrays: dict[int, list[Any]],
        structures: dict[int, Any],
        placements: dict[int, Any],
        links: tuple[Link | None, ...] | None,
        is_variable: Callable[[Any], bool],
        on_lost: Callable[[], None],
    ) -> None:
        self.program = program
        self.variables = variables
        self.arrays = arrays
        self.structures = structures
        self.placements = placements
        self.links = links
        self._ids: frozenset[int] | None = None
        refs: dict[int, Callable[[], Any]] = {}
        for k, obj in objects.items():
            try:
                # Weakly: the cache must not keep a dropped model (and its buffers) alive.
                refs[k] = weakref.ref(obj, lambda _r: on_lost())
            except TypeError:
                refs[k] = functools.partial(_same, obj)
        # (k, argument index, the object's reference, or None where a handle was passed)
        self._positions = tuple((k, i, refs.get(k)) for k, i in enumerate(state_idx))
        self.snapshot = GraphSnapshot(objects.values(), is_variable)
        variable_types = {type(v) for vs in variables.values() for v in vs}
        slot = _raw_slot(variable_types)
        self.set_unchecked = _unchecked_setter(slot)
        self._get = _getter(slot, variable_types)

    def lookup(self, program: Any, args: tuple[Any, ...], handle_type: type) -> bool:
        """Whether this call's NNX objects are the cached ones, unchanged."""
        if program is not self.program:
            return False
        for _k, i, ref in self._positions:
            a = args[i]
            if ref is not None:
                if a is not ref():
                    return False
            elif type(a) is not handle_type:
                return False
        if not self.snapshot.unchanged():
            return False
        get = self._get
        for k, variables in self.variables.items():
            if not all(map(_is, map(get, variables), self.arrays[k])):
                return False  # a value was set from outside (by hand, a restored checkpoint)
        return True

    def owns(self, obj: Any) -> bool:
        """Whether `obj` is one of the NNX objects this cache saw."""
        return any(ref is not None and ref() is obj for _k, _i, ref in self._positions)

    def written(self, k: int, arrays: list[Any]) -> None:
        self.arrays[k] = arrays
        self._ids = None

    def holds(self, arrays: Iterable[Any]) -> bool:
        """Whether every array is one this cache wrote and still holds (so it is alive, and
        its id is its own)."""
        ids = self._ids
        if ids is None:
            held = itertools.chain.from_iterable(self.arrays.values())
            ids = self._ids = frozenset(map(id, held))
        return all(id(a) in ids for a in arrays)


class NnxState:
    """One step's Flax NNX bookkeeping (see the module doc). Registered with `_writeback` as a
    holder of the buffers it wrote, which later calls may donate without a copy."""

    __slots__ = ("cache", "__weakref__")

    def __init__(self) -> None:
        self.cache: NnxCache | None = None
        register_holder(self)

    def holds(self, arrays: Iterable[Any], owner: Any) -> bool:
        """Whether the cache wrote every one of `arrays` into its object `owner`."""
        cache = self.cache
        return cache is not None and cache.owns(owner) and cache.holds(arrays)

    def lookup(self, program: Any, args: tuple[Any, ...]) -> NnxCache | None:
        """The cache, if this call passes its NNX objects again, unchanged."""
        cache = self.cache
        if cache is not None and cache.lookup(program, args, LazyHandle):
            return cache
        return None

    def write(self, hit: NnxCache | None, variables: list[Any], arrays: list[Any]) -> None:
        """Set a call's new values into the caller's Variables (what `nnx.update` does, without
        traversing the graph again)."""
        if hit is not None and variables:
            # One Variable through Flax's checked setter (it refuses a write from inside a
            # transform); the rest like it, directly.
            set_raw(variables[0], arrays[0])
            list(map(hit.set_unchecked, variables, arrays))
        else:
            for v, arr in zip(variables, arrays, strict=True):
                set_raw(v, arr)

    def remember(
        self,
        program: Any,
        args: tuple[Any, ...],
        nnx_vars: dict[int, list[Any]],
        written: dict[int, list[Any]],
        structures: list[Any],
        placements: list[Any],
        links: tuple[Link | None, ...] | None,
        hit: NnxCache | None,
    ) -> None:
        """After a call: keep (or refresh) the fast-path cache, or drop it."""
        if hit is not None:
            if written.keys() == hit.variables.keys():
                for k, arrays in written.items():
                    hit.written(k, arrays)
            else:
                self.cache = None
            return
        # Cached only when every state argument was either a lazy handle or an NNX object
        # whose Variables line up with its leaves and were all written back in place.
        objects = {}
        for k, i in enumerate(program.state_idx):
            a = args[i]
            if type(a) is LazyHandle:
                continue
            if k not in written:
                self.cache = None
                return
            objects[k] = a
        if not objects:
            self.cache = None
            return
        from flax import nnx

        self_ref = weakref.ref(self)

        def lost() -> None:
            state = self_ref()
            if state is not None and state.cache is new:
                state.cache = None

        new = NnxCache(
            program,
            program.state_idx,
            objects,
            {k: nnx_vars[k] for k in objects},
            {k: written[k] for k in objects},
            {k: structures[k] for k in objects},
            {k: placements[k] for k in objects},
            links,
            lambda x: isinstance(x, nnx.Variable) or is_array(x),
            lost,
        )
        self.cache = new


class Link:
    """How one Flax NNX state argument shares Variables with others (or within itself), for
    one call spec: `imports` are `(j, k0, j0)`, leaf `j` of this argument being the Variable
    at leaf `j0` of argument `k0` (`k0` earlier, or this argument with `j0 < j`); `exports`
    says a later argument imports from this one. Part of the spec: equal by value.

    Shared leaves cross the `jax.jit` boundary once (an importing argument's buffers leave
    them out both ways, so no buffer is donated twice); inside the trace, `relink` makes the
    importing object hold the very Variable objects of the exporting one, so an update
    through either reaches both, as `nnx.jit` keeps shared references."""

    __slots__ = ("k", "imports", "exports", "dropped")

    def __init__(self, k: int, imports: tuple[tuple[int, int, int], ...], exports: bool) -> None:
        self.k = k
        self.imports = imports
        self.exports = exports
        self.dropped = frozenset(j for j, _k0, _j0 in imports)

    def _key(self) -> Any:
        return (self.k, self.imports, self.exports)

    def __eq__(self, other: object) -> bool:
        return type(other) is Link and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Link({self.k}, imports={self.imports}, exports={self.exports})"

    def drop(self, arrays: list[Any]) -> list[Any]:
        """The buffers that cross the boundary: the shared ones left out."""
        dropped = self.dropped
        return [a for j, a in enumerate(arrays) if j not in dropped]

    def expand(self, arrays: list[Any], earlier: list[list[Any]]) -> list[Any]:
        """The full leaf list again: each shared leaf taken from where it lives (`earlier`
        holds the full lists of the arguments before this one)."""
        out = list(arrays)
        for j, k0, j0 in self.imports:  # in increasing `j`: `out[:j]` is complete
            out.insert(j, out[j0] if k0 == self.k else earlier[k0][j0])
        return out


def links_of(program: Any, variables: dict[int, list[Any]]) -> tuple[Link | None, ...] | None:
    """Per state position, how it shares Variables (None where it does not), or None when no
    Variable is reachable twice. Sharing is supported between Flax NNX objects written back
    into the caller's objects whose Variables line up with their leaves; `variables_of` has
    raised already for sharing anywhere else (a returned object would come back as two
    copies)."""
    first: dict[int, tuple[int, int]] = {}
    imports: dict[int, list[tuple[int, int, int]]] = {}
    exporters: set[int] = set()
    for k, vs in variables.items():
        for j, v in enumerate(vs):
            seen = first.setdefault(id(v), (k, j))
            if seen != (k, j):
                imports.setdefault(k, []).append((j, *seen))
                exporters.add(seen[0])
    if not imports:
        return None
    return tuple(
        Link(k, tuple(imports.get(k, ())), k in exporters)
        if k in imports or k in exporters
        else None
        for k in range(len(program.state_idx))
    )


def variables_of(
    program: Any, args: tuple[Any, ...], leaves: dict[int, list[Any]], analysis: Any
) -> dict[int, list[Any]]:
    """The nnx.Variables of each Flax NNX state argument, in leaf order.

    Returns, per state position, the Variables when they line up one to one with that
    argument's array leaves, for a direct write-back after the call. A Variable reachable
    twice (a shared submodule, tied weights, an optimizer holding the model's Variables, one
    object passed as two arguments) is allowed only where every object reaching it is
    written back and lines up (`links_of` then says how they share); anywhere else it is an
    error: NNX objects travel as pytrees, which would split it into two copies updated apart.
    """
    from flax import nnx

    def is_variable(x: Any) -> bool:
        return isinstance(x, nnx.Variable)

    written_back = {k for k, _ in program.written_back_idx}
    owner: dict[int, int] = {}  # id(Variable) -> the first state position reaching it
    lined_up: set[int] = set()
    shared: list[Any] = []
    out: dict[int, list[Any]] = {}
    for k, i in enumerate(program.state_idx):
        a = args[i]
        if type(a) is LazyHandle or k not in leaves or not is_mutable_module(a):
            continue  # handles are returned state, never written back
        outer = jax.tree_util.tree_leaves(a, is_leaf=is_variable)
        variables = [v for v in outer if is_variable(v)]
        seen_here: set[int] = set()
        for v in variables:
            if id(v) in owner or id(v) in seen_here:
                shared.append(v)
            seen_here.add(id(v))
            owner.setdefault(id(v), k)
        arrays = leaves[k]
        if len(variables) == len(arrays) and all(
            np.shape(get_raw(v)) == np.shape(x) for v, x in zip(variables, arrays, strict=True)
        ):
            out[k] = variables
            if k in written_back and len(outer) == len(variables):
                lined_up.add(k)
    if shared:
        ids = {id(v) for v in shared}
        for k, i in enumerate(program.state_idx):
            a = args[i]
            if k in lined_up or type(a) is LazyHandle:
                continue  # a handle's objects are built from its own buffers: never shared
            reached = jax.tree_util.tree_leaves(a, is_leaf=is_variable)
            if any(id(v) in ids for v in reached):
                raise _shared(program, args, shared[0], analysis)
    return out


def shared_anew(value: Any) -> tuple[str, str] | None:
    """(first path, second path) of an nnx.Variable reachable twice in `value`, a Flax NNX
    object, or None."""
    if not is_mutable_module(value):  # (never imports Flax: a user of another library)
        return None
    from flax import nnx

    found = jax.tree_util.tree_flatten_with_path(
        value, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    first: dict[int, str] = {}
    for path, leaf in found:
        if isinstance(leaf, nnx.Variable):
            seen = first.setdefault(id(leaf), jax.tree_util.keystr(path))
            if seen != jax.tree_util.keystr(path):
                return seen, jax.tree_util.keystr(path)
    return None


def opaque_module(value: Any) -> tuple[str, Any] | None:
    """(path, object) of a Flax NNX object that JAX flattens as one leaf (a module declared
    `pytree=False`) in `value`, or None."""
    if not sys.modules.get("flax.nnx"):
        return None
    # A handle (autoflat's own output) is not traversed: that would build its object.
    leaves, _ = jax.tree_util.tree_flatten_with_path(value, is_leaf=lambda x: type(x) is LazyHandle)
    for path, leaf in leaves:
        if type(leaf) is not LazyHandle and is_mutable_module(leaf):
            return jax.tree_util.keystr(path), leaf
    return None


def nested_module(value: Any) -> tuple[str, Any] | None:
    """(path, object) of a Flax NNX object inside `value`, a value that is none itself (a
    tuple, list or dict of them: `(model, optimizer)`), or None."""
    if not sys.modules.get("flax.nnx") or is_mutable_module(value) or type(value) is LazyHandle:
        return None
    stop = lambda x: type(x) is LazyHandle or is_mutable_module(x)  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(value, is_leaf=stop)[0]:
        if type(leaf) is not LazyHandle and is_mutable_module(leaf):
            return jax.tree_util.keystr(path), leaf
    return None


def relink(link: Link, obj: Any, scope: dict[int, list[Any]]) -> Any:
    """Inside the trace: `obj` (just unflattened, with Variables of its own) holding, at each
    imported leaf, the Variable object that `scope` recorded for the exporting argument; an
    exporting argument's Variables are recorded in `scope`."""
    from flax import nnx

    variables, outer = jax.tree_util.tree_flatten(
        obj, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if link.imports:
        for j, k0, j0 in link.imports:
            variables[j] = variables[j0] if k0 == link.k else scope[k0][j0]
        obj = jax.tree_util.tree_unflatten(outer, variables)
    if link.exports:
        scope[link.k] = variables
    return obj


def _shared(program: Any, args: tuple[Any, ...], var: Any, analysis: Any) -> Exception:
    from flax import nnx

    places = []
    for name, i in zip(program.roles.state, program.state_idx, strict=True):
        paths, _ = jax.tree_util.tree_flatten_with_path(
            args[i], is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        places += [f"{name}{jax.tree_util.keystr(p)}" for p, v in paths if v is var]
    return error(StateError, SHARED_VARIABLE, analysis, first=places[0], second=places[1])
