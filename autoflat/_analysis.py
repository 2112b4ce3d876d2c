"""Stage 1 of the pipeline: read a step function's source with libcst into a plain value.

`analyse(fn)` parses the function's own (dedented) source and returns a frozen `Analysis`:
its parameters, every `return` of its own scope and the names it returns, which parameters
the body writes into or calls methods on, the free names it reads, unsupported constructs,
and the offset that maps lines of the parsed source back to the user's file.

Nothing here looks at run-time values; the roles stage combines this with them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any, Literal

import libcst as cst
import libcst.metadata as meta

from ._errors import (
    NO_SOURCE,
    RETURNS_DISAGREE,
    UNSUPPORTED,
    UNSUPPORTED_ADVICE,
    AutoflatError,
    where,
)

ParamKind = Literal["positional_only", "positional_or_keyword", "keyword_only"]
ReturnKind = Literal["none", "single", "tuple"]


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of the step function."""

    name: str
    kind: ParamKind
    has_default: bool


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

    def describe(self) -> str:
        if self.kind == "none":
            return f"line {self.line} returns nothing"
        shown = ", ".join(n if n is not None else "<expr>" for n in self.names)
        if self.kind == "tuple":
            return f"line {self.line} returns ({shown})"
        return f"line {self.line} returns {shown}"


@dataclasses.dataclass(frozen=True)
class Unsupported:
    construct: str
    line: int


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the source of a step function says, as a comparable value."""

    name: str
    filename: str
    def_line: int
    body_first_line: int
    body_last_line: int
    params: tuple[Param, ...]
    returns: tuple[Return, ...]
    falls_through: bool
    assigned: frozenset[str]
    assigned_lines: tuple[tuple[str, int], ...]
    method_called: frozenset[str]
    rebound: frozenset[str]
    free_names: frozenset[str]
    all_names: frozenset[str]
    unsupported: tuple[Unsupported, ...]
    line_offset: int
    source: str = dataclasses.field(repr=False)
    # The parsed tree and its function definition, for the code generator; not compared.
    module: cst.Module = dataclasses.field(repr=False, compare=False, hash=False)
    funcdef: cst.FunctionDef = dataclasses.field(repr=False, compare=False, hash=False)
    positions: Any = dataclasses.field(repr=False, compare=False, hash=False)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def where(self) -> str:
        return where(self.filename, self.def_line)

    def user_line(self, parsed_line: int) -> int:
        """The line in the user's file of a line of the parsed (dedented) source."""
        return parsed_line + self.line_offset


