"""Stage 1's one libcst pass over a step function's source (`Visitor`), for `_analysis`.

It collects what the function's own scope does (its `return` statements, and the constructs
refused: `yield`, `async`/`await`, `global`, `nonlocal`), what the body does to the
parameters anywhere in it (writes into them, method calls on them, in-place changes of a dict
or a list, attributes read off them) and every name it uses, and which names of its own scope
hold only gradients (`loss, grads = jax.value_and_grad(f)(params, x)`).
"""

from __future__ import annotations

from collections.abc import Collection

import libcst as cst
import libcst.metadata as meta

from .gradients import bound_names


def _param_nodes(params: cst.Parameters) -> list[cst.Param]:
    nodes = [*params.posonly_params, *params.params, *params.kwonly_params]
    if isinstance(params.star_arg, cst.Param):
        nodes.append(params.star_arg)
    if params.star_kwarg is not None:
        nodes.append(params.star_kwarg)
    return nodes


# Names through which a function may read its own parameters unseen.
_READ_UNSEEN = frozenset(
    {"locals", "vars", "eval", "exec", "_getframe", "currentframe", "f_locals", "__builtins__"}
)

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

# Calls that give back a part of their first argument, or of the object they are called on:
# `getattr(m, "inner").n = ...` and `d.get("inner")["k"] = ...` write into `m` and `d`.
_PART_FUNCTIONS = frozenset({"getattr"})
_PART_METHODS = frozenset({"get", "setdefault"})
# Calls whose items are the items of their arguments, for the target of a `for` loop:
# `for i, layer in enumerate(m.layers)`, `for a, b in zip(m.xs, m.ys)`, `for k, v in d.items()`.
_ITEM_FUNCTIONS = frozenset({"enumerate", "zip", "reversed", "list", "tuple", "iter", "sorted"})
_ITEM_METHODS = frozenset({"values", "items"})


def _base(node: cst.BaseExpression) -> cst.BaseExpression:
    """What an attribute/subscript chain starts from (`m.layers[0].w`: `m`), through
    `getattr(x, ...)`, `x.get(...)` and `x.setdefault(...)`."""
    while True:
        if isinstance(node, (cst.Attribute, cst.Subscript)):
            node = node.value
        elif isinstance(node, cst.Call) and node.args and not node.args[0].star:
            func = node.func
            if isinstance(func, cst.Name) and func.value in _PART_FUNCTIONS:
                node = node.args[0].value
            elif isinstance(func, cst.Attribute) and func.attr.value in _PART_METHODS:
                node = func.value
            else:
                return node
        else:
            return node


