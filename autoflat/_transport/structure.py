"""Structures: the static part of a state value, interned so that comparing two is `is`.

A *structure* is (treedef, the non-array leaves, which positions are arrays). Non-array leaves
(activation functions, Python scalars, strings) are static, as in `eqx.filter_jit`; array
leaves cross the `jax.jit` boundary. `flatten` splits a value into its interned structure and
its array leaves and `Structure.unflatten` joins them again; `FlatState` is the pair as one
pytree node, `Placement` the multi-device shardings of its leaves, and `describe_difference`
says how two structures differ.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _caches, _jax

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def is_array(x: Any) -> bool:
    """The leaves that cross the jit boundary (the rest are static)."""
    return isinstance(x, _ARRAY_TYPES)


class _ById:
    """Stands in for an unhashable static leaf: equal only to itself."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.obj is self.obj


_ARRAY = object()  # marks array positions in a structure's key


def _static_key(leaf: Any) -> Any:
    try:
        hash(leaf)
    except TypeError:
        return _ById(leaf)
    # 1 == 1.0 == True: the type is part of the key so a rebuild restores the exact leaf.
    return (type(leaf), leaf)


class Structure:
    """An interned (treedef, static leaves, array positions) triple. Compare with `is`."""

    __slots__ = (
        "treedef",
        "static_leaves",
        "array_positions",
        "n_arrays",
        "_immutable",
        "_plain",
        "key",
        "root_type",
        "__weakref__",
    )

    treedef: Any
    static_leaves: tuple[Any, ...]
    array_positions: tuple[int, ...]
    n_arrays: int
    key: Any

    def __init__(
        self, treedef: Any, static_leaves: tuple[Any, ...], positions: tuple[int, ...], key: Any
    ):
        self.treedef = treedef
        self.static_leaves = static_leaves
        self.array_positions = positions
        self.n_arrays = len(positions)
        self._immutable: bool | None = None
        self._plain: bool | None = None
        self.key = key
        data = treedef.node_data()
        # The type of the root node (None for a leaf): read on every call (`handle.__class__`).
        self.root_type: type | None = None if data is None else data[0]

    def unflatten(self, arrays: Sequence[Any]) -> Any:
        """Rebuild the value from its array leaves."""
        if self.n_arrays == len(self.static_leaves):
            return self.treedef.unflatten(arrays)
        return self.treedef.unflatten(self.all_leaves(arrays))

    def all_leaves(self, arrays: Sequence[Any]) -> list[Any]:
        """Every leaf, static and array, in tree order."""
        leaves = list(self.static_leaves)
        for pos, a in zip(self.array_positions, arrays, strict=True):
            leaves[pos] = a
        return leaves

    @property
    def immutable(self) -> bool:
        """Whether a value of this structure cannot be changed in place (tuples, frozen
        dataclasses, Equinox modules): then a rebuilt value can never go stale."""
        if self._immutable is None:
            self._immutable = _treedef_immutable(self.treedef)
        return self._immutable

    @property
    def plain(self) -> bool:
        """Whether a copy of a value of this structure is as good as the value for a walk:
        no node is a Flax NNX object or Variable, which NNX's functions (`nnx.update`, an
        `nnx.jit` function) write into in place through a walk."""
        if self._plain is None:
            self._plain = _treedef_plain(self.treedef)
        return self._plain

    def __repr__(self) -> str:
        return f"Structure({self.treedef}, arrays={self.n_arrays})"


def _type_immutable(t: type) -> bool:
    if t is type(None) or issubclass(t, tuple):
        return True
    params = getattr(t, "__dataclass_params__", None)
    if params is not None and params.frozen:
        return True
    eqx = sys.modules.get("equinox")
    return eqx is not None and issubclass(t, eqx.Module)


def _treedef_plain(treedef: Any) -> bool:
    data = treedef.node_data()
    if data is not None and _written_by_nnx(data[0]):
        return False
    return all(_treedef_plain(c) for c in treedef.children())


def _written_by_nnx(t: type) -> bool:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    kinds = tuple(
        k
        for k in (getattr(nnx, n, None) for n in ("Pytree", "Object", "Variable"))
        if isinstance(k, type)
    )
    return bool(kinds) and issubclass(t, kinds)


def _treedef_immutable(treedef: Any) -> bool:
    data = treedef.node_data()
    if data is None:
        return True  # a leaf
    if not _type_immutable(data[0]):
        return False
    return all(_treedef_immutable(c) for c in treedef.children())


_lock = threading.Lock()
# Held weakly: a structure lives as long as something holds it (a spec, a handle), so one whose
# static leaves are objects (a method step's instance) does not keep them alive.
_interned: weakref.WeakValueDictionary[Any, Structure] = weakref.WeakValueDictionary()


