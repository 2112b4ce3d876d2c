"""`GraphSnapshot`: the containers reachable from some objects, and the identity of every
value each held, checked again in a few microseconds a node (the Flax NNX fast path, `_nnx`).
"""

from __future__ import annotations

import itertools
import operator
import types
from collections.abc import Callable, Iterable
from typing import Any

# Flax's own bookkeeping attributes: compared by identity, never walked into.
_INTERNAL_PREFIXES = ("_pytree__", "_object__")
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_is = operator.is_
_chain = itertools.chain.from_iterable
_values = dict.values


class GraphSnapshot:
    """The containers reachable from some objects, and the identity of every value each held.

    `unchanged()` is true while no container gained, lost or replaced a value. Values are
    compared by identity, so an attribute set to an equal but new object counts as a change
    (a false alarm costs one slow call, never a wrong result).

    Plain dicts (every object's `__dict__`) and plain lists are checked all together, each
    check one pass in C over every container: their lengths, the dicts' keys in order, and
    the identity of every value. A subclass of either (which may order or iterate its items
    its own way) is checked on its own, as are sets.
    """

    __slots__ = ("_dicts", "_lists", "_lens", "_keys", "_values", "_items", "_odd", "_sets")

    def __init__(self, roots: Iterable[Any], is_leaf: Callable[[Any], bool]) -> None:
        dicts: list[dict[Any, Any]] = []
        lists: list[list[Any]] = []
        odd: list[tuple[Any, tuple[Any, ...] | None, list[Any]]] = []  # subclasses: see below
        sets: list[tuple[set[Any], frozenset[Any]]] = []
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if id(node) in seen or is_leaf(node) or isinstance(node, _NOT_WALKED):
                continue
            seen.add(id(node))
            if isinstance(node, list):
                if type(node) is list:
                    lists.append(node)
                else:
                    odd.append((node, None, list(node)))
                stack.extend(node)
            elif isinstance(node, tuple):
                stack.extend(node)
            elif isinstance(node, set):
                sets.append((node, frozenset(node)))
            else:
                d = node if isinstance(node, dict) else getattr(node, "__dict__", None)
                if not isinstance(d, dict):
                    continue  # no instance dict (slots, builtins): nothing that can change
                if type(d) is dict:
                    dicts.append(d)
                else:
                    odd.append((d, tuple(d), list(d.values())))
                stack.extend(
                    v
                    for key, v in d.items()
                    if not (isinstance(key, str) and key.startswith(_INTERNAL_PREFIXES))
                )
        self._dicts, self._lists, self._odd, self._sets = dicts, lists, odd, sets
        self._lens = list(map(len, dicts)) + list(map(len, lists))
        self._keys = list(_chain(dicts))
        self._values = list(_chain(map(_values, dicts)))
        self._items = list(_chain(lists))

    def unchanged(self) -> bool:
        dicts, lists = self._dicts, self._lists
        # The lengths first: with them equal, each flat sequence below lines up with its own.
        if [*map(len, dicts), *map(len, lists)] != self._lens:
            return False
        if list(_chain(dicts)) != self._keys:
            return False
        if not all(map(_is, _chain(map(_values, dicts)), self._values)):
            return False
        if not all(map(_is, _chain(lists), self._items)):
            return False
        for c, keys, values in self._odd:  # (a list's keys are None)
            if len(c) != len(values):
                return False
            if not all(map(_is, c if keys is None else c.values(), values)):
                return False
            if keys is not None and tuple(c) != keys:
                return False
        return all(s == frozen for s, frozen in self._sets)