def _parts(value: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The expressions a name bound to `value` may hold a part of (`m.inner`; both arms of
    `a if c else b`)."""
    if isinstance(value, cst.IfExp):
        return [*_parts(value.body), *_parts(value.orelse)]
    return [value]


def _items(
    target: cst.BaseExpression, iterable: cst.BaseExpression
) -> list[tuple[cst.BaseExpression, cst.BaseExpression]]:
    """(target, expression whose part it holds) for each part of a `for` loop's target."""
    if isinstance(iterable, cst.Call) and not any(a.star for a in iterable.args):
        func = iterable.func
        args = [a.value for a in iterable.args if a.keyword is None]  # (not `strict=True`)
        elements = (
            [el.value for el in target.elements]
            if isinstance(target, (cst.Tuple, cst.List))
            else None
        )
        if isinstance(func, cst.Name) and func.value in _ITEM_FUNCTIONS and args:
            if func.value == "enumerate":
                if elements is not None and len(elements) == 2:
                    return _items(elements[1], args[0])
                return []
            if func.value == "zip":
                if elements is not None and len(elements) == len(args):
                    return [
                        pair for el, a in zip(elements, args, strict=True) for pair in _items(el, a)
                    ]
                return []
            return _items(target, args[0])
        if isinstance(func, cst.Attribute) and func.attr.value in _ITEM_METHODS and not args:
            if func.attr.value == "items":
                if elements is not None and len(elements) == 2:
                    return [(elements[1], func.value)]
                return []
            return [(target, func.value)]
    return [(target, iterable)]


class Visitor(cst.CSTVisitor):
    """Collects what the function's own scope does, and the writes and method calls on its
    parameters anywhere in it (nested functions included).

    Which binding a name refers to comes from libcst's `ScopeProvider`: a name refers to a
    parameter when that parameter is among the assignments it can see, so a nested
    function's own parameter or local of the same name is not the parameter, and a
    parameter rebound in the body still is (a write after `p = f(p)` may reach the caller's
    object on another path). The scope provider counts `p.x = ...` as a read of `p`, not a
    write: the writes into a parameter are what this visitor looks for.

    A write through a name that holds a part of a parameter at every binding it can see (an
    alias: `q = m.inner; q.n = ...`, `for layer in m.layers: layer.w = ...`, `d2 =
    d["inner"]; d2["k"] = ...`) is a write into that parameter. Aliases are resolved once the
    whole function is seen (`leave_FunctionDef`), so a binding later in a loop counts too.
    """

    METADATA_DEPENDENCIES = (meta.PositionProvider, meta.ScopeProvider)

    def __init__(self, root: cst.FunctionDef) -> None:
        self.root = root
        self.params = frozenset(_param_nodes(root.params))
        self.star_kwarg = root.params.star_kwarg  # `**kwargs`: a dict the call itself owns
        self.scope: meta.Scope | None = None  # the root function's own scope
        self.returns: list[tuple[cst.Return, int]] = []
        self.assigned: dict[str, int] = {}
        self.method_called: set[str] = set()
        self.in_place: dict[str, tuple[str, int]] = {}
        self.removed: dict[str, tuple[str, int]] = {}
        self.attribute_reads: set[tuple[str, str]] = set()
        # Names bound to (a part of) an expression: the binding's node, and the expressions
        # it may hold a part of (`q = m.inner`: `m.inner`); and the writes into a name that
        # is not a parameter, (its node, table, spelling, line), resolved through them.
        self.bound: dict[cst.CSTNode, list[cst.BaseExpression]] = {}
        self.pending: list[tuple[cst.Name, str, str, int]] = []
        self.unsupported: list[tuple[str, int]] = []
        self.names: set[str] = set()
        # The own scope's assignments (targets, value) in order, and how many times each name
        # is bound there: `gradients.Gradients` reads them once the whole body is seen.
        self.assignments: list[tuple[list[cst.BaseExpression], cst.BaseExpression]] = []
        self.bindings: dict[str, int] = {}
        # Per call of the own scope, the parameters among its arguments
        # (`Gradients.differentiated`).
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

    def _count(self, target: cst.BaseExpression | None) -> None:
        for n in bound_names(target):
            self.bindings[n] = self.bindings.get(n, 0) + 1

    def _bound(self, node: cst.CSTNode, target: cst.BaseExpression) -> None:
        """Names bound in the own scope by `target`."""
        if self._own(node):
            self._count(target)

    def _parameter(self, node: cst.BaseExpression) -> str | None:
        """The parameter that the attribute/subscript chain `node` starts from, if any."""
        node = _base(node)
        if not isinstance(node, cst.Name):
            return None
        if any(getattr(a, "node", None) in self.params for a in self._referents(node)):
            return node.value
        return None

    def _referents(self, name: cst.Name) -> Collection[meta.BaseAssignment]:
        """The bindings that the name `name`, where it is read, can see."""
        scope = self.get_metadata(meta.ScopeProvider, name, None)
        if scope is None:
            return ()
        for access in scope.accesses[name]:
            if access.node is name:
                return access.referents
        return ()

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """`target` is bound to `value`, or for a `for` loop to an item of it."""
        if isinstance(target, cst.Name):
            self.bound.setdefault(target, []).extend(_parts(value))
        elif isinstance(target, cst.StarredElement):
            self._bind(target.value, value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            elements = [el.value for el in target.elements]
            if (
                isinstance(value, (cst.Tuple, cst.List))
                and len(value.elements) == len(elements)
                and not any(isinstance(el, cst.StarredElement) for el in value.elements)
                and not any(isinstance(el, cst.StarredElement) for el in elements)
            ):
                for el, v in zip(elements, value.elements, strict=True):
                    self._bind(el, v.value)
            else:
                for el in elements:
                    self._bind(el, value)

    def _write(self, table: str, chain: cst.BaseExpression, spelling: str, line: int) -> None:
        """A write into what `chain` starts from (`table`: "assigned", "in_place" or
        "removed"): into a parameter, or kept to resolve through aliases at the end."""
        param = self._parameter(chain)
        if param is not None:
            if not self._into_own_kwargs(table, chain):
                self._note(table, param, spelling, line)
            return
        base = _base(chain)
        if isinstance(base, cst.Name):
            self.pending.append((base, table, spelling, line))

    def _into_own_kwargs(self, table: str, chain: cst.BaseExpression) -> bool:
        """A write into the dict Python builds for `**kwargs` itself, not into a value in it
        (`kw["x"] = ...`, `kw.pop("rng")`; `kw |= {...}` in `visit_AugAssign`): the call's own
        dict, which the caller never holds (as under `jax.jit`, nothing to write back)."""
        if table == "assigned" and isinstance(chain, cst.Subscript):
            chain = chain.value
        return isinstance(chain, cst.Name) and self._is_star_kwarg(chain)

    def _is_star_kwarg(self, name: cst.Name) -> bool:
        star = self.star_kwarg
        return star is not None and any(
            getattr(a, "node", None) is star for a in self._referents(name)
        )

    def _note(self, table: str, param: str, spelling: str, line: int) -> None:
        if table == "assigned":
            if line < self.assigned.get(param, line + 1):
                self.assigned[param] = line
            return
        found = self.in_place if table == "in_place" else self.removed
        if line < found.get(param, ("", line + 1))[1]:
            found[param] = (spelling, line)

    def _aliased(self, name: cst.Name, seen: set[cst.CSTNode]) -> frozenset[str] | None:
        """The parameters that `name` (read where it is) holds a part of at every binding it
        can see; None where some binding may hold anything else."""
        if name in seen:
            return frozenset()
        seen.add(name)
        referents = self._referents(name)
        if not referents:
            return None
        found: set[str] = set()
        for assignment in referents:
            values = self.bound.get(getattr(assignment, "node", name))
            if values is None:
                return None  # a binding to anything else (a call, a literal, a parameter)
            for value in values:
                base = _base(value)
                if not isinstance(base, cst.Name):
                    return None
                param = self._parameter(base)
                sub = frozenset({param}) if param is not None else self._aliased(base, seen)
                if sub is None:
                    return None
                found |= sub
        return frozenset(found)

    def rebound(self) -> frozenset[str]:
        """The parameters the function's own scope binds again (`p = f(p)`, `p += 1`, `for p
        in ...`): the others come back, where returned by name, as they came in."""
        if self.scope is None:
            return frozenset()
        return frozenset(
            p.name.value for p in self.params if len(self.scope.assignments[p.name.value]) > 1
        )

    def unread(self) -> frozenset[str]:
        """The parameters nothing in the function reads (a nested function's read counts);
        none where it names `locals`, `vars`, `eval`, a frame's locals or the builtins, which
        read names unseen."""
        if self.scope is None or self.names & _READ_UNSEEN:
            return frozenset()
        return frozenset(
            p.name.value
            for p in self.params
            if not any(
                a.references
                for a in self.scope.assignments[p.name.value]
                if getattr(a, "node", None) is p
            )
        )

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        if original_node is not self.root:
            return
        for name, table, spelling, line in self.pending:
            for param in sorted(self._aliased(name, set()) or ()):
                self._note(table, param, spelling, line)

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
            self._write("assigned", target, "", line)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._target(t.target, self._line(node))
            self._bind(t.target, node.value)
        if self._own(node):
            targets: list[cst.BaseExpression] = [t.target for t in node.targets]
            self.assignments.append((targets, node.value))
            for target in targets:
                self._count(target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)
        if node.value is not None:
            self._bind(node.target, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)
        if isinstance(node.target, cst.Name) and self._rebinds_parameter(node.target):
            # `d |= {...}`, `xs += [...]`: a dict or a list changes in place (libcst counts
            # the target as a binding only, not a read of the parameter).
            param = node.target.value
            op = cst.Module([]).code_for_node(node.operator).strip()
            star = self.star_kwarg
            if star is None or star.name.value != param:  # (`kwargs |= {...}`: its own dict)
                self._note("in_place", param, f"{param} {op} ...", self._line(node))

    def _rebinds_parameter(self, name: cst.Name) -> bool:
        """Whether the target `name` of an augmented assignment may be a parameter."""
        scope = self.get_metadata(meta.ScopeProvider, name, None)
        return scope is not None and any(
            getattr(a, "node", None) in self.params for a in scope.assignments[name.value]
        )

    def visit_Del(self, node: cst.Del) -> None:
        targets = node.target.elements if isinstance(node.target, cst.Tuple) else ()
        for target in [el.value for el in targets] or [node.target]:
            if isinstance(target, cst.Subscript):
                spelling = f"del {cst.Module([]).code_for_node(target)}"
                self._write("removed", target, spelling, self._line(node))
            else:
                self._target(target, self._line(node))

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)
        for target, iterable in _items(node.target, node.iter):
            self._bind(target, iterable)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        for target, iterable in _items(node.target, node.iter):
            self._bind(target, iterable)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._target(node.asname.name, self._line(node))
            self._bound(node, node.asname.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._target(node.target, self._line(node))
        self._bound(node, node.target)
        self._bind(node.target, node.value)

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
                self._write("in_place", node.func.value, spelling, self._line(node))
            elif method in _REMOVING_METHODS:
                self._write("removed", node.func.value, spelling, self._line(node))
        elif (
            isinstance(node.func, cst.Name)
            and node.func.value in ("setattr", "delattr")
            and node.args
        ):
            # `setattr(p, name, v)` writes into `p` as `p.x = v` does.
            self._write("assigned", node.args[0].value, "", self._line(node))