def intern(treedef: Any, leaves: Sequence[Any]) -> tuple[Structure, list[Any]]:
    """The interned structure of a flattened value, and its array leaves."""
    positions = []
    arrays = []
    static: list[Any] = []
    keys: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _ARRAY_TYPES):
            positions.append(i)
            arrays.append(leaf)
            static.append(None)
            keys.append(_ARRAY)
        else:
            static.append(leaf)
            keys.append(_static_key(leaf))
    key = (treedef, tuple(keys))
    s = _interned.get(key)
    if s is None:
        with _lock:
            s = _interned.setdefault(key, Structure(treedef, tuple(static), tuple(positions), key))
    return s, arrays


def flatten(value: Any) -> tuple[Structure, list[Any]]:
    """Flatten `value` (on the host or inside a trace) into its structure and array leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return intern(treedef, leaves)


@_caches.register
def clear() -> None:
    with _lock:
        _interned.clear()


@dataclasses.dataclass(frozen=True)
class Placement:
    """The shardings of a state's array leaves that span several devices (None for the rest,
    which `jit` places as it would anyway), pinned so they survive every step."""

    shardings: tuple[Any, ...]


def computed_dtype(dtype: Any) -> Any:
    """The dtype JAX computes with (a NumPy float64 is float32 without x64, as `jax.jit`
    makes it, silently); PRNG key dtypes as they are."""
    try:
        return jax.dtypes.canonicalize_dtype(dtype)
    except (TypeError, ValueError):
        return dtype


def strongly_typed(x: Any) -> Any:
    """`x` without its weak type (same dtype and values): a step's state outputs and the
    buffers packed for it are strongly typed, so that a weakly typed leaf
    (`jnp.array(0)`, `jnp.full((3,), 1.0)`) does not compile the step a second time."""
    return jax.lax.convert_element_type(x, x.dtype) if _jax.weak_type(x) else x


def is_explicit(sharding: Any) -> bool:
    """Whether `sharding` is on a mesh with explicit axes (JAX's sharding in types): the
    sharding is part of the array's type, `with_sharding_constraint` only asserts it, and
    `jax.sharding.reshard` moves an array to it."""
    explicit = _jax.EXPLICIT_AXIS
    if explicit is None or not isinstance(sharding, jax.sharding.NamedSharding):
        return False
    types = _jax.axis_types(sharding.mesh)
    if explicit not in types.values():
        return False
    # On a mesh mixing explicit and automatic axes, a spec naming an automatic axis is not
    # in the type (`reshard` refuses it): pinned with `with_sharding_constraint`, as before.
    named = [
        a for entry in sharding.spec if entry is not None
        for a in (entry if isinstance(entry, tuple) else (entry,))
    ]  # fmt: skip
    return all(types.get(a) == explicit for a in named)


def pinned(x: Any, sharding: Any) -> Any:
    """`x` on `sharding` inside a trace (state leaving a step as it came in)."""
    if is_explicit(sharding):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def placement_of(arrays: Sequence[Any]) -> Placement | None:
    """None when no leaf spans several devices (nothing to pin), else per-leaf shardings."""
    shardings: list[Any] = []
    multi = False
    for a in arrays:
        s = getattr(a, "sharding", None)
        if s is not None and len(s.device_set) > 1:
            multi = True
            shardings.append(s)
        else:
            shardings.append(None)
    return Placement(tuple(shardings)) if multi else None


class FlatState:
    """State as it crosses the jit boundary: its buffers plus the (static) structure and
    transport layout (None: one buffer per array leaf; see `_transport`), and, inside the
    trace, how it shares Flax NNX Variables with other state (`link`: a `_nnx.Link`, or None).

    A pytree node whose children are the buffers and whose aux data is (structure, layout,
    link), so the structure of state leaving a compiled call comes back with it at no host
    cost beyond one node.
    """

    __slots__ = ("structure", "arrays", "layout", "link")

    def __init__(
        self, structure: Structure, arrays: Sequence[Any], layout: Any = None, link: Any = None
    ):
        self.structure = structure
        self.arrays = list(arrays)
        self.layout = layout
        self.link = link

    def __repr__(self) -> str:
        return f"FlatState({self.structure!r}, {self.layout!r})"


jax.tree_util.register_pytree_node(
    FlatState,
    lambda f: (f.arrays, (f.structure, f.layout, f.link)),
    lambda aux, arrays: FlatState(aux[0], arrays, aux[1], aux[2]),
)


def describe_difference(
    name: str,
    before: Structure,
    before_arrays: Sequence[Any] | None,
    after: Structure,
    after_arrays: Sequence[Any],
) -> str:
    """A short description of how a state's structure, shapes or dtypes changed (with
    `before_arrays=None`, input shapes are not compared)."""
    paths = _paths(before)
    if before.treedef != after.treedef:
        now = _paths(after)
        if not now or not paths:  # (`None` given back: its structure says it)
            return f"  tree structure: {before.treedef}\n  became:         {after.treedef}"
        lines = [f"  {name}{p}: gone" for p in paths if p not in set(now)]
        lines += [
            f"  {name}{p}: new (a leaf it did not come in with)" for p in now if p not in set(paths)
        ]
        if lines:
            more = f"\n  ... ({len(lines) - 10} more)" if len(lines) > 10 else ""
            return "\n".join(lines[:10]) + more
        b_dummy, a_dummy = _dummy(before.treedef), _dummy(after.treedef)
        node = None if _NO_DUMMY in (b_dummy, a_dummy) else _node_difference(b_dummy, a_dummy)
        if node is not None:
            return f"  {name}{node}"
        return f"  tree structure: {before.treedef}\n  became:         {after.treedef}"
    lines = []
    b_leaves = before.all_leaves(
        before_arrays if before_arrays is not None else [_AnyArray()] * before.n_arrays
    )
    a_leaves = after.all_leaves(after_arrays)
    for path, b, a in zip(paths, b_leaves, a_leaves, strict=True):
        if isinstance(b, _AnyArray):
            if not is_array(a):
                lines.append(f"  {name}{path}: an array became {_leaf_desc(a)}")
        elif is_array(b) != is_array(a):
            kind_b = _leaf_desc(b)
            kind_a = _leaf_desc(a)
            lines.append(f"  {name}{path}: {kind_b} became {kind_a}")
        elif is_array(b):
            if (np.shape(b), _dtype(b)) != (np.shape(a), _dtype(a)):
                lines.append(f"  {name}{path}: {_leaf_desc(b)} became {_leaf_desc(a)}")
        elif _static_key(b) != _static_key(a):
            lines.append(f"  {name}{path}: {b!r} became {a!r}")
    return "\n".join(lines[:10]) or "  (no difference found in structure, shapes or dtypes)"


def _node_difference(before: Any, after: Any, path: str = "") -> str | None:
    """Where two trees of placeholder leaves (`_dummy`) with the same leaf paths first
    differ: the node whose type or static data changed (a Flax NNX module's Python int
    attribute, a flag `model.eval()` set), with its path and both, shortened."""
    b = _jax.node_data(jax.tree.structure(before))
    a = _jax.node_data(jax.tree.structure(after))
    if b is None or a is None:
        return None
    if b != a:
        kind = getattr(b[0], "__qualname__", str(b[0]))
        if b[0] is not a[0]:
            return f"{path}: a {kind} became a {getattr(a[0], '__qualname__', a[0])}"
        return (
            f"{path}: the static data of this {kind} changed (not an array: part of the "
            f"structure):\n    {_short(b[1])}\n  became:\n    {_short(a[1])}"
        )
    one_level = lambda root: jax.tree_util.tree_flatten_with_path(  # noqa: E731
        root, is_leaf=lambda y: y is not root
    )[0]
    for (key, cb), (_, ca) in zip(one_level(before), one_level(after), strict=False):
        found = _node_difference(cb, ca, path + jax.tree_util.keystr(key))
        if found is not None:
            return found
    return None


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _paths(structure: Structure) -> list[str]:
    """The path of every leaf of a value of `structure`, as `jax.tree_util.keystr` writes it
    (none where a class of it refuses placeholder leaves)."""
    return list(leaf_paths(structure.treedef) or ())


def leaf_paths(treedef: Any) -> tuple[str, ...] | None:
    """The path of every leaf of `treedef` (`jax.tree_util.keystr`), or None where a class
    of it refuses placeholder leaves."""
    dummy = _dummy(treedef)
    if dummy is _NO_DUMMY:
        return None
    found = jax.tree_util.tree_flatten_with_path(dummy)[0]
    return tuple(jax.tree_util.keystr(path) for path, _ in found)


_NO_DUMMY = object()


def _dummy(treedef: Any) -> Any:
    """A value of `treedef` with placeholder leaves (their positions), built quietly: a
    user's class may check its leaves when built (jmp's loss scales warn about an int), or
    refuse them (then `_NO_DUMMY`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return treedef.unflatten(list(range(treedef.num_leaves)))
        except Exception:
            return _NO_DUMMY


def static_changed(before: Structure, after: Structure) -> bool:
    """Whether a non-array leaf (a Python number, a string) changed, or took an array's place
    or gave its place to one, from `before` to `after`, the tree itself the same."""
    if before.treedef != after.treedef:
        return False
    b_arrays, a_arrays = set(before.array_positions), set(after.array_positions)
    return any(
        (i in b_arrays) != (i in a_arrays)
        or (i not in b_arrays and _static_key(b) != _static_key(a))
        for i, (b, a) in enumerate(zip(before.static_leaves, after.static_leaves, strict=True))
    )


class _AnyArray:
    """An input array leaf whose shape is not known where the message is made."""


def _dtype(x: Any) -> Any:
    return attribute(x, "dtype")


def attribute(x: Any, name: str) -> Any:
    """`x.name`, or None where `x` has none, whatever it raises then (a dict subclass whose
    `__getattr__` is `dict.__getitem__` raises a `KeyError`: the JAX training cookbook's
    `dot_dict`)."""
    try:
        return getattr(x, name, None)
    except Exception:
        return None


def _leaf_desc(x: Any) -> str:
    if is_array(x):
        return f"array {_dtype(x)}{list(np.shape(x))}"
    return f"non-array {type(x).__name__} {x!r}"
