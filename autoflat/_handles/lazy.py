"""Lazy handles: state returned by a step, standing for the real object until it is used.

A handle holds (structure, array leaves) straight from a compiled call. It rebuilds the real
object with `tree_unflatten` on first access (attribute, call, `repr`, pickling, iteration,
`autoflat.unwrap`), once, and otherwise behaves as that object: `isinstance` sees its class,
and JAX sees the same tree. A handle whose buffers were donated to a later call is
*consumed*: using it raises a `ConsumedError`.

To JAX a handle is a pytree node of its own type whose children are the real object's root
children, under the root's own keys, with or without key paths: every function that walks a
tree (`jax.tree.map`, `jax.jit`, `tree_flatten_with_path`) sees the object's leaves and paths
(`['w1']`, `[0].mu['w1']`), and an `is_leaf` sees every node of the object below its root, as
it would see the object's. The children are the real object's: a handle of immutable
structure (tuples, NamedTuples, frozen dataclasses, Equinox modules) is rebuilt once and keeps
its object (it stays on the step's fast path); a mutable one (a dict) gives a copy made for
that traversal and stays unbuilt. Two handles of one structure pair (`jax.tree.map(f, h1,
h2)`, by path too). A handle pairs with no real tree: JAX pairs trees node type by node type,
and `jax.tree.map(g, h)` builds the real type. Where that fails (`eqx.partition(h, ...)`,
`optax.apply_updates(h, updates)`, orbax saving handles), JAX's message prints the handle's
type, whose repr says what to do: `autoflat.unwrap(x)`, or `lazy=False`.

`flax.serialization` (`to_state_dict`, `to_bytes`, `from_state_dict`, `from_bytes`) takes a
handle as its object once flax.serialization is imported (`register_with_flax`).
"""

from __future__ import annotations

import collections
import copy as _copy
import os
import sys
import sysconfig
import types
import weakref
from typing import Any

import jax

from .._errors import (
    CONSUMED,
    CONSUMED_LOST,
    HANDLE_BUILT_BY_TYPE,
    HANDLE_NODE,
    HANDLE_TYPE,
    ConsumedError,
    Location,
    error,
)
from .._transport.structure import Placement, Structure, flatten


class Origin:
    """Who produced a handle: the step's name (`__qualname__`) and `file:line` for messages
    (it is `Located`), its counters for rebuilds, and where its handles were rebuilt
    (`rebuilt_at`: the caller's `file:line`, counted; `autoflat.profile` reports them)."""

    __slots__ = ("name", "where", "stats", "rebuilt_at")

    def __init__(self, name: str, where: str, stats: Any) -> None:
        self.name = name
        self.where = where
        self.stats = stats
        self.rebuilt_at: collections.Counter[str] = collections.Counter()

    def note_rebuild(self) -> None:
        """Count a rebuild, at the first frame outside autoflat and the installed libraries
        (a rebuild is rare: walking a few frames costs nothing next to it)."""
        self.stats.rebuilds += 1
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
            frame = frame.f_back
        if frame is not None:
            code = frame.f_code
            self.rebuilt_at[f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"] += 1


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A rebuild is counted where the user's code asked for it: past autoflat's frames and the
# installed libraries' (JAX's pytree functions, `eqx.filter_jit`, optax walking a handle).
_SKIPPED_DIRS = (
    _PACKAGE_DIR,
    *{os.path.abspath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")},
)


class _HandleType(type):
    """The type of `LazyHandle`. Where a handle meets a tree of another type, JAX's pytree
    error prints the handle's type: its repr says what to do. Code that rebuilds a value by
    its type (`type(x)(...)`) gets a `TypeError` that says the same."""

    def __repr__(cls) -> str:
        return HANDLE_TYPE

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], Structure):
            raise TypeError(HANDLE_BUILT_BY_TYPE)
        return super().__call__(*args, **kwargs)


