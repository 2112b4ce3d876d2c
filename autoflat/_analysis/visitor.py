"""Stage 1's one libcst pass over a step function's source (`Visitor`), for `_analysis`.

It collects what the function's own scope does (its `return` statements, and the constructs
refused: `yield`, `async`/`await`, `global`, `nonlocal`), what the body does to the
parameters anywhere in it (writes into them, method calls on them, in-place changes of a dict
or a list, attributes read off them) and every name it uses, and which names of its own scope
hold only gradients (`loss, grads = jax.value_and_grad(f)(params, x)`).
"""

from __future__ import annotations

import libcst as cst
import libcst.metadata as meta


def _param_nodes(params: cst.Parameters) -> list[cst.Param]:
    nodes = [*params.posonly_params, *params.params, *params.kwonly_params]
    if isinstance(params.star_arg, cst.Param):
        nodes.append(params.star_arg)
    if params.star_kwarg is not None:
        nodes.append(params.star_kwarg)
    return nodes


# Methods that change a dict or a list in place.
_IN_PLACE_METHODS = frozenset(
    {
        "update", "setdefault",  # dict
        "append", "extend", "insert", "sort", "reverse",  # list
        "__setitem__", "__ior__", "__iadd__",
    }
)  # fmt: skip
# Methods that only take entries out of a dict or a list (`batch.pop("labels")`).
_REMOVING_METHODS = frozenset({"pop", "popitem", "clear", "remove", "__delitem__"})

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


def _names(target: cst.BaseExpression | None) -> list[str]:
    """The names a target binds (`a`, `(a, (b, *c))`)."""
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in _names(el.value)]
    if isinstance(target, cst.StarredElement):
        return _names(target.value)
    return []


