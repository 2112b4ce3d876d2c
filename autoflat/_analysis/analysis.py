"""Stage 1: what a step function's source says, read with libcst into a plain `Analysis` value.

`analyse(fn)` parses the function's own (dedented) source and returns its parameters, every
`return` of its own scope and the names it returns, which parameters the body writes into or
calls methods on, the names it reads from outside, and the offset that maps lines of the
parsed source back to the user's file; or it raises a `SourceError` for source it cannot use.
This module owns the `Analysis` value, reading the parameters, describing the returns (and
whether the body falls through), the free names and the constructs refused; the one libcst
pass that collects what the body does is `visitor.Visitor`'s. `analyse` is a few steps: parse
(`_parse`), check the source is still the function's (`_check_unchanged`), annotate
(`_annotate`: that pass, positions and scopes), refuse constructs (`_check_supported`),
describe the returns (`_returns`) and assemble the value (`_analysis`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

import libcst as cst
import libcst.metadata as meta

from .._errors import (
    NO_SOURCE,
    RETURNS_DISAGREE,
    UNSUPPORTED,
    UNSUPPORTED_ADVICE,
    Located,
    Location,
    SourceError,
    error,
    where,
)
from .gradients import Gradients
from .returns import Return as Return
from .returns import flat_elements, nest_of
from .source import matches_code, read_source, unwrap_function
from .visitor import Visitor

ParamKind = Literal[
    "positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"
]


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of the step function."""

    name: str
    kind: ParamKind
    has_default: bool


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the source of a step function says, as a comparable value.

    `name` is the function's `__qualname__`, the name every message uses. `returns` includes
    the implicit `return None` of a body that can fall off its end (`falls_through`).
    `assigned` holds the parameters the body (or a nested function) writes into
    (`p.x = ...`, `p[k] = ...`, `del p.x`), `method_called` those it calls a method on.
    """

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
    # Parameters changed in place by a spelling that mutates a dict or a list but not other
    # values (`d.update(...)`, `xs.append(x)`, `d |= ...`): (param, spelling, line). The
    # first call's types decide (`_infer`): state written back, as `d[k] = ...`.
    in_place: tuple[tuple[str, str, int], ...]
    # Parameters only taken from in place (`batch.pop("labels")`, `del d[k]`), with neither a
    # change above nor a write into them: (param, spelling, line). Such a dict or list is not
    # state (the next step would miss what was taken); the step changes its own copy, as under
    # `jax.jit`, and the caller's object is left as it was.
    removed: tuple[tuple[str, str, int], ...]
    # Parameters the body binds again (`p = f(p)`): one never rebound, returned by name,
    # comes back as it came in.
    rebound: frozenset[str]
    # Parameters nothing in the body reads (`step` passed and never used).
    unread: frozenset[str]
    # Attributes read directly off each parameter (`self.lr`): (param, attribute), sorted.
    attribute_reads: tuple[tuple[str, str], ...]
    free_names: frozenset[str]
    all_names: frozenset[str]
    line_offset: int
    # For the code generator; not compared: the function definition, the `return` statements
    # of its own scope (the nodes behind `returns`) and the positions of every node.
    funcdef: cst.FunctionDef = dataclasses.field(repr=False, compare=False)
    return_nodes: frozenset[cst.Return] = dataclasses.field(repr=False, compare=False)
    positions: Mapping[cst.CSTNode, meta.CodeRange] = dataclasses.field(repr=False, compare=False)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def variadic(self) -> frozenset[str]:
        """`*args` and `**kwargs`, by name."""
        return frozenset(p.name for p in self.params if p.kind.startswith("var_"))

    @property
    def where(self) -> str:
        return where(self.filename, self.def_line)

    def user_line(self, parsed_line: int) -> int:
        """The line in the user's file of a line of the parsed (dedented) source."""
        return parsed_line + self.line_offset


