"""A step's `return` statements as values: `Return`, and the tuples written inside a
returned tuple that are looked into (`Return.nest`).

A tuple written inside the returned tuple with a parameter's name among its items (`return
(params, opt_state), loss`) is looked into: its items are return positions of their own, and
the value the step returns is built back as written. `nest_of` finds those tuples in the
source (the same in every `return`), `flat_elements` lists a `return`'s positions,
`nested`/`unnest` build a returned value from its positions and back, `renested` drops some
of them at a call (`_roles.nesting`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import libcst as cst

ReturnKind = Literal["none", "single", "tuple"]


@dataclasses.dataclass(frozen=True)
class Return:
    """One `return` statement of the function's own scope.

    `names` holds, per returned element, the bare name it returns (or None for any other
    expression). A `single` return has one element; a `none` return (or falling off the end)
    has none.
    """

    line: int
    kind: ReturnKind
    names: tuple[str | None, ...]
    # Set by the first call (`_infer`) for one expression that gave a dict whose values are
    # the return positions (`return {"params": ..., "loss": ...}`): its keys, in that order.
    keys: tuple[Any, ...] = ()
    # Positions that return gradients, each with the parameters they are gradients at: a
    # name only ever bound to what `jax.grad(f)(...)` or its kin give (`loss, grads =
    # jax.value_and_grad(f)(params, x)`), or such a call. Never the new value of those
    # parameters, however alike their abstract values (a previous gradient may be).
    gradients: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # Positions that return an optimizer's `update` of gradients (`updates, opt_state =
    # tx.update(grads, opt_state)`), with the parameters the gradients are taken at and the
    # optimizers as written (`tx`, `state.tx`, `call:optax.adam`): never the new value of
    # those parameters where an optimizer is optax's, else only where the data flow says so
    # (a hand-written optimizer's new parameters, `p - lr * g`).
    updates: tuple[tuple[int, tuple[str, ...], tuple[str, ...]], ...] = ()
    # Tuples written inside the returned tuple where a parameter comes back by name (`return
    # (params, opt_state), loss`): per element, None or the nest of the tuple written there, the
    # same in every return. Such tuples are looked into: their items are return positions of
    # their own (`names` lists them in order) and the result is built back as written
    # (`nested`). None: no tuple is looked into.
    nest: tuple[Any, ...] | None = None
    # A single return of a transformation's call (`return jax.value_and_grad(f)(params, x)`):
    # the items of what it gives are a value and gradients, never a parameter's new value.
    derivative: bool = False

    def describe(self) -> str:
        if self.kind == "none":
            return f"line {self.line} returns nothing"
        shown = [n if n is not None else "<expr>" for n in self.names]
        if self.kind == "tuple":
            return f"line {self.line} returns {written(nested(self.nest, shown))}"
        return f"line {self.line} returns {shown[0]}"


def nested(nest: tuple[Any, ...] | None, items: Any) -> tuple[Any, ...]:
    """A returned tuple built from its positions' `items`, its tuples nested as `nest` says."""
    if nest is None:
        return tuple(items)
    rest = iter(items)

    def build(level: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(next(rest) if child is None else build(child) for child in level)

    return build(nest)


def unnest(nest: tuple[Any, ...] | None, value: Any) -> list[Any] | None:
    """The return positions of `value`, a tuple the step returned, looking into the tuples
    `nest` marks; None where `value` has no tuple of that length there."""
    if not isinstance(value, tuple) or (nest is not None and len(value) != len(nest)):
        return None
    if nest is None:
        return list(value)
    items: list[Any] = []
    for child, item in zip(nest, value, strict=True):
        inner = [item] if child is None else unnest(child, item)
        if inner is None:
            return None
        items += inner
    return items


def renested(r: Return, nest: tuple[Any, ...] | None) -> Return:
    """`r` looking into only the tuples `nest` marks, some of those `r.nest` marks: each tuple
    no longer looked into is one position again (no name, no gradients)."""
    if r.kind != "tuple" or r.nest is None:
        return r
    names: list[str | None] = []
    new_index: dict[int, int] = {}  # old position -> new position, where kept as it was
    old = iter(range(len(r.names)))

    def walk(before: tuple[Any, ...], after: tuple[Any, ...] | None) -> None:
        for b, a in zip(before, after or (None,) * len(before), strict=True):
            if b is None:
                i = next(old)
                new_index[i] = len(names)
                names.append(r.names[i])
            elif a is None:
                for _ in range(_count(b)):
                    next(old)
                names.append(None)
            else:
                walk(b, a)

    walk(r.nest, nest)
    gradients = tuple((new_index[i], ps) for i, ps in r.gradients if i in new_index)
    updates = tuple((new_index[i], ps, by) for i, ps, by in r.updates if i in new_index)
    return dataclasses.replace(
        r, names=tuple(names), gradients=gradients, updates=updates, nest=nest
    )


def _count(nest: tuple[Any, ...]) -> int:
    """How many positions a looked-into tuple holds."""
    return sum(1 if child is None else _count(child) for child in nest)


def written(value: tuple[Any, ...]) -> str:
    """A nested tuple of strings as Python writes it."""
    return "(" + ", ".join(written(v) if isinstance(v, tuple) else v for v in value) + ")"


def nest_of(tuples: list[cst.Tuple], params: frozenset[str]) -> tuple[Any, ...] | None:
    """Which tuples written inside the returned tuples are looked into (`Return.nest`): at an
    element where every return writes a tuple, one of them holding a parameter by name."""
    children = _children(tuples, params)
    return children if children is not None and any(c is not None for c in children) else None


def _children(tuples: list[cst.Tuple], params: frozenset[str]) -> tuple[Any, ...] | None:
    """Per element of `tuples` (None: they differ in length or unpack `*xs`), None or the
    children of the tuples written there, which are looked into."""
    if not tuples or any(
        len(t.elements) != len(tuples[0].elements)
        or any(isinstance(el, cst.StarredElement) for el in t.elements)
        for t in tuples
    ):
        return None
    children = []
    for i in range(len(tuples[0].elements)):
        items = [t.elements[i].value for t in tuples]
        inner = (
            [v for v in items if isinstance(v, cst.Tuple)]
            if any(_holds(v, params) for v in items)
            else []
        )
        children.append(_children(inner, params) if len(inner) == len(items) else None)
    return tuple(children)


def _holds(value: cst.BaseExpression, params: frozenset[str]) -> bool:
    """Whether `value` is a tuple written with a parameter's name among its items, at any
    depth of tuples."""
    return isinstance(value, cst.Tuple) and any(
        (isinstance(el.value, cst.Name) and el.value.value in params) or _holds(el.value, params)
        for el in value.elements
        if not isinstance(el, cst.StarredElement)
    )


def flat_elements(
    value: cst.Tuple, nest: tuple[Any, ...] | None
) -> list[cst.BaseExpression | None]:
    """The expressions at a returned tuple's positions, looking into the tuples `nest` marks
    (None for a `*xs` element)."""
    out: list[cst.BaseExpression | None] = []
    for i, el in enumerate(value.elements):
        child = nest[i] if nest is not None else None
        if isinstance(el, cst.StarredElement):
            out.append(None)
        elif child is not None:
            out += flat_elements(cst.ensure_type(el.value, cst.Tuple), child)
        else:
            out.append(el.value)
    return out
