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

# Transformations whose function gives derivatives: `jax.grad(f)(params, x)` is never a
# parameter's new value, however alike their abstract values. A bare name (`from jax import
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
    """(gives the value too, has_aux) if `node` is `jax.grad(f, ...)` or one of its kin."""
    if not isinstance(node, cst.Call):
        return None
    name = _dotted(node.func)
    if not name or name[-1] not in _DERIVATIVES:
        return None
    if len(name) > 1 and name[0] not in _DERIVATIVE_MODULES:
        return None
    aux = any(
        a.keyword is not None
        and a.keyword.value == "has_aux"
        and not (isinstance(a.value, cst.Name) and a.value.value == "False")
        for a in node.args
    )
    return "value" in name[-1], aux


def _gradient_targets(target: cst.BaseExpression, value: bool, aux: bool) -> cst.BaseExpression:
    """The part of an assignment's target that receives the gradients of a call of a
    transformation (`value`: it gives `(value, grads)`; `aux`: `grads` is `(grads, aux)`, or
    for `value_and_grad` the value is `(value, aux)`)."""
    if value or aux:
        if not isinstance(target, (cst.Tuple, cst.List)) or len(target.elements) != 2:
            return cst.Tuple([])
        return target.elements[1 if value else 0].value
    return target


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
        # Names of the own scope: bound to a transformation (`grad_fn = jax.grad(f)`), bound
        # to gradients, bound otherwise. `gradients()` gives those only ever gradients.
        self.transformations: dict[str, tuple[bool, bool]] = {}
        self.gradient_names: set[str] = set()
        self.other_names: set[str] = {p.name.value for p in self.params}

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(meta.PositionProvider, node).start.line

    def _own(self, node: cst.CSTNode) -> bool:
        """Whether `node` runs in the root function's own scope (comprehensions included)."""
        scope = self.get_metadata(meta.ScopeProvider, node, None)
        while isinstance(scope, meta.ComprehensionScope):
            scope = scope.parent
        return scope is not None and scope is self.scope

    def derivative(self, node: cst.BaseExpression) -> tuple[bool, bool] | None:
        """(gives the value too, has_aux) if `node` calls a transformation's function:
        `jax.grad(f)(p, x)`, or `grad_fn(p, x)` after `grad_fn = jax.value_and_grad(f)`."""
        if not isinstance(node, cst.Call):
            return None
        if isinstance(node.func, cst.Name) and node.func.value in self.transformations:
            return self.transformations[node.func.value]
        return _transformation(node.func)

    def gradients(self) -> frozenset[str]:
        """The names of the own scope that every binding binds to gradients."""
        return frozenset(self.gradient_names - self.other_names)

    def _bind(self, target: cst.BaseExpression, into: set[str]) -> None:
        if isinstance(target, cst.Name):
            into.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                self._bind(el.value, into)
        elif isinstance(target, cst.StarredElement):
            self._bind(target.value, into)

    def _bound(self, node: cst.CSTNode, target: cst.BaseExpression) -> None:
        """Names bound in the own scope by `target`, otherwise than to gradients."""
        if self._own(node):
            self._bind(target, self.other_names)

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
        if not self._own(node):
            return
        made = _transformation(node.value)
        derivative = self.derivative(node.value)
        for t in node.targets:
            if made is not None and isinstance(t.target, cst.Name):
                self.transformations[t.target.value] = made
                self.other_names.add(t.target.value)
            elif derivative is not None:
                grads = _gradient_targets(t.target, *derivative)
                self._bind(grads, self.gradient_names)
                names: set[str] = set()
                self._bind(t.target, names)
                inner: set[str] = set()
                self._bind(grads, inner)
                self.other_names |= names - inner
            else:
                self._bind(t.target, self.other_names)

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