_KINDS: dict[Any, ParamKind] = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def _params(fn: Callable[..., Any]) -> tuple[Param, ...]:
    """The parameters of `fn` in order. A variadic one (`*args`, `**kwargs`) is one parameter
    whose value is what Python binds to it, the tuple or dict of the call's extra arguments
    (empty by default)."""
    return tuple(
        Param(
            p.name,
            _KINDS[p.kind],
            p.default is not inspect.Parameter.empty
            or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD),
        )
        for p in inspect.signature(fn).parameters.values()
    )


def _describe_return(
    node: cst.Return, line: int, visitor: Visitor, nest: tuple[Any, ...] | None = None
) -> Return:
    value = node.value
    if value is None or (isinstance(value, cst.Name) and value.value == "None"):
        return Return(line, "none", ())
    reading = Gradients(visitor.assignments, visitor.bindings, visitor.takes)
    gradients, updated = reading.of_names(), reading.updates()

    def gradient_of(el: cst.BaseExpression) -> frozenset[str] | None:
        """The parameters `el` holds gradients at, if it holds gradients."""
        if isinstance(el, cst.Name):
            return gradients.get(el.value)
        if isinstance(el, cst.Call) and reading.derivative(el) == (False, False):
            return reading.differentiated(el)  # `jax.grad(f)(params, x)`
        return None

    if isinstance(value, cst.Tuple):
        names: list[str | None] = []
        grads, updates = [], []
        for i, el in enumerate(flat_elements(value, nest)):
            if el is None:
                names.append(None)
            else:
                names.append(el.value if isinstance(el, cst.Name) else None)
                of = gradient_of(el)
                if of:
                    grads.append((i, tuple(sorted(of))))
                if isinstance(el, cst.Name) and el.value in updated:
                    at, by = updated[el.value]
                    updates.append((i, tuple(sorted(at)), tuple(sorted(by))))
        return Return(
            line, "tuple", tuple(names), gradients=tuple(grads), updates=tuple(updates), nest=nest
        )
    of = gradient_of(value)
    up = updated.get(value.value) if isinstance(value, cst.Name) else None
    single = ((0, tuple(sorted(up[0])), tuple(sorted(up[1]))),) if up else ()
    return Return(
        line,
        "single",
        (value.value if isinstance(value, cst.Name) else None,),
        gradients=((0, tuple(sorted(of))),) if of else (),
        updates=single,
        derivative=isinstance(value, cst.Call) and reading.derivative(value) is not None,
    )


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
    if isinstance(last, (cst.Try, cst.TryStar)):
        if last.finalbody is not None and not _falls_through(last.finalbody.body):
            return False  # the `finally` returns or raises
        tail = last.orelse.body if last.orelse is not None else last.body
        # Reached after the `try` body (through `else`, if any) or after any handler.
        return _falls_through(tail) or any(_falls_through(h.body) for h in last.handlers)
    if isinstance(last, cst.While):
        forever = isinstance(last.test, cst.Name) and last.test.value == "True"
        return not forever or _breaks(last.body)
    if isinstance(last, cst.Match):
        exhaustive = any(
            isinstance(c.pattern, cst.MatchAs) and c.pattern.pattern is None and c.guard is None
            for c in last.cases
        )
        return not exhaustive or any(_falls_through(c.body) for c in last.cases)
    return True


def _breaks(body: cst.BaseSuite) -> bool:
    """Whether a loop body has a `break` of its own loop (not of a nested one)."""
    found = False

    class Finder(cst.CSTVisitor):
        def visit_Break(self, node: cst.Break) -> None:
            nonlocal found
            found = True

        def visit_For(self, node: cst.For) -> bool:
            return False  # a nested loop's `break` is its own

        def visit_While(self, node: cst.While) -> bool:
            return False

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return False

    body.visit(Finder())
    return found


_CONSTRUCTS = {
    "yield": "`yield`",
    "async": "`async`/`await`",
    "global": "a `global` statement",
    "nonlocal": "a `nonlocal` statement",
    "starred": "a starred element in a `return` (`return p, *extras`)",
}


