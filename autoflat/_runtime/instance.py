"""The static key of a method step's instance, held weakly.

A method step's instance that is a plain object (not a pytree) is part of its specs' keys as
`jax.jit` takes a static argument, but held weakly (`Instance`): JAX's caches keep the specs
they traced for as long as the step lives, and a spec must not keep an instance (and the
arrays it holds) alive. The attribute values the body reads (`_Attribute`, the rest of the
key: `instance_attributes`) are held weakly too, where they take weak references.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _caches
from .._transport.structure import Structure, is_array


class Instance:
    """A method step's plain-object instance, as part of its specs' keys: compared by
    identity and held weakly, as is `structure`, the instance's structure as its specs hold
    it (`WeakLeaf`). An object that takes no weak references is held (as `jax.jit` holds a
    static argument)."""

    __slots__ = ("ref", "oid", "structure")

    def __init__(self, obj: Any, structure: Structure, free: Callable[[Any], None]) -> None:
        ref: Callable[[], Any]
        try:
            ref = weakref.ref(obj, free)
        except TypeError:
            ref = functools.partial(_same, obj)
        self.ref = ref
        self.oid = id(obj)
        self.structure = WeakLeaf(structure, ref)


def _same(obj: Any) -> Any:
    return obj


class WeakLeaf(Structure):
    """The structure of a plain-object instance (one static leaf) that holds it weakly: a
    spec keeps it while JAX's caches keep the spec, and a spec is only traced while its
    instance is alive (the call passing it holds it)."""

    __slots__ = ("_ref",)

    def __init__(self, structure: Structure, ref: Callable[[], Any]) -> None:
        super().__init__(structure.treedef, (), (), None)
        self._immutable = True
        self._ref = ref

    def _leaf(self) -> Any:
        obj = self._ref()
        assert obj is not None, "a method step's instance was freed while a call used it"
        return obj

    def unflatten(self, arrays: Sequence[Any]) -> Any:
        return self._leaf()

    def all_leaves(self, arrays: Sequence[Any]) -> list[Any]:
        return [self._leaf()]

    def __repr__(self) -> str:
        obj = self._ref()
        return "Structure(<freed>)" if obj is None else f"Structure(<{type(obj).__name__}>)"


_MISSING = object()
_FREED = object()  # an attribute value held weakly, since freed
_plain: dict[type, bool] = {}


class _Attribute:
    """An attribute value of a method's plain-object instance, as part of a call's static key:
    equal by type and value when hashable, else by identity (an array, a model). Held weakly
    where it takes weak references (a function or a model may refer back to the instance):
    one since freed equals nothing."""

    __slots__ = ("_ref", "_value", "_identity", "_hash")

    def __init__(self, value: Any) -> None:
        identity = is_array(value)
        h = id(value)
        if not identity:
            try:
                h = hash((type(value), value))
            except TypeError:
                identity = True
        self._identity = identity
        self._hash = h
        try:
            self._ref: weakref.ref[Any] | None = weakref.ref(value)
            self._value = None
        except TypeError:
            self._ref = None
            self._value = value

    @property
    def value(self) -> Any:
        if self._ref is None:
            return self._value
        value = self._ref()
        return _FREED if value is None else value

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Attribute) or (self._hash, self._identity) != (
            other._hash,
            other._identity,
        ):
            return False
        a, b = self.value, other.value
        if a is _FREED or b is _FREED:
            return False
        if a is b:
            return True
        if self._identity or type(a) is not type(b):
            return False
        try:
            return bool(a == b)
        except Exception:  # an `==` that does not give a truth value: not the same
            return False

    def __repr__(self) -> str:
        value = self.value
        if value is _MISSING:
            return "<unset>"
        if value is _FREED:
            return "<freed>"
        if is_array(value):
            return f"a new {value.dtype}{list(value.shape)} array"
        return repr(value)


def instance_attributes(program: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The static-key part of a method step's plain-object instance: the attributes its body
    reads (nothing for a pytree instance, whose leaves are broadcast inputs)."""
    obj = args[program.instance_idx]
    t = type(obj)
    plain = _plain.get(t)
    if plain is None:
        plain = _plain[t] = hasattr(obj, "__dict__") and jax.tree_util.treedef_is_leaf(
            jax.tree_util.tree_structure(obj)
        )
    if not plain:
        return (None,) * len(program.instance_attrs)
    d = obj.__dict__
    return tuple(_Attribute(d.get(a, _MISSING)) for a in program.instance_attrs)


@_caches.register
def _clear_plain() -> None:
    _plain.clear()
