"""Which tuples written in a `return` are looked into at a call.

The source marks a tuple written inside the returned tuple with a parameter's name among its
items (`return (params, opt_state), loss`, `Return.nest`): its items are return positions of
their own. A call keeps such a tuple one position where an argument could be the whole
tuple's new value: a tuple (or list, or namedtuple) argument no `return` names, of the
written tuple's length, whose items have the abstract values of the parameters named there
(`def f(w, carry, x): h, prev_x = carry; ...; return w, (h, x)`, `carry` given back whole,
`x` its new `prev_x`). An item written as another expression fits any value; a per-step
argument named there counts as one step's slice. A tuple naming a parameter that does not
look per-step (`(params, new_ema)`) is always looked into: names decide before abstract
values.

The other way round, a tuple argument whose items the whole return gives back one by one,
each an update of its own, is given back by the whole return (`whole_carry`: a
`lax.fori_loop` body, `return params, state` for `carry`); elsewhere, such items spread
over the return are refused (`refuse_spread_flat`, `refuse_spread_state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._analysis.analysis import Analysis
from .._analysis.returns import Return, renested
from .._errors import STATE_SPREAD, STATE_SPREAD_FLAT, OptionError, error
from .._handles.lazy import LazyHandle
from .._transport.structure import attribute
from .abstract import same_value
from .flow import Flow, scalar_container
from .state_hazards import has_named_parts

_ANY = object()  # an item written as an expression: any value fits it


class _Written(tuple):  # type: ignore[type-arg]
    """What a tuple written in the return holds, item by item: a parameter's value, `_ANY`,
    or a `_Written` for a tuple written inside it."""


def looked_into(analysis: Analysis, values: dict[str, Any], num_steps: int) -> Analysis:
    """`analysis` with its returns looking into only the written tuples no argument could be
    the whole new value of."""
    first = analysis.returns[0] if analysis.returns else None
    if first is None or first.nest is None:
        return analysis
    named = {n for r in analysis.returns for n in r.names if n is not None}
    wholes = [held_object(v) for p, v in values.items() if p not in named]
    wholes = [w for w in wholes if isinstance(w, (tuple, list))]
    if not wholes:
        return analysis
    names = [r.names for r in analysis.returns if r.kind == "tuple"]
    positions = iter(range(len(first.names)))

    def kept(level: tuple[Any, ...]) -> tuple[tuple[Any, ...], _Written]:
        """The children of a written tuple still looked into, and what the tuple holds."""
        children: list[Any] = []
        holds: list[Any] = []
        for child in level:
            if child is None:
                i = next(positions)
                found = {n for ns in names if (n := ns[i]) is not None} & values.keys()
                holds.append(values[found.pop()] if len(found) == 1 else _ANY)
                children.append(None)
                continue
            inner, held = kept(child)
            # A parameter named there that does not look per-step: the names decide (rule 2
            # before rule 3); a per-step input's name is a carry's input (`(h, x)`).
            named = any(
                c is None and h is not _ANY and not _leading(h, num_steps)
                for c, h in zip(inner, held, strict=True)
            )
            whole = not named and any(_fits(held, w, num_steps) for w in wholes)
            children.append(None if whole else inner)
            holds.append(held)
        return tuple(children), _Written(holds)

    nest, _ = kept(first.nest)
    if nest == first.nest:
        return analysis
    new_nest = nest if any(c is not None for c in nest) else None
    returns = tuple(renested(r, new_nest) for r in analysis.returns)
    return dataclasses.replace(analysis, returns=returns)


def held_object(value: Any) -> Any:
    """The object a lazy handle stands for, rebuilt from its leaves (no transfer)."""
    if type(value) is not LazyHandle:
        return value
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _fits(held: Any, value: Any, num_steps: int) -> bool:
    """Whether `value` could be a tuple written holding `held`."""
    if held is _ANY:
        return True
    if isinstance(held, _Written):
        return (
            isinstance(value, (tuple, list))
            and len(value) == len(held)
            and all(_fits(h, v, num_steps) for h, v in zip(held, value, strict=True))
        )
    return _alike(value, held, num_steps)


def _alike(value: Any, named: Any, num_steps: int) -> bool:
    """Same tree structure, and per leaf the same dtype and shape, or `named`'s leaf that shape
    under a leading axis of num_steps (a per-step argument's one step)."""
    leaves, treedef = jax.tree_util.tree_flatten(held_object(value))
    others, other_def = jax.tree_util.tree_flatten(held_object(named))
    same: bool = treedef == other_def  # type: ignore[operator]
    if not same:
        return False
    for a, b in zip(leaves, others, strict=True):
        if _dtype(a) != _dtype(b):
            return False
        shape, other = np.shape(a), np.shape(b)
        if shape != other and not (num_steps > 1 and other == (num_steps, *shape)):
            return False
    return True


def _leading(value: Any, num_steps: int) -> bool:
    """Every leaf an array with a leading axis of num_steps > 1 (a per-step input's look)."""
    leaves = jax.tree_util.tree_leaves(held_object(value))
    return (
        num_steps > 1
        and bool(leaves)
        and all(np.ndim(x) >= 1 and np.shape(x)[0] == num_steps for x in leaves)
    )


def _dtype(leaf: Any) -> Any:
    dtype = attribute(leaf, "dtype")
    return dtype if dtype is not None else type(leaf)


def refuse_spread_state(
    analysis: Analysis,
    values: dict[str, Any],
    pending: list[str],
    given_back: dict[str, int],
    outputs: list[Any],
    num_steps: int,
) -> None:
    """A tuple argument no position gives back, whose items come back one by one among the
    items of a tuple the return is looked into at (`return (params, mom, key), loss` for
    `train_state = (params, mom)`): at num_steps > 1 it would be broadcast and every step
    would restart from it, its new items stacked as outputs. Refused, with the fixes."""
    first = analysis.returns[0] if analysis.returns else None
    if first is None or first.nest is None:
        return
    paths = _paths(first.nest)
    taken_back = set(given_back.values())
    for p in pending:
        value = held_object(values[p])
        if p in given_back or not isinstance(value, (tuple, list)) or not value:
            continue
        for path, positions in _groups(first.nest, paths):
            group = [q for q in positions if q not in taken_back]
            taken: list[int] = []
            for item in value:
                pos = next(
                    (q for q in group if q not in taken and same_value(item, outputs[q])), None
                )
                if pos is None:
                    break
                taken.append(pos)
            else:
                raise error(
                    OptionError, STATE_SPREAD, analysis, param=p, path=path,
                    at=", ".join(f"`{paths[q]}`" for q in taken), num_steps=num_steps,
                    items=", ".join(first.names[q] or "..." for q in taken),
                )  # fmt: skip


def refuse_spread_flat(
    analysis: Analysis,
    values: dict[str, Any],
    pending: list[str],
    given_back: dict[str, int],
    outputs: list[Any],
    num_steps: int,
    flow: Callable[[], list[Flow]],
    names: tuple[str | None, ...],
    items_of_one: bool = False,
) -> None:
    """A tuple argument no position gives back whose items come back one by one at return
    positions of their own, each computed from it other than through reductions alone
    (`def f(*models): a, b = models; return a * 0.5, b + a.sum(), loss`; not a loss and a
    metric computed with hyperparameters `(lr, wd)`, nor gradients with respect to it; not a
    container of scalar arrays, whose items as a loss and a metric look alike): at
    num_steps > 1 it would be broadcast and every step would restart from it, its new items
    stacked as outputs. Refused, with the fixes. `items_of_one`: the positions are the items
    of the tuple one returned expression gives (`return _inner(*train_state, x, y)`)."""
    taken_back = set(given_back.values())
    flows: list[Flow] | None = None
    for p in pending:
        value = held_object(values[p])
        if p in given_back or not isinstance(value, (tuple, list)) or len(value) < 2:
            continue
        if scalar_container(value):
            continue  # (hyperparameters `(lr, wd)`, each in a metric beside the update)
        flows = flow() if flows is None else flows
        taken: list[int] = []
        for item in value:
            empty = not jax.tree_util.tree_leaves(item)  # (`optax.sgd`'s `EmptyState()`)
            pos = next(
                (
                    q
                    for q in range(len(outputs))
                    if q not in taken_back
                    and q not in taken
                    and same_value(item, outputs[q])
                    and (empty or _computed_from(flows[q], p))
                ),
                None,
            )
            if pos is None:
                break
            taken.append(pos)
        else:
            if not jax.tree_util.tree_leaves(value):
                continue
            raise error(
                OptionError, STATE_SPREAD_FLAT, analysis, param=p, num_steps=num_steps,
                at=", ".join(map(str, taken))
                + (" (the items of the tuple its `return` gives)" if items_of_one else ""),
                items=", ".join(names[q] or "..." for q in taken),
            )  # fmt: skip


def _computed_from(flow: Flow, param: str) -> bool:
    """Whether every leaf of a return position is computed from `param` other than
    through reductions alone (and there is one)."""
    return bool(flow.smooth) and all(param in sources for sources in flow.smooth)


def _paths(nest: tuple[Any, ...]) -> list[str]:
    """Each return position's place in the value as written (`[0][1]`)."""
    out: list[str] = []
    for i, child in enumerate(nest):
        out += [f"[{i}]"] if child is None else [f"[{i}]{q}" for q in _paths(child)]
    return out


def _groups(nest: tuple[Any, ...], paths: list[str]) -> list[tuple[str, list[int]]]:
    """Each tuple looked into, as its place in the value as written and its positions."""
    found: list[tuple[str, list[int]]] = []
    start = 0

    def walk(level: tuple[Any, ...], prefix: str) -> int:
        nonlocal start
        first = start
        for i, child in enumerate(level):
            if child is None:
                start += 1
            else:
                begin = walk(child, f"{prefix}[{i}]")
                found.append((f"{prefix}[{i}]", list(range(begin, start))))
        return first

    walk(nest, "")
    return found


def whole_carry(
    values: dict[str, Any],
    pending: list[str],
    first: Return | None,
    outputs: list[Any] | None,
    flow: Callable[[], list[Flow]],
    added_to: Callable[[str, int], bool],
) -> str | None:
    """`def step(carry): params, state = carry; ...; return params, state`, a `lax.fori_loop`
    body: the one tuple argument among `pending` (not of scalars only) whose items are the
    flat tuple return's positions, in order, each an update of its own: an addition whose
    first operand is its own array (`added_to`: `params + updates`, `count + 1`), or a tree
    with named parts computed from it (an optimizer's state). Not metrics made with a tuple
    of hyperparameters, gradients, or data standardised with a tuple of statistics."""
    if first is None or first.kind != "tuple" or first.nest is not None or not outputs:
        return None
    tuples = [p for p in pending if type(held_object(values[p])) is tuple]
    if len(tuples) != 1 or len(outputs) < 2:
        return None
    p = tuples[0]
    items = held_object(values[p])
    if len(items) != len(outputs) or scalar_container(items):
        return None
    flows: list[Flow] = []

    def updated(q: int, item: Any) -> bool:
        if not jax.tree_util.tree_leaves(item) or added_to(p, q):
            return True
        if not flows:
            flows.extend(flow())
        return has_named_parts(item) and p in flows[q].sources

    if all(
        same_value(item, out) and updated(q, item)
        for q, (item, out) in enumerate(zip(items, outputs, strict=True))
    ):
        return p
    return None
