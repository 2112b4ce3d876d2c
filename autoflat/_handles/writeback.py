"""Mutation-style state: writing new values back into the caller's objects, and the record of
the buffers autoflat wrote there.

A step that assigns into an argument it does not return (`totals["sum"] = ...`, `m.x = ...`)
has that argument as state; after the call the caller's object is updated in place to equal
the new value (`write_back`). `check_writable` refuses, before the call, an object that cannot
be updated in place (a tuple, a frozen dataclass, a bare array).

Buffers written into callers' objects are recorded (`record_written`) with the object they went
into: a later call may donate them without a copy while they are still those arrays, reached
through that same object, and held nowhere else (`all_ours`). Flax NNX Variables are written by
`_nnx`, whose caches register here as holders of what they wrote.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

from .. import _caches
from .._analysis.analysis import Analysis
from .._errors import CANNOT_WRITE_BACK, NOT_A_TREE_WRITTEN, NOT_RETURNED, StateError, error
from .._transport import structure as _structure
from .lazy import _UNBUILT, LazyHandle

# Buffers that autoflat wrote into callers' objects, by id, weakly, and the id of the object
# each was written into (entries of freed arrays are pruned as the table grows).
_written: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_owner: dict[int, int] = {}


class Holder(Protocol):
    def holds(self, arrays: Iterable[Any], owner: Any) -> bool: ...


# Objects that keep buffers they wrote themselves (the Flax NNX caches).
_holders: weakref.WeakSet[Any] = weakref.WeakSet()


def is_mutable_module(value: Any) -> bool:
    """Whether `value` is a module object that steps mutate in place (Flax NNX objects).

    Checked without importing any library the user has not imported.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
    return base is not None and isinstance(value, base)


def record_written(arrays: Iterable[Any], owner: Any) -> None:
    """`arrays` were written into the caller's object `owner`."""
    for arr in arrays:
        _written[id(arr)] = arr
        _owner[id(arr)] = id(owner)
    if len(_owner) > 2 * len(_written) + 1024:
        for key in [k for k in _owner if k not in _written]:
            del _owner[key]


def register_holder(holder: Holder) -> None:
    _holders.add(holder)


def _refcounts(arrays: list[Any]) -> list[int]:
    return [sys.getrefcount(a) for a in arrays]


def _calibrate() -> int:
    """References to an array held by one container and the caller's leaf list, as
    `_refcounts` sees them (the same function, so the interpreter's own count is in it)."""
    owner = [object()]
    arrays = list(owner)
    return _refcounts(arrays)[0]


_ONLY_OURS = _calibrate()


def all_ours(arrays: list[Any], owner: Any) -> bool:
    """Whether every array is one autoflat wrote into this very object `owner`, is still that
    array, and is held nowhere else (not appended to a history, not passed on): only then may
    it be donated without a copy. `arrays` is the caller's list of `owner`'s leaves."""
    get = _written.get
    written = all(get(id(a)) is a and _owner.get(id(a)) == id(owner) for a in arrays)
    kept = sum(1 for holder in list(_holders) if holder.holds(arrays, owner))
    if not (written or kept):
        return False
    limit = _ONLY_OURS + kept  # the references that holders keep themselves
    return all(n <= limit for n in _refcounts(arrays))


@_caches.register
def clear() -> None:
    _written.clear()
    _owner.clear()


def write_back(target: Any, new: Any, param: str, analysis: Analysis) -> None:
    """Make the caller's object `target` show the new value of state `param` (`new`: a
    handle, or the value itself where it holds no arrays, see `_call.new_handles`)."""
    if type(new) is not LazyHandle:
        _assign_into(target, new, param, "", analysis)
        return
    if type(target) is LazyHandle:
        for slot in ("_af_structure", "_af_arrays", "_af_placement", "_af_layout", "_af_unpacked"):
            object.__setattr__(target, slot, object.__getattribute__(new, slot))
        object.__setattr__(target, "_af_obj", _UNBUILT)
        object.__setattr__(target, "_af_consumed_by", 0)
        return
    if is_mutable_module(target):
        # Flax NNX: set the new values into the caller's own Variables, as nnx.jit does.
        from flax import nnx

        nnx.update(target, nnx.state(LazyHandle._af_get(new)))
        return
    _assign_into(target, LazyHandle._af_get(new), param, "", analysis)