class Visitor(cst.CSTVisitor):
    """Collects what the function's own scope does, and the writes and method calls on its
    parameters anywhere in it (nested functions included).

    Which binding a name refers to comes from libcst's `ScopeProvider`: a name refers to a
    parameter when that parameter is among the assignments it can see, so a nested
    function's own parameter or local of the same name is not the parameter, and a
    parameter rebound in the body still is (a write after `p = f(p)` may reach the caller's
    object on another path). The scope provider counts `p.x = ...` as a read of `p`, not a
    write: the writes into a parameter are what this visitor looks for.
    """

    METADATA_DEPENDENCIES = (meta.PositionProvider, meta.ScopeProvider)

    def __init__(self, root: cst.FunctionDef) -> None:
        self.root = root
        self.params = frozenset(_param_nodes(root.params))
        self.scope: meta.Scope | None = None  # the root function's own scope
        self.returns: list[tuple[cst.Return, int]] = []
        self.assigned: dict[str, int] = {}
        self.method_called: set[str] = set()
        self.in_place: dict[str, tuple[str, int]] = {}
        self.removed: dict[str, tuple[str, int]] = {}
        self.attribute_reads: set[tuple[str, str]] = set()
        self.unsupported: list[tuple[str, int]] = []
        self.names: set[str] = set()
        # The own scope's assignments (targets, value) in order, and how many times each name
        # is bound there: `gradients()` reads them once the whole body is seen.
        self.assignments: list[tuple[list[cst.BaseExpression], cst.BaseExpression]] = []
        self.bindings: dict[str, int] = {}
        # Per call of the own scope, the parameters among its arguments (`differentiated`).
        self.takes: dict[cst.Call, frozenset[str]] = {}
        for p in self.params:
            self._count(p.name)

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(meta.PositionProvider, node).start.line

    def _own(self, node: cst.CSTNode) -> bool:
        """Whether `node` runs in the root function's own scope (comprehensions included)."""
        scope = self.get_metadata(meta.ScopeProvider, node, None)
        while isinstance(scope, meta.ComprehensionScope):
            scope = scope.parent
        return scope is not None and scope is self.scope

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

    def gradients(self) -> dict[str, frozenset[str]]:
        """The names of the own scope that every binding binds to gradients, each with the
        parameters they are gradients at."""
        counts: dict[str, int] = {}
        of: dict[str, frozenset[str]] = {}
        for targets, value in self.assignments:
            derivative = self.derivative(value)
            if derivative is None or not isinstance(value, cst.Call):
                continue
            taken = self.differentiated(value)
            for t in targets:
                for n in _names(_gradient_targets(t, *derivative)):
                    counts[n] = counts.get(n, 0) + 1
                    of[n] = of.get(n, frozenset()) | taken
        return {n: of[n] for n, c in counts.items() if c == self.bindings.get(n)}

    def _count(self, target: cst.BaseExpression | None) -> None:
        for n in _names(target):
            self.bindings[n] = self.bindings.get(n, 0) + 1

    def _bound(self, node: cst.CSTNode, target: cst.BaseExpression) -> None:
        """Names bound in the own scope by `target`."""
        if self._own(node):
            self._count(target)

    def _parameter(self, node: cst.BaseExpression) -> str | None:
        """The parameter that the attribute/subscript chain `node` starts from, if any."""
        while isinstance(node, (cst.Attribute, cst.Subscript)):
            node = node.value
        if not isinstance(node, cst.Name):
            return None
        scope = self.get_metadata(meta.ScopeProvider, node, None)
        if scope is None:
            return None
        for access in scope.accesses[node]:
            if access.node is node and any(
                getattr(a, "node", None) in self.params for a in access.referents
            ):
                return node.value
        return None

    # the function itself, and constructs of its own scope
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node is self.root:
            self.scope = self.get_metadata(meta.ScopeProvider, node.body)
            if node.asynchronous is not None:
                self.unsupported.append(("async", self._line(node)))
        else:
            self._bound(node, node.name)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._bound(node, node.name)

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if node.name is not None:
            self._bound(node, node.name.name)

    def visit_Return(self, node: cst.Return) -> None:
        if self._own(node):
            self.returns.append((node, self._line(node)))

    def visit_Yield(self, node: cst.Yield) -> None:
        if self._own(node):
            self.unsupported.append(("yield", self._line(node)))

    def visit_Await(self, node: cst.Await) -> None:
        if self._own(node):
            self.unsupported.append(("async", self._line(node)))

    def visit_Global(self, node: cst.Global) -> None:
        if self._own(node):
            self.unsupported.append(("global", self._line(node)))

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        if self._own(node):
            self.unsupported.append(("nonlocal", self._line(node)))

    # names, writes into parameters and method calls on them
    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def _target(self, target: cst.BaseExpression, line: int) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                self._target(el.value, line)
        elif isinstance(target, cst.StarredElement):
            self._target(target.value, line)
        elif isinstance(target, (cst.Attribute, cst.Subscript)):
            param = self._parameter(target)
            if param is not None:
                self.assigned.setdefault(param, line)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._target(t.target, self._line(node))
        if self._own(node):
            targets: list[cst.BaseExpression] = [t.target for t in node.targets]
            self.assignments.append((targets, node.value))
            for target in targets:
                self._count(target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)
        if isinstance(node.target, cst.Name):
            param = self._parameter(node.target)
            if param is not None:
                op = cst.Module([]).code_for_node(node.operator).strip()
                self.in_place.setdefault(param, (f"{param} {op} ...", self._line(node)))

    def visit_Del(self, node: cst.Del) -> None:
        targets = node.target.elements if isinstance(node.target, cst.Tuple) else ()
        for target in [el.value for el in targets] or [node.target]:
            param = self._parameter(target) if isinstance(target, cst.Subscript) else None
            if param is None:
                self._target(target, self._line(node))
            else:
                spelling = f"del {cst.Module([]).code_for_node(target)}"
                self.removed.setdefault(param, (spelling, self._line(node)))

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._target(node.asname.name, self._line(node))
            self._bound(node, node.asname.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name):
            param = self._parameter(node.value)
            if param is not None:
                self.attribute_reads.add((param, node.attr.value))

    def visit_Call(self, node: cst.Call) -> None:
        if self._own(node):
            taken = {self._parameter(a.value) for a in node.args}
            self.takes[node] = frozenset(p for p in taken if p is not None)
        if isinstance(node.func, cst.Attribute):
            param = self._parameter(node.func.value)
            if param is not None:
                self.method_called.add(param)
                method = node.func.attr.value
                spelling = f"{cst.Module([]).code_for_node(node.func)}(...)"
                if method in _IN_PLACE_METHODS:
                    self.in_place.setdefault(param, (spelling, self._line(node)))
                elif method in _REMOVING_METHODS:
                    self.removed.setdefault(param, (spelling, self._line(node)))
        elif (
            isinstance(node.func, cst.Name)
            and node.func.value in ("setattr", "delattr")
            and node.args
        ):
            # `setattr(p, name, v)` writes into `p` as `p.x = v` does.
            param = self._parameter(node.args[0].value)
            if param is not None:
                self.assigned.setdefault(param, self._line(node))
