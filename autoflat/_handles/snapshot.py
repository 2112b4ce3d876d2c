"""`GraphSnapshot`: the containers reachable from some objects, and the identity of every
value each held, checked again in a few microseconds a node (the Flax NNX fast path, `_nnx`).
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable, Iterable
from typing import Any

# Flax's own bookkeeping attributes: compared by identity, never walked into.
_INTERNAL_PREFIXES = ("_pytree__", "_object__")
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_is = operator.is_


class GraphSnapshot:
    """The containers reachable from some objects, and the identity of every value each held.

    `unchanged()` is true while no container gained, lost or replaced a value. Values are
    compared by identity, so an attribute set to an equal but new object counts as a change
    (a false alarm costs one slow call, never a wrong result).
    """

    __slots__ = ("_dicts", "_lists", "_sets")

    def __init__(self, roots: Iterable[Any], is_leaf: Callable[[Any], bool]) -> None:
        dicts: list[tuple[dict[Any, Any], tuple[Any, ...], list[Any]]] = []
        lists: list[tuple[list[Any], list[Any]]] = []
        sets: list[tuple[set[Any], frozenset[Any]]] = []
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if id(node) in seen or is_leaf(node) or isinstance(node, _NOT_WALKED):
                continue
            seen.add(id(node))
            if isinstance(node, list):
                lists.append((node, list(node)))
                stack.extend(node)
            elif isinstance(node, tuple):
                stack.extend(node)
            elif isinstance(node, set):
                sets.append((node, frozenset(node)))
            else:
                d = node if isinstance(node, dict) else getattr(node, "__dict__", None)
                if type(d) is not dict:
                    continue  # no instance dict (slots, builtins): nothing that can change
                dicts.append((d, tuple(d), list(d.values())))
                stack.extend(
                    v
                    for key, v in d.items()
                    if not (isinstance(key, str) and key.startswith(_INTERNAL_PREFIXES))
                )
        self._dicts = dicts
        self._lists = lists
        self._sets = sets

    def unchanged(self) -> bool:
        for d, keys, values in self._dicts:
            if len(d) != len(keys) or not all(map(_is, d.values(), values)) or tuple(d) != keys:
                return False
        for lst, values in self._lists:
            if len(lst) != len(values) or not all(map(_is, lst, values)):
                return False
        return all(s == frozen for s, frozen in self._sets)
