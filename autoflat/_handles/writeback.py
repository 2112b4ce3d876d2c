"""Mutation-style state: writing new values back into the caller's objects, and the record of
the buffers autoflat wrote there.

A step that assigns into an argument it does not return (`totals["sum"] = ...`, `m.x = ...`)
has that argument as state; after the call the caller's object is updated in place to equal
the new value (`write_back`). `check_writable` refuses, before the call, an object that cannot
be updated in place (a tuple, a frozen dataclass, a bare array).

A write the source does not show (in a function the step calls, `helper(m.inner, x)`), into an
object the step gets as it is (one JAX takes as a static leaf: a plain object, not a pytree),
would leave a traced value in the caller's object. `untouched` guards each trace of the body:
it notes what the caller's objects among the static leaves hold before, and after the trace
puts back whatever now holds a traced value and raises a `StateError` naming where. It runs
only while the body is traced (never on a call that runs a compiled program).

Buffers written into callers' objects are recorded (`record_written`) with the object they went
into: a later call may donate them without a copy while they are still those arrays, reached
through that same object, and held nowhere else (`all_ours`). Flax NNX Variables are written by
`_nnx`, whose caches register here as holders of what they wrote.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from .. import _caches, _jax
from .._analysis.analysis import Analysis
from .._errors import (
    CANNOT_WRITE_BACK,
    LEFT_TRACED,
    NOT_A_TREE_WRITTEN,
    NOT_RETURNED,
    Located,
    StateError,
    error,
)
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
    handle, or the value itself where it holds no arrays, see `_runtime.finish.new_handles`)."""
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

        obj = LazyHandle._af_get(new)
        _set_static_attributes(target, obj)  # (first: a new submodule is then updated too)
        nnx.update(target, nnx.state(obj))
        return
    _assign_into(target, LazyHandle._af_get(new), param, "", analysis)


def _set_static_attributes(target: Any, new: Any) -> None:
    """Flax NNX: what the step changed in the caller's modules' structure, as `nnx.jit` leaves
    it (`nnx.update` then sets the Variables): an attribute that is not a Variable, module or
    array that it changed (`self.n += 1` on a Python int, `deterministic` set by
    `model.eval()`); an attribute it set anew, or a submodule or Variable it replaced by one
    of another type (`model.head = nnx.Linear(...)`), as the object the step left there, or
    the caller's own where that is another of the caller's nodes (`model.b = model.a`); a
    submodule or Variable it deleted."""
    from flax import nnx

    nodes = dict(nnx.iter_graph(new))
    ours = dict(nnx.iter_graph(target))
    where = _node_paths(new)
    for path, node in list(ours.items()):
        other = nodes.get(path)
        if not is_mutable_module(node) or type(other) is not type(node):
            continue
        mine = vars(node)
        for name, value in vars(other).items():
            if name.startswith("_pytree__"):
                continue  # (Flax's own bookkeeping; `nnx.List`'s `_length` is the list's)
            if name not in mine or (_graph_node(value) and type(mine[name]) is not type(value)):
                at = (*path, name)
                same = [q for q in where.get(id(value), ()) if q != at and q in ours]
                setattr(node, name, ours[same[0]] if same else value)
            elif not (_holds_state(value) or _same(mine[name], value)):
                setattr(node, name, value)  # (changed by the step)
        for name in [n for n, v in mine.items() if _graph_node(v) and n not in vars(other)]:
            delattr(node, name)  # (`nnx.List.pop()`: its `_length` was set above)


def _graph_node(value: Any) -> bool:
    from flax import nnx

    return is_mutable_module(value) or isinstance(value, nnx.Variable)


def _node_paths(root: Any) -> dict[int, list[tuple[Any, ...]]]:
    """Every path (as `nnx.iter_graph` writes paths) at which each module or Variable is
    reachable through module attributes, by id: a node the step stored twice has two."""
    found: dict[int, list[tuple[Any, ...]]] = {}

    def walk(obj: Any, path: tuple[Any, ...]) -> None:
        if not _graph_node(obj):
            return
        seen = id(obj) in found
        found.setdefault(id(obj), []).append(path)
        if not seen and is_mutable_module(obj):
            for name, value in vars(obj).items():
                if not name.startswith("_"):
                    walk(value, (*path, name))

    walk(root, ())
    return found


def _holds_state(value: Any) -> bool:
    from flax import nnx

    return is_mutable_module(value) or isinstance(
        value, (nnx.Variable, jax.Array, np.ndarray, list, dict)
    )


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


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


# --- the caller's objects a trace gets as they are -------------------------------------------

# How many of the caller's containers `untouched` notes at most, per trace.
_WATCH_LIMIT = 10_000