def analyse(fn: Callable[..., Any]) -> Analysis:
    """Analyse the source of `fn` (under a `jax.jit` or `eqx.filter_jit` wrapper, if any).

    **Arguments:**

    - `fn`: the step function.

    **Returns:**

    An `Analysis` value.

    **Raises:**

    `SourceError` if the source cannot be found or no longer matches the function, uses an
    unsupported construct, or its returns disagree in shape.
    """
    fn = unwrap_function(fn)
    source, filename, first_line = read_source(fn)
    at = Location(fn.__qualname__, where(filename, first_line))
    module, funcdef = _parse(source, at)
    params = _params(fn)
    _check_unchanged(fn, source, funcdef, params, at)
    code = _annotate(fn.__qualname__, filename, first_line - 1, module, funcdef)
    _check_supported(code)
    returns = _returns(code, params)
    return _analysis(code, params, returns)


def _parse(source: str, at: Location) -> tuple[cst.Module, cst.FunctionDef]:
    """The parsed source and the function definition it starts with, its body on lines of
    its own."""
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as e:
        raise error(SourceError, NO_SOURCE, at, reason=f"libcst cannot parse it ({e})") from None
    funcdef = next((s for s in module.body if isinstance(s, cst.FunctionDef)), None)
    if funcdef is None:
        raise error(
            SourceError, NO_SOURCE, at, reason="its source does not start with a `def` statement"
        )
    if isinstance(funcdef.body, cst.SimpleStatementSuite):
        # `def f(x): return x`: give the body its own indented line (same statement objects).
        suite = funcdef.body
        block = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=suite.body)])
        new_funcdef = funcdef.with_changes(body=block)
        module = module.with_changes(body=[new_funcdef if s is funcdef else s for s in module.body])
        funcdef = new_funcdef
    return module, funcdef


def _check_unchanged(
    fn: Callable[..., Any],
    source: str,
    funcdef: cst.FunctionDef,
    params: tuple[Param, ...],
    at: Location,
) -> None:
    """Raise a `SourceError` if the source on disk is no longer that of the function."""
    fp = funcdef.params
    star = [fp.star_arg] if isinstance(fp.star_arg, cst.Param) else []
    star_kwarg = [fp.star_kwarg] if fp.star_kwarg is not None else []
    in_source = [
        p.name.value
        for p in (*fp.posonly_params, *fp.params, *star, *fp.kwonly_params, *star_kwarg)
    ]
    if (
        funcdef.name.value != fn.__code__.co_name
        or in_source != [p.name for p in params]
        or matches_code(fn, source) is False
    ):
        raise error(
            SourceError,
            NO_SOURCE,
            at,
            reason="the file on disk no longer matches the function that was imported "
            "(it was edited since): restart or re-import it",
        )


@dataclasses.dataclass(frozen=True)
class _Annotated:
    """The parsed function, annotated: what the `Visitor` pass collected, the position and
    scope of every node, and how lines of the parsed source map to the user's file."""

    name: str
    filename: str
    line_offset: int
    funcdef: cst.FunctionDef
    visitor: Visitor
    positions: Mapping[cst.CSTNode, meta.CodeRange]
    scopes: Mapping[cst.CSTNode, meta.Scope | None]

    @property
    def def_line(self) -> int:
        return self.positions[self.funcdef.name].start.line + self.line_offset

    @functools.cached_property
    def falls_through(self) -> bool:
        return _falls_through(self.funcdef.body)

    @property
    def body_last_line(self) -> int:
        return self.positions[self.funcdef].end.line + self.line_offset

    def at(self, line: int) -> Location:
        """The function, at a line of the user's file."""
        return Location(self.name, where(self.filename, line))


def _annotate(
    name: str, filename: str, line_offset: int, module: cst.Module, funcdef: cst.FunctionDef
) -> _Annotated:
    """One `Visitor` pass over the function, and the positions and scopes of every node."""
    wrapper = meta.MetadataWrapper(module, unsafe_skip_copy=True)
    visitor = Visitor(funcdef)
    wrapper.visit(visitor)
    positions = wrapper.resolve(meta.PositionProvider)
    scopes = wrapper.resolve(meta.ScopeProvider)
    return _Annotated(name, filename, line_offset, funcdef, visitor, positions, scopes)


