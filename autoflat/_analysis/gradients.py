"""Which names of a step's own scope hold only gradients, for `_analysis`.

`loss, grads = jax.value_and_grad(f)(params, x)` binds `grads` to gradients at `params`: not
the new value of `params`, however alike their abstract values. `Gradients` reads that off
the assignments the visitor (`visitor.Visitor`) collected from the own scope: calls of a
transformation (`jax.grad`, `jax.value_and_grad`, Equinox's and Flax NNX's kin), directly or
through a name bound to one once (`grad_fn = jax.value_and_grad(f)`), with `has_aux` read
where it is written, and names rebound from their own tree alone (`grads =
jax.tree.map(clip, grads)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import libcst as cst

# Transformations whose function gives derivatives: `jax.grad(f)(params, x)` is not the new
# value of `params`, however alike their abstract values. A bare name (`from jax import
# grad`) counts only where it is called as a transformation, `grad(f)(...)`.
_DERIVATIVES = frozenset({"grad", "value_and_grad", "filter_grad", "filter_value_and_grad"})
_DERIVATIVE_MODULES = frozenset({"jax", "eqx", "equinox", "nnx", "flax"})


def _dotted(node: cst.BaseExpression) -> list[str]:
    parts = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return []
    return [node.value, *reversed(parts)]


def _transformation(node: cst.BaseExpression) -> tuple[bool, bool] | None:
    """(gives the value too, has_aux) if `node` is `jax.grad(f, ...)` or one of its kin; None
    also where `has_aux` cannot be read (`*args`, `**kwargs`)."""
    if not isinstance(node, cst.Call):
        return None
    name = _dotted(node.func)
    if not name or name[-1] not in _DERIVATIVES:
        return None
    if len(name) > 1 and name[0] not in _DERIVATIVE_MODULES:
        return None
    if any(a.star for a in node.args):
        return None
    positional = [a for a in node.args if a.keyword is None]
    aux_args = [a for a in node.args if a.keyword is not None and a.keyword.value == "has_aux"]
    if len(positional) >= 3 and not name[-1].startswith("filter_"):
        aux_args.append(positional[2])  # jax.grad(fun, argnums, has_aux)
    aux = any(not (isinstance(a.value, cst.Name) and a.value.value == "False") for a in aux_args)
    return "value" in name[-1], aux


def _gradient_targets(
    target: cst.BaseExpression, value: bool, aux: bool
) -> cst.BaseExpression | None:
    """The part of an assignment's target that receives the gradients of a call of a
    transformation (`value`: it gives `(value, grads)`; `aux`: `grads` is `(grads, aux)`, or
    for `value_and_grad` the value is `(value, aux)`), or None."""
    if value or aux:
        if not isinstance(target, (cst.Tuple, cst.List)) or len(target.elements) != 2:
            return None
        return target.elements[1 if value else 0].value
    return target


def _mapped_alone(
    targets: list[cst.BaseExpression], value: cst.BaseExpression, names: Collection[str]
) -> list[tuple[str, str]]:
    """(name bound, the name it comes from) for one of `names` mapped leaf by leaf alone
    (`grads = jax.tree.map(clip, grads)`, `updates = jax.tree.map(lambda g: -lr * g, grads,
    is_leaf=...)`). Mapped with other trees (`jax.tree.map(lambda g, m: beta * m + g, grads,
    momentum)`) it may be a new value of those: nothing."""
    if not isinstance(value, cst.Call) or _dotted(value.func)[-2:] not in _TREE_MAPS:
        return []
    if any(a.star or (a.keyword is not None and a.keyword.value != "is_leaf") for a in value.args):
        return []
    args = [a for a in value.args if a.keyword is None]
    tree = args[1].value if len(args) == 2 else None
    if not isinstance(tree, cst.Name) or tree.value not in names:
        return []
    return [(t.value, tree.value) for t in targets if isinstance(t, cst.Name)]


def _optimizer_update(
    targets: list[cst.BaseExpression], value: cst.BaseExpression, names: Collection[str]
) -> list[tuple[str, str, str]]:
    """(name bound, the name it comes from, the optimizer as written: `_optimizer`) for `u,
    s = tx.update(grads, s, params)` with one of `names` as the first argument (or
    `updates=`, optax's name for it): an optax optimizer's updates, or a hand-written
    optimizer's new parameters, which the optimizer's type or the step's data flow tells
    apart (`_roles.infer`)."""
    if not isinstance(value, cst.Call) or not isinstance(value.func, cst.Attribute):
        return []
    if value.func.attr.value != "update" or not value.args or value.args[0].star:
        return []
    keyword = value.args[0].keyword
    given = [a for a in value.args if a.keyword is not None and a.keyword.value == "updates"]
    first = value.args[0] if keyword is None else given[0] if given else None
    if first is None or not isinstance(first.value, cst.Name) or first.value.value not in names:
        return []
    optimizer = _optimizer(value.func.value)
    rest = [a for a in value.args if a is not first and not a.star]
    state = [a for a in rest if a.keyword is not None and a.keyword.value == "state"]
    state = state or [a for a in rest if a.keyword is None][:1]
    if state and _dotted(state[0].value):  # (its state, `opt_state`, tells an optax one too)
        optimizer = f"{optimizer}|state:{'.'.join(_dotted(state[0].value))}"
    return [
        (t.elements[0].value.value, first.value.value, optimizer)
        for t in targets
        if isinstance(t, (cst.Tuple, cst.List))
        and len(t.elements) == 2
        and isinstance(t.elements[0].value, cst.Name)
    ]


def _optimizer(node: cst.BaseExpression) -> str:
    """The object whose `update` is called, as the first call can look it up: its dotted name
    (`tx`, `state.tx`, `self.tx`), or `call:` and the dotted name of the function a call of
    it is (`optax.adam(1e-3).update(...)`); empty for anything else."""
    if isinstance(node, cst.Call):
        name = _dotted(node.func)
        return f"call:{'.'.join(name)}" if name else ""
    return ".".join(_dotted(node))


_TREE_MAPS = (["tree", "map"], ["tree_util", "tree_map"], ["jax", "tree_map"], ["tree_map"])


def bound_names(target: cst.BaseExpression | None) -> list[str]:
    """The names a target binds (`a`, `(a, (b, *c))`)."""
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in bound_names(el.value)]
    if isinstance(target, cst.StarredElement):
        return bound_names(target.value)
    return []


@dataclasses.dataclass(frozen=True)
class Gradients:
    """The own scope's assignments (targets, value) in order, how many times each name is
    bound there, and per call the parameters among its arguments: what the visitor
    collected, read once the whole body is seen."""

    assignments: list[tuple[list[cst.BaseExpression], cst.BaseExpression]]
    bindings: dict[str, int]
    takes: dict[cst.Call, frozenset[str]]

    def transformations(self) -> dict[str, tuple[bool, bool]]:
        """Names bound once, to a transformation (`grad_fn = jax.value_and_grad(f)`)."""
        found = {}
        for targets, value in self.assignments:
            made = _transformation(value)
            for t in targets:
                if made is not None and isinstance(t, cst.Name):
                    if self.bindings.get(t.value) == 1:
                        found[t.value] = made
        return found

    def derivative(self, node: cst.BaseExpression) -> tuple[bool, bool] | None:
        """(gives the value too, has_aux) if `node` calls a transformation's function:
        `jax.grad(f)(p, x)`, or `grad_fn(p, x)` after `grad_fn = jax.value_and_grad(f)`."""
        if not isinstance(node, cst.Call):
            return None
        if isinstance(node.func, cst.Name):
            made = self.transformations().get(node.func.value)
            if made is not None:
                return made
        return _transformation(node.func)

    def differentiated(self, node: cst.Call) -> frozenset[str]:
        """The parameters a call of a transformation's function takes (`grad_fn(params, x)`,
        `jax.grad(f)(state.params)`): its gradients are the new value of none of them."""
        return self.takes.get(node, frozenset())

    def of_names(self) -> dict[str, frozenset[str]]:
        """The names of the own scope that every binding binds to gradients, each with the
        parameters they are gradients at."""
        return self._readings()[0]

    def updates(self) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
        """The names every binding binds to what an optimizer's `update` gives for gradients
        (`updates, opt_state = tx.update(grads, opt_state)`), each with the parameters the
        gradients are taken at and the optimizers as written (`_optimizer`): an optax
        optimizer's updates, or a hand-written one's new parameters (`_roles.infer` tells)."""
        return self._readings()[1]

    def _readings(
        self,
    ) -> tuple[dict[str, frozenset[str]], dict[str, tuple[frozenset[str], frozenset[str]]]]:
        counts: dict[str, int] = {}
        of: dict[str, frozenset[str]] = {}
        updated: dict[str, frozenset[str]] = {}
        by: dict[str, frozenset[str]] = {}  # the optimizers each updated name comes from
        for targets, value in self.assignments:
            derivative = self.derivative(value)
            if derivative is None or not isinstance(value, cst.Call):
                continue
            taken = self.differentiated(value)
            for t in targets:
                for n in bound_names(_gradient_targets(t, *derivative)):
                    counts[n] = counts.get(n, 0) + 1
                    of[n] = of.get(n, frozenset()) | taken
        for targets, value in self.assignments:  # gradients transformed, in order
            for n, g in _mapped_alone(targets, value, of.keys() | updated.keys()):
                counts[n] = counts.get(n, 0) + 1
                into = updated if g in updated else of
                into[n] = into.get(n, frozenset()) | into[g]
                by[n] = by.get(n, frozenset()) | by.get(g, frozenset())
            for n, g, optimizer in _optimizer_update(targets, value, of.keys() | updated.keys()):
                counts[n] = counts.get(n, 0) + 1
                updated[n] = updated.get(n, frozenset()) | of.get(g, updated.get(g, frozenset()))
                by[n] = by.get(n, frozenset()) | by.get(g, frozenset()) | {optimizer}
        full = {n for n, c in counts.items() if c == self.bindings.get(n)}
        grads = {n: of[n] for n in full if n in of and n not in updated}
        return grads, {n: (updated[n], by[n]) for n in full if n in updated}