def static_roots(name: str, value: Any) -> list[tuple[str, Any]]:
    """The caller's objects among the static (non-array) leaves of argument `name` (its value,
    or its interned structure), each with where it is in the argument (`m`, `m['cfg']`)."""
    if isinstance(value, _structure.Structure):
        stand_in = object()  # for the arrays (not watched)
        leaves = value.all_leaves([stand_in] * value.n_arrays)
        statics = [x for x in leaves if _watched(x)]
        if not statics:
            return []
        if value.treedef.num_leaves == 1:
            return [(name, statics[0])]
        try:  # the key paths
            value = value.treedef.unflatten(leaves)
        except Exception:
            return [(f"{name} (a part of it)", x) for x in statics]
    pairs = jax.tree_util.tree_flatten_with_path(value)[0]
    return [(name + jax.tree_util.keystr(path), x) for path, x in pairs if _watched(x)]


def _watched(x: Any) -> bool:
    """Whether `x` is an object whose contents can change (a container, an instance with a
    `__dict__`): not an array, a traced value, a function, a class, a module or a handle."""
    if isinstance(x, (dict, list)):
        return True
    if isinstance(x, (str, bytes, int, float, complex, type, types.ModuleType)) or x is None:
        return False
    if _structure.is_array(x) or _jax.is_tracer(x) or type(x) is LazyHandle:
        return False
    if inspect.isroutine(x) or is_mutable_module(x):  # (Flax NNX objects: `_nnx`'s)
        return False
    return isinstance(getattr(x, "__dict__", None), dict)


class _Noted:
    """The caller's containers reachable from some roots, and what each held (by identity)."""

    def __init__(self, roots: Iterable[tuple[str, str, Any]]) -> None:
        # id -> (container, its contents as noted: a dict or list copy, its path, and the
        # parameter and static leaf it was reached from)
        self.held: dict[int, tuple[Any, Any, str, tuple[str, Any]]] = {}
        for param, path, obj in roots:
            self._note(param, obj, path)

    def _note(self, param: str, obj: Any, path: str) -> None:
        stack = [(obj, path)]
        while stack and len(self.held) < _WATCH_LIMIT:
            x, at = stack.pop()
            if id(x) in self.held:
                continue
            if isinstance(x, tuple):
                stack.extend((v, f"{at}[{i}]") for i, v in enumerate(x))
                continue
            if not _watched(x):
                continue
            if isinstance(x, dict):
                contents: Any = dict(x)
                stack.extend((v, f"{at}[{k!r}]") for k, v in contents.items())
            elif isinstance(x, list):
                contents = list(x)
                stack.extend((v, f"{at}[{i}]") for i, v in enumerate(contents))
            else:
                contents = dict(vars(x))
                stack.extend((v, f"{at}.{k}") for k, v in contents.items())
            self.held[id(x)] = (x, contents, at, (param, obj))

    def put_back(self) -> list[tuple[str, tuple[str, Any]]]:
        """Put back every entry that now holds a traced value; where each was, and the
        parameter and static leaf it was reached from."""
        found = []
        for x, was, at, root in self.held.values():
            now = x if isinstance(x, (dict, list)) else vars(x)
            if isinstance(x, list):
                if len(now) != len(was) or any(a is not b for a, b in zip(now, was, strict=True)):
                    if any(_traced(v) for v in now):
                        found.append((at, root))
                        now[:] = was
                continue
            for k in [k for k in now if k not in was or now[k] is not was[k]]:
                if _traced(now[k]):
                    found.append((f"{at}[{k!r}]" if isinstance(x, dict) else f"{at}.{k}", root))
                    if k in was:
                        now[k] = was[k]
                    else:
                        del now[k]
        return found


def _traced(value: Any) -> bool:
    """Whether `value` is or holds a traced value (in a container or an instance's fields)."""
    stack, seen = [value], set[int]()
    while stack and len(seen) < _WATCH_LIMIT:
        x = stack.pop()
        if _jax.is_tracer(x):
            return True
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif _watched(x):
            stack.extend(vars(x).values())
    return False


@contextlib.contextmanager
def untouched(names: Sequence[str], values: Sequence[Any], fn: Located | None) -> Iterator[None]:
    """Around a trace of the body of `fn`: the caller's objects among the static leaves of
    the arguments (parameter `names`, and their `values` or their `Structure`s) hold no
    traced value afterwards. What does is put back as it was and, unless the trace raised or
    `fn` is None (an abstract evaluation: the compiled trace that follows says it), a
    `StateError` names it."""
    noted = _Noted(
        (name, path, obj)
        for name, value in zip(names, values, strict=True)
        for path, obj in static_roots(name, value)
    )
    if not noted.held:
        yield
        return
    try:
        yield
    except BaseException:
        noted.put_back()
        raise
    found = noted.put_back()
    if found and fn is not None:
        path, (param, leaf) = min(found, key=lambda f: f[0])
        raise error(StateError, LEFT_TRACED, fn, path=path, param=param, type=type(leaf).__name__)