def _assign_into(target: Any, new: Any, param: str, path: str, analysis: Analysis) -> None:
    """Update `target` in place so that it equals `new` (same tree structure)."""
    if target is new:
        return
    if isinstance(target, dict):
        for k in list(target):
            if k not in new:
                del target[k]
        for k, v in new.items():
            old = target.get(k, None)
            if k in target and _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}[{k!r}]", analysis)
            else:
                target[k] = v
        return
    if isinstance(target, list):
        if len(target) != len(new):
            target[:] = list(new)
            return
        for i, v in enumerate(new):
            old = target[i]
            if _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}[{i}]", analysis)
            else:
                target[i] = v
        return
    if isinstance(target, tuple):
        for i, (old, v) in enumerate(zip(target, new, strict=True)):
            if old is v:
                continue
            if _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}[{i}]", analysis)
            else:
                raise _cannot(analysis, param, f"{path}[{i}]", type(target))
        return
    if _is_mutable_container(target):
        for k, v in vars(new).items():
            old = getattr(target, k, None)
            if _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}.{k}", analysis)
            else:
                setattr(target, k, v)
        return
    raise _cannot(analysis, param, path or "(the whole value)", type(target))


def check_writable(treedef: Any, param: str, analysis: Analysis, value: Any = None) -> None:
    """Before the call: can the caller's object (`value`) be updated in place afterwards?"""
    if treedef.node_data() is None:
        if value is not None and not _structure.is_array(value):
            name = type(value).__name__
            raise error(StateError, NOT_A_TREE_WRITTEN, analysis, param=param, type=name)
        raise error(StateError, NOT_RETURNED, analysis, param=param, type="leaf")
    path = _unwritable_path(treedef, "")
    if path is not None:
        data = treedef.node_data()
        typ = data[0] if data is not None else type(None)
        raise _cannot(analysis, param, path[0] or "", path[1] if path[1] is not None else typ)


def _unwritable_path(treedef: Any, path: str) -> tuple[str, type] | None:
    data = treedef.node_data()
    if data is None:
        return (path, type(None)) if path == "" else None
    typ, aux = data
    if issubclass(typ, (dict, list)):  # (`defaultdict`, `OrderedDict` too)
        return None
    if not _structure._type_immutable(typ) and typ is not type(None):
        # A mutable object is updated through its `__dict__`: one without (`__slots__`)
        # would refuse only after the call.
        return None if getattr(typ, "__dictoffset__", 0) else (path, typ)
    # An immutable node: it cannot be changed in place, so every child must be.
    children = treedef.children()
    keys = list(aux) if typ is dict else list(range(len(children)))
    for key, child in zip(keys, children, strict=False):
        sub = f"{path}[{key!r}]"
        if child.node_data() is None:
            return (sub, typ)
        found = _unwritable_path(child, sub)
        if found is not None:
            return found
    return None


def _is_mutable_container(x: Any) -> bool:
    if isinstance(x, (dict, list)):
        return True
    if (
        x is None
        or isinstance(x, (tuple, str, bytes, int, float, complex))
        or _structure.is_array(x)
    ):
        return False
    if not hasattr(x, "__dict__") or inspect.isroutine(x) or isinstance(x, type):
        return False
    params = getattr(type(x), "__dataclass_params__", None)
    if params is not None and params.frozen:
        return False
    eqx = sys.modules.get("equinox")
    return not (eqx is not None and isinstance(x, eqx.Module))


def _cannot(analysis: Analysis, param: str, path: str, typ: type) -> Exception:
    return error(
        StateError,
        CANNOT_WRITE_BACK,
        analysis,
        param=param,
        path=f"{param}{path}",
        type=typ.__name__,
    )