def unwrap_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The plain Python function under `functools.wraps`-style and `jax.jit` wrappers."""
    seen = set()
    while True:
        if id(fn) in seen:
            break
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            raise AutoflatError(
                "autoflat.step needs a function defined with `def`, not a functools.partial: "
                "decorate the function itself and pass the bound values as broadcast= or "
                "static_argnames= arguments, or close over them."
            )
        inner = getattr(fn, "__wrapped__", None)
        if inner is None or not callable(inner):
            break
        fn = inner
    return fn


def _code_location(fn: Callable[..., Any]) -> tuple[str, int]:
    code = getattr(fn, "__code__", None)
    if code is None:
        return "<unknown>", 0
    return code.co_filename, code.co_firstlineno


def _read_source(fn: Callable[..., Any]) -> tuple[str, str, int]:
    """(dedented source, file name, first line) of `fn`, or a clear AutoflatError."""
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    filename, line = _code_location(fn)
    if not inspect.isfunction(fn):
        raise AutoflatError(
            NO_SOURCE.format(
                name=name, where=where(filename, line), reason=f"it is a {type(fn).__name__}"
            )
        )
    if fn.__name__ == "<lambda>":
        raise AutoflatError(
            NO_SOURCE.format(name=name, where=where(filename, line), reason="it is a lambda")
        )
    try:
        lines, first = inspect.getsourcelines(fn)
        sourcefile = inspect.getsourcefile(fn) or filename
    except (OSError, TypeError) as e:
        raise AutoflatError(
            NO_SOURCE.format(name=name, where=where(filename, line), reason=str(e))
        ) from None
    return textwrap.dedent("".join(lines)), sourcefile, first


class _Visitor(cst.CSTVisitor):
    """Collects what the function's own scope does; nested defs count only for writes."""

    METADATA_DEPENDENCIES = (meta.PositionProvider,)

    def __init__(self, root: cst.FunctionDef, params: frozenset[str]) -> None:
        self.root = root
        self.params = params
        self.depth = 0  # nesting of function/lambda/class scopes below the root
        self.shadow: list[frozenset[str]] = []
        self.returns: list[tuple[cst.Return, int]] = []
        self.assigned: dict[str, int] = {}
        self.method_called: set[str] = set()
        self.rebound: set[str] = set()
        self.unsupported: list[Unsupported] = []
        self.names: set[str] = set()

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(meta.PositionProvider, node).start.line

    def _visible(self, name: str) -> bool:
        return name in self.params and not any(name in s for s in self.shadow)

    # scopes
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node is self.root:
            if node.asynchronous is not None:
                self.unsupported.append(Unsupported("async", self._line(node)))
            return
        self.depth += 1
        self.shadow.append(frozenset(_param_names(node.params)))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        if original_node is not self.root:
            self.depth -= 1
            self.shadow.pop()

    def visit_Lambda(self, node: cst.Lambda) -> None:
        self.depth += 1
        self.shadow.append(frozenset(_param_names(node.params)))

    def leave_Lambda(self, original_node: cst.Lambda) -> None:
        self.depth -= 1
        self.shadow.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.depth += 1
        self.shadow.append(frozenset())

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.depth -= 1
        self.shadow.pop()

    # own-scope constructs
    def visit_Return(self, node: cst.Return) -> None:
        if self.depth == 0:
            self.returns.append((node, self._line(node)))

    def visit_Yield(self, node: cst.Yield) -> None:
        if self.depth == 0:
            self.unsupported.append(Unsupported("yield", self._line(node)))

    def visit_Await(self, node: cst.Await) -> None:
        if self.depth == 0:
            self.unsupported.append(Unsupported("async", self._line(node)))

    def visit_Global(self, node: cst.Global) -> None:
        if self.depth == 0:
            self.unsupported.append(Unsupported("global", self._line(node)))

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        if self.depth == 0:
            self.unsupported.append(Unsupported("nonlocal", self._line(node)))

    # names, writes and method calls
    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def _target(self, target: cst.BaseExpression, line: int) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                self._target(el.value, line)
        elif isinstance(target, cst.StarredElement):
            self._target(target.value, line)
        elif isinstance(target, (cst.Attribute, cst.Subscript)):
            root = _root_name(target)
            if root is not None and self._visible(root):
                self.assigned.setdefault(root, line)
        elif isinstance(target, cst.Name):
            if self.depth == 0 and target.value in self.params:
                self.rebound.add(target.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._target(t.target, self._line(node))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target, self._line(node))

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target, self._line(node))

    def visit_Del(self, node: cst.Del) -> None:
        self._target(node.target, self._line(node))

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target, self._line(node))

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._target(node.asname.name, self._line(node))

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._target(node.target, self._line(node))

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute):
            root = _root_name(func.value)
            if root is not None and self._visible(root):
                self.method_called.add(root)


def _root_name(node: cst.BaseExpression) -> str | None:
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None


def _param_names(params: cst.Parameters) -> list[str]:
    out = [p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)]
    if isinstance(params.star_arg, cst.Param):
        out.append(params.star_arg.name.value)
    if params.star_kwarg is not None:
        out.append(params.star_kwarg.name.value)
    return out


def _params(fn: Callable[..., Any]) -> tuple[tuple[Param, ...], list[str]]:
    sig = inspect.signature(fn)
    kinds: dict[Any, ParamKind] = {
        inspect.Parameter.POSITIONAL_ONLY: "positional_only",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
        inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    }
    params = []
    variadic = []
    for p in sig.parameters.values():
        if p.kind in kinds:
            params.append(Param(p.name, kinds[p.kind], p.default is not inspect.Parameter.empty))
        else:
            star = "*" if p.kind is inspect.Parameter.VAR_POSITIONAL else "**"
            variadic.append(star + p.name)
    return tuple(params), variadic


def _describe_return(node: cst.Return, line: int) -> Return:
    value = node.value
    if value is None or (isinstance(value, cst.Name) and value.value == "None"):
        return Return(line, "none", ())
    if isinstance(value, cst.Tuple):
        names: list[str | None] = []
        for el in value.elements:
            if isinstance(el, cst.StarredElement):
                names.append(None)
            else:
                names.append(el.value.value if isinstance(el.value, cst.Name) else None)
        return Return(line, "tuple", tuple(names))
    return Return(line, "single", (value.value if isinstance(value, cst.Name) else None,))


def _falls_through(body: cst.BaseSuite) -> bool:
    """Whether control can reach the end of `body` (a conservative, syntactic answer)."""
    if isinstance(body, cst.SimpleStatementSuite):
        return not any(isinstance(s, (cst.Return, cst.Raise)) for s in body.body)
    stmts = body.body
    if not stmts:
        return True
    last = stmts[-1]
    if isinstance(last, cst.SimpleStatementLine):
        return not any(isinstance(s, (cst.Return, cst.Raise)) for s in last.body)
    if isinstance(last, cst.If):
        if last.orelse is None:
            return True
        orelse = last.orelse
        other = orelse.body if isinstance(orelse, cst.Else) else cst.IndentedBlock(body=[orelse])
        return _falls_through(last.body) or _falls_through(other)
    if isinstance(last, cst.With):
        return _falls_through(last.body)
    return True