def _check_supported(code: _Annotated) -> None:
    """Raise a `SourceError` at the first construct the generated code cannot hold."""
    offset = code.line_offset
    unsupported = [(c, line + offset) for c, line in code.visitor.unsupported]
    unsupported += [
        ("starred", line + offset)
        for node, line in code.visitor.returns
        if isinstance(node.value, cst.Tuple)
        and any(isinstance(el, cst.StarredElement) for el in node.value.elements)
    ]
    if unsupported:
        construct, line = unsupported[0]
        raise error(
            SourceError,
            UNSUPPORTED,
            code.at(line),
            construct=_CONSTRUCTS[construct],
            advice=UNSUPPORTED_ADVICE[construct],
        )


def _returns(code: _Annotated, params: tuple[Param, ...]) -> tuple[Return, ...]:
    """Every return of the function's own scope, and the implicit `return None` of a body
    that can fall off its end, checked to agree in shape."""
    tuples = [node.value for node, _ in code.visitor.returns if isinstance(node.value, cst.Tuple)]
    nest = nest_of(tuples, frozenset(p.name for p in params))
    returns = tuple(
        _describe_return(node, line + code.line_offset, code.visitor, nest)
        for node, line in code.visitor.returns
    )
    if code.falls_through:
        returns = (*returns, Return(code.body_last_line, "none", ()))
    _check_returns(code.at(code.def_line), returns)
    return returns


def _free_names(code: _Annotated) -> frozenset[str]:
    """Names read somewhere in the source and bound nowhere in it (builtins included).

    The step's own name counts as free: the parsed source binds it, but at run time the body
    reads it from the user's module (a recursive call, the step decorated there).
    """
    free: set[str] = set()
    for scope in {s for s in code.scopes.values() if s is not None}:
        for access in scope.accesses:
            if all(
                isinstance(a, meta.BuiltinAssignment) or getattr(a, "node", None) is code.funcdef
                for a in access.referents
            ):
                free.add(_access_name(access.node))
    free.discard("")
    return frozenset(free)


def _analysis(code: _Annotated, params: tuple[Param, ...], returns: tuple[Return, ...]) -> Analysis:
    """The `Analysis` value, its lines those of the user's file."""
    visitor, offset = code.visitor, code.line_offset
    body = code.funcdef.body
    body_first = (
        code.positions[body.body[0]].start.line if isinstance(body, cst.IndentedBlock) else 0
    )
    return Analysis(
        name=code.name,
        filename=code.filename,
        def_line=code.def_line,
        body_first_line=body_first + offset,
        body_last_line=code.body_last_line,
        params=params,
        returns=returns,
        falls_through=code.falls_through,
        assigned=frozenset(visitor.assigned),
        assigned_lines=tuple(sorted((k, v + offset) for k, v in visitor.assigned.items())),
        method_called=frozenset(visitor.method_called),
        in_place=tuple(
            (p, spelling, line + offset) for p, (spelling, line) in sorted(visitor.in_place.items())
        ),
        removed=tuple(
            (p, spelling, line + offset)
            for p, (spelling, line) in sorted(visitor.removed.items())
            if p not in visitor.in_place and p not in visitor.assigned
        ),
        rebound=visitor.rebound(),
        unread=visitor.unread(),
        attribute_reads=tuple(sorted(visitor.attribute_reads)),
        free_names=_free_names(code),
        all_names=frozenset(visitor.names),
        line_offset=offset,
        funcdef=code.funcdef,
        return_nodes=frozenset(node for node, _ in visitor.returns),
        positions=code.positions,
    )


def _shape(r: Return) -> tuple[str, int]:
    return r.kind, len(r.names)


def _check_returns(fn: Located, returns: tuple[Return, ...]) -> None:
    """Every return must have the same kind and arity; state names are checked by roles."""
    if not returns:
        return
    first = returns[0]
    for r in returns[1:]:
        if _shape(r) != _shape(first):
            raise error(
                SourceError, RETURNS_DISAGREE, fn, first=first.describe(), second=r.describe()
            )


def _access_name(node: cst.CSTNode) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return _access_name(node.value)
    return getattr(node, "value", "") if isinstance(getattr(node, "value", None), str) else ""