class LazyHandle(metaclass=_HandleType):
    """A state value returned by an autoflat step; behaves as the object it stands for."""

    __slots__ = (
        "_af_structure",
        "_af_arrays",
        "_af_placement",
        "_af_obj",
        "_af_origin",
        "_af_param",
        "_af_consumed_by",
        "_af_layout",
        "_af_unpacked",
        "_af_consumer",
        "_af_lent",
        "__weakref__",
    )

    _af_structure: Structure
    _af_arrays: list[Any]
    _af_placement: Placement | None
    _af_obj: Any
    _af_origin: Origin | None
    _af_param: str
    _af_consumed_by: int
    _af_consumer: Origin | None  # the step whose call consumed it
    _af_lent: bool  # its arrays went out in a copy of its object (`_object_for_jax`)

    def __init__(
        self,
        structure: Structure,
        arrays: list[Any],
        placement: Placement | None = None,
        origin: Origin | None = None,
        param: str = "state",
        layout: Any = None,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "_af_structure", structure)
        set_(self, "_af_arrays", arrays)
        set_(self, "_af_placement", placement)
        set_(self, "_af_obj", _UNBUILT)
        set_(self, "_af_origin", origin)
        set_(self, "_af_param", param)
        set_(self, "_af_consumed_by", 0)
        set_(self, "_af_consumer", None)
        set_(self, "_af_layout", layout)
        set_(self, "_af_unpacked", None)
        set_(self, "_af_lent", False)

    # --- the real object -------------------------------------------------------------------
    def _af_check(self) -> None:
        call = object.__getattribute__(self, "_af_consumed_by")
        if call:
            origin = object.__getattribute__(self, "_af_consumer") or object.__getattribute__(
                self, "_af_origin"
            )
            raise error(
                ConsumedError,
                CONSUMED if call > 0 else CONSUMED_LOST,  # < 0: see `_launch.launch`
                origin if origin is not None else Location("step", "?"),
                param=object.__getattribute__(self, "_af_param"),
                call=abs(call),
            )

    def _af_get(self) -> Any:
        """The real object, rebuilt once."""
        obj = object.__getattribute__(self, "_af_obj")
        if obj is _UNBUILT:
            LazyHandle._af_check(self)
            structure = object.__getattribute__(self, "_af_structure")
            obj = structure.unflatten(LazyHandle._af_leaf_arrays(self))
            object.__setattr__(self, "_af_obj", obj)
            origin = object.__getattribute__(self, "_af_origin")
            if origin is not None:
                origin.note_rebuild()
        elif object.__getattribute__(self, "_af_consumed_by"):
            LazyHandle._af_check(self)
        return obj

    def _af_leaves(self) -> tuple[Structure, list[Any]]:
        """(structure, arrays) for a step, without a rebuild unless the object may have
        changed."""
        LazyHandle._af_check(self)
        obj = object.__getattribute__(self, "_af_obj")
        structure = object.__getattribute__(self, "_af_structure")
        if obj is _UNBUILT or structure.immutable:
            return structure, LazyHandle._af_leaf_arrays(self)
        return flatten(obj)

    def _af_leaf_arrays(self) -> list[Any]:
        """The array leaves (unpacked with one device call if they travel packed)."""
        layout = object.__getattribute__(self, "_af_layout")
        buffers = object.__getattribute__(self, "_af_arrays")
        if layout is None:
            return buffers
        arrays = object.__getattribute__(self, "_af_unpacked")
        if arrays is None:
            from .._transport.host import unpack_on_device

            arrays = unpack_on_device(layout, buffers)
            object.__setattr__(self, "_af_unpacked", arrays)
        return arrays

    # --- behave as the object --------------------------------------------------------------
    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        structure = object.__getattribute__(self, "_af_structure")
        root = structure.root_type
        if root is not None:
            return root
        return type(LazyHandle._af_get(self))

    def __getattr__(self, name: str) -> Any:
        return getattr(LazyHandle._af_get(self), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(LazyHandle._af_get(self), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(LazyHandle._af_get(self), name)

    def __dir__(self) -> list[str]:
        return dir(LazyHandle._af_get(self))

    def __repr__(self) -> str:
        return repr(LazyHandle._af_get(self))

    def __str__(self) -> str:
        return str(LazyHandle._af_get(self))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return LazyHandle._af_get(self)(*args, **kwargs)

    def __eq__(self, other: object) -> Any:
        return LazyHandle._af_get(self) == unwrap(other)

    def __ne__(self, other: object) -> Any:
        return LazyHandle._af_get(self) != unwrap(other)

    def __hash__(self) -> int:
        return hash(LazyHandle._af_get(self))

    def __bool__(self) -> bool:
        return bool(LazyHandle._af_get(self))

    def __len__(self) -> int:
        return len(LazyHandle._af_get(self))

    def __iter__(self) -> Any:
        return iter(LazyHandle._af_get(self))

    def __contains__(self, item: Any) -> bool:
        return item in LazyHandle._af_get(self)

    def __getitem__(self, key: Any) -> Any:
        return LazyHandle._af_get(self)[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        LazyHandle._af_get(self)[key] = value

    def __delitem__(self, key: Any) -> None:
        del LazyHandle._af_get(self)[key]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickles as the real object: unpickling needs no autoflat.
        return LazyHandle._af_get(self).__reduce_ex__(protocol)

    def __copy__(self) -> Any:
        return _copy.copy(LazyHandle._af_get(self))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _copy.deepcopy(LazyHandle._af_get(self), memo)


def _forward_operators() -> None:
    """Numeric and conversion protocols forward to the real object (a state may be an array)."""
    import operator

    binary = [
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "matmul",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
        "lt",
        "le",
        "gt",
        "ge",
    ]
    for name in binary:
        op = getattr(operator, f"{name}_") if name in ("and", "or") else getattr(operator, name)

        def forward(self: LazyHandle, other: Any, op: Any = op) -> Any:
            return op(LazyHandle._af_get(self), unwrap(other))

        def reflected(self: LazyHandle, other: Any, op: Any = op) -> Any:
            return op(unwrap(other), LazyHandle._af_get(self))

        setattr(LazyHandle, f"__{name}__", forward)
        if name not in ("lt", "le", "gt", "ge"):
            setattr(LazyHandle, f"__r{name}__", reflected)
    for name in [
        "neg",
        "pos",
        "abs",
        "invert",
        "float",
        "int",
        "index",
        "complex",
        "round",
        "array",
        "jax_array",
        "format",
        "reversed",
    ]:

        def unary(self: LazyHandle, *args: Any, name: str = name) -> Any:
            return getattr(LazyHandle._af_get(self), f"__{name}__")(*args)

        setattr(LazyHandle, f"__{name}__", unary)


_forward_operators()


class _Unbuilt:
    def __repr__(self) -> str:
        return "<unbuilt>"


_UNBUILT = _Unbuilt()

# The setters of the slots, in their order in `LazyHandle.__slots__` (see `new_handle`).
_slot_setters = tuple(
    getattr(LazyHandle, name).__set__ for name in LazyHandle.__slots__ if name != "__weakref__"
)


def new_handle(
    structure: Structure,
    arrays: list[Any],
    placement: Placement | None,
    origin: Origin | None,
    param: str,
    layout: Any,
) -> LazyHandle:
    """`LazyHandle(...)` by its slots' own setters: a step makes one per state output per
    call, and this is the cheapest way to fill a slotted object whose `__setattr__` forwards
    to the real one."""
    h = object.__new__(LazyHandle)
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10 = _slot_setters
    s0(h, structure)
    s1(h, arrays)
    s2(h, placement)
    s3(h, _UNBUILT)
    s4(h, origin)
    s5(h, param)
    s6(h, 0)
    s7(h, layout)
    s8(h, None)
    s9(h, None)
    s10(h, False)
    return h


class _OneLevel:
    """The node data of a handle to JAX: the treedef of the real object's root node over its
    children (subtrees there, not leaves). Its repr, which JAX prints in a treedef, names the
    object's type and says how to get it."""

    __slots__ = ("treedef",)

    def __init__(self, treedef: Any) -> None:
        self.treedef = treedef

    def __eq__(self, other: object) -> bool:
        return type(other) is _OneLevel and other.treedef == self.treedef

    def __hash__(self) -> int:
        return hash(self.treedef)

    def __repr__(self) -> str:
        data = self.treedef.node_data()
        return HANDLE_NODE.format(type="leaf" if data is None else data[0].__name__)


def _object_for_jax(h: LazyHandle) -> Any:
    """The real object whose root children JAX sees through handle `h`: its own object once
    rebuilt; else, of immutable structure, rebuilt now and kept (it can never go stale, and
    the step still takes the handle on its fast path); else, of plain dicts and lists, a copy
    for this traversal only, so the handle stays unbuilt and the step takes it next on the
    fast path (its arrays are lent: a donating call copies those still held elsewhere,
    `jax.tree.leaves(h)` kept); else (a Flax NNX module, whose Variables `nnx.update` or
    `nnx.jit` write in place) rebuilt now and kept, so what they write reaches the object."""
    obj = object.__getattribute__(h, "_af_obj")
    if obj is not _UNBUILT:
        return LazyHandle._af_get(h)  # (raises if consumed)
    structure = object.__getattribute__(h, "_af_structure")
    if structure.immutable or not structure.plain:
        return LazyHandle._af_get(h)
    LazyHandle._af_check(h)
    object.__setattr__(h, "_af_lent", True)
    return structure.unflatten(LazyHandle._af_leaf_arrays(h))


_holding: weakref.WeakKeyDictionary[Structure, bool] = weakref.WeakKeyDictionary()


def holds_handles(structure: Structure) -> bool:
    """Whether a value of `structure` holds handles below its root (a dict of two steps'
    results): to JAX each is a node of its own type, not the object's."""
    found = _holding.get(structure)
    if found is None:
        found = _holding[structure] = _treedef_holds(structure.treedef)
    return found


def _treedef_holds(treedef: Any) -> bool:
    data = treedef.node_data()
    if data is not None and data[0] is LazyHandle:
        return True
    return any(_treedef_holds(c) for c in treedef.children())


def _flatten_handle(h: LazyHandle) -> tuple[list[Any], _OneLevel]:
    """The real object's root children (`jax.jit`, `jax.tree.map` and the other key-less
    pytree functions): an `is_leaf` then sees every node below the root, as for the object."""
    obj = _object_for_jax(h)
    children, level = jax.tree_util.tree_flatten(obj, is_leaf=lambda y: y is not obj)
    return children, _OneLevel(level)


def _flatten_handle_with_keys(h: LazyHandle) -> tuple[list[tuple[Any, Any]], _OneLevel]:
    """The real object's root children under the root's own keys, so a key path through a
    handle equals the path through the object (JAX gives every child of a node exactly one
    key); the same node as the key-less flatten, so handles pair with and without paths."""
    obj = _object_for_jax(h)
    pairs, level = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda y: y is not obj)
    return [(path[0], child) for path, child in pairs], _OneLevel(level)


def _unflatten_handle(aux: _OneLevel, children: Any) -> Any:
    # A handle never comes back from an unflatten: JAX builds the real object.
    return aux.treedef.unflatten(children)


jax.tree_util.register_pytree_with_keys(
    LazyHandle, _flatten_handle_with_keys, _unflatten_handle, _flatten_handle
)
# JAX's pytree errors name the class; make that name the public one the docs explain.
LazyHandle.__module__ = "autoflat"


def unwrap(x: Any) -> Any:
    """Return the real object(s) behind autoflat's lazy handles.

    **Arguments:**

    - `x`: a handle, or any value; tuples, lists and dicts are unwrapped element by element.

    **Returns:**

    `x` with every handle replaced by the object it stands for (rebuilt once, if needed).

    **Raises:**

    `ConsumedError` (a `RuntimeError`) if a handle was consumed by a later call that donated
    its buffers.

    ```python
    >>> import autoflat
    >>> autoflat.unwrap((1, [2]))
    (1, [2])

    ```
    """
    # A walk of the builtin containers only, not `jax.tree.map`: that would sort dict keys
    # (and fail on keys that do not sort) and rebuild every pytree node it meets, returning
    # copies of the user's objects (a Flax NNX module among them) instead of the objects.
    if type(x) is LazyHandle:
        return LazyHandle._af_get(x)
    if type(x) is tuple:
        return tuple(unwrap(v) for v in x)
    if type(x) is list:
        return [unwrap(v) for v in x]
    if type(x) is dict:
        return {k: unwrap(v) for k, v in x.items()}
    return x


_flax_registered = False


def register_with_flax() -> None:
    """Once `flax.serialization` is imported, make it take a handle as the object it stands
    for (`to_state_dict`, `to_bytes`, `from_state_dict`, `from_bytes` look a value's type up in
    a registry of their own, not JAX's). Called at every step call, so it costs a look-up in
    `sys.modules` until Flax is there."""
    global _flax_registered
    if _flax_registered:
        return
    serialization = sys.modules.get("flax.serialization")
    if serialization is None:
        return
    _flax_registered = True
    if not serialization.is_serializable(LazyHandle):
        serialization.register_serialization_state(
            LazyHandle,
            lambda h: serialization.to_state_dict(unwrap(h)),
            lambda h, state: serialization.from_state_dict(unwrap(h), state),
        )


register_with_flax()


def is_handle(x: Any) -> bool:
    """Whether `x` is an autoflat lazy handle (`isinstance` sees the wrapped class instead)."""
    return type(x) is LazyHandle