def analyse(fn: Callable[..., Any]) -> Analysis:
    """Analyse the source of `fn` (unwrapping `functools.wraps`/`jax.jit` wrappers).

    **Arguments:**

    - `fn`: the step function.

    **Returns:**

    An `Analysis` value.

    **Raises:**

    `AutoflatError` if the source cannot be found, uses an unsupported construct, or its
    returns disagree.
    """
    fn = unwrap_function(fn)
    source, filename, first_line = _read_source(fn)
    module = cst.parse_module(source)
    funcdef = next((s for s in module.body if isinstance(s, cst.FunctionDef)), None)
    name = fn.__qualname__
    if funcdef is None:
        raise AutoflatError(
            NO_SOURCE.format(
                name=name,
                where=where(filename, first_line),
                reason="its source does not start with a `def` statement",
            )
        )
    if isinstance(funcdef.body, cst.SimpleStatementSuite):
        # `def f(x): return x`: give the body its own indented line (same statement objects).
        suite = funcdef.body
        block = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=suite.body)])
        new_funcdef = funcdef.with_changes(body=block)
        module = module.with_changes(body=[new_funcdef if s is funcdef else s for s in module.body])
        funcdef = new_funcdef
    params, variadic = _params(fn)
    in_source = [
        p.name.value
        for p in (
            *funcdef.params.posonly_params,
            *funcdef.params.params,
            *funcdef.params.kwonly_params,
        )
    ]
    if funcdef.name.value != fn.__name__ or in_source != [p.name for p in params]:
        raise AutoflatError(
            NO_SOURCE.format(
                name=name,
                where=where(filename, first_line),
                reason="the file on disk no longer matches the function that was imported "
                "(it was edited since): restart or re-import it",
            )
        )
    wrapper = meta.MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(meta.PositionProvider)
    line_offset = first_line - 1
    visitor = _Visitor(funcdef, frozenset(p.name for p in params))
    wrapper.visit(visitor)

    def_line = positions[funcdef.name].start.line + line_offset
    unsupported = list(visitor.unsupported)
    if variadic:
        unsupported.append(Unsupported("varargs", def_line - line_offset))
    if unsupported:
        u = unsupported[0]
        construct = {
            "yield": "`yield`",
            "async": "`async`/`await`",
            "global": "a `global` statement",
            "nonlocal": "a `nonlocal` statement",
            "varargs": f"variadic parameters ({', '.join(variadic)})",
        }[u.construct]
        raise AutoflatError(
            UNSUPPORTED.format(
                name=name,
                where=where(filename, u.line + line_offset),
                construct=construct,
                advice=UNSUPPORTED_ADVICE[u.construct],
            )
        )

    returns = tuple(_describe_return(node, line + line_offset) for node, line in visitor.returns)
    falls = _falls_through(funcdef.body)
    if falls:
        last_line = positions[funcdef].end.line + line_offset
        returns_all = (*returns, Return(last_line, "none", ()))
    else:
        returns_all = returns
    _check_returns(name, where(filename, def_line), returns_all)

    body = funcdef.body
    body_first = positions[body.body[0]].start.line if isinstance(body, cst.IndentedBlock) else 0
    body_last = positions[funcdef].end.line

    # Free names: read somewhere in the function and never bound in it.
    scopes = meta.MetadataWrapper(module).resolve(meta.ScopeProvider)
    free: set[str] = set()
    for scope in {s for s in scopes.values() if s is not None}:
        for access in scope.accesses:
            if not access.referents or all(
                isinstance(a, meta.BuiltinAssignment) for a in access.referents
            ):
                free.add(_access_name(access.node))
    free.discard("")

    return Analysis(
        name=name,
        filename=filename,
        def_line=def_line,
        body_first_line=body_first + line_offset,
        body_last_line=body_last + line_offset,
        params=params,
        returns=returns_all,
        falls_through=falls,
        assigned=frozenset(visitor.assigned),
        assigned_lines=tuple(sorted((k, v + line_offset) for k, v in visitor.assigned.items())),
        method_called=frozenset(visitor.method_called),
        rebound=frozenset(visitor.rebound),
        free_names=frozenset(free),
        all_names=frozenset(visitor.names),
        unsupported=(),
        line_offset=line_offset,
        source=source,
        module=module,
        funcdef=funcdef,
        positions=positions,
    )


def _shape(r: Return) -> tuple[str, int]:
    return r.kind, len(r.names)


def _check_returns(name: str, where_: str, returns: tuple[Return, ...]) -> None:
    """Every return must have the same kind and arity; state names are checked by roles."""
    if not returns:
        return
    first = returns[0]
    for r in returns[1:]:
        if _shape(r) != _shape(first):
            raise AutoflatError(
                RETURNS_DISAGREE.format(
                    name=name, where=where_, first=first.describe(), second=r.describe()
                )
            )


def _access_name(node: cst.CSTNode) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return _access_name(node.value)
    return getattr(node, "value", "") if isinstance(getattr(node, "value", None), str) else ""
