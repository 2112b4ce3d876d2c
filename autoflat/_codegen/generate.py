"""Stage 3: the source of the flattened, k-step version of a step function, as a value.

`generate` fills libcst templates with the names it picks and splices in the user's body
unchanged (comments and formatting kept), every `return` of its own scope rewritten to
`(new state leaves), (outputs)`. The result is one module defining a factory whose parameters
are everything that enters the code from outside (autoflat's helpers, then the user's closure
variables), and a line map from the generated lines back to the user's. Its steps: pick the
names (`_pick_names`), rewrite the body (`_body`), bind the parameters (`_binds`), write the
header (`_header`) and fill the template (`_module`).
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import libcst as cst
import libcst.matchers as m
import libcst.metadata as meta
from libcst.helpers import (
    parse_template_expression,
    parse_template_module,
    parse_template_statement,
)

from .._analysis.analysis import Analysis
from .._analysis.returns import flat_elements, nested, written
from .._errors import where
from .._roles.roles import Roles

HELPERS = ("unflatten", "flatten", "scan")


@dataclasses.dataclass(frozen=True)
class GeneratedCode:
    """Generated source as a value: what `show()` prints is exactly what is compiled.

    - `source`: the module text.
    - `factory`: the name of the factory function it defines; its parameters are the helpers
      (in `HELPERS` order), then the user's closure variables.
    - `function`: the name of the generated step function inside the factory.
    - `helpers`: maps each helper role (`"flatten"`, ...) to its name in the source.
    - `line_map`: (generated line, user line) pairs for the lines of the user's body.
    """

    source: str
    factory: str
    function: str
    helpers: Mapping[str, str]
    line_map: tuple[tuple[int, int], ...]

    def user_line(self, generated_line: int) -> int | None:
        for g, u in self.line_map:
            if g == generated_line:
                return u
        return None


class Namer:
    """Fresh names that avoid the user's names, adding `_1`, `_2` on collision."""

    def __init__(self, taken: Iterable[str]) -> None:
        self.taken = set(taken) | set(dir(builtins))

    def __call__(self, base: str) -> str:
        name = base
        i = 0
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name


class _BodyMarker(cst.CSTTransformer):
    """Replaces the marker statement of a template by the user's statements, as the same
    objects (a template replacement would copy them), so that their positions in the
    generated module can be looked up for the line map."""

    def __init__(self, marker: str, statements: list[cst.BaseStatement]) -> None:
        self.marker = marker
        self.statements = statements

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> Any:
        stmt = updated_node.body[0] if updated_node.body else None
        if (
            isinstance(stmt, cst.Expr)
            and isinstance(stmt.value, cst.Name)
            and stmt.value.value == self.marker
        ):
            return cst.FlattenSentinel(self.statements)
        return updated_node


class _SuperRewriter(cst.CSTTransformer):
    """`super()` -> `super(__class__, self)` in the function's own body (a nested function's
    `super()` is its own business)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.depth = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.depth += 1
        return self.depth == 1

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self.depth -= 1
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = updated_node.func
        if isinstance(func, cst.Name) and func.value == "super" and not updated_node.args:
            return updated_node.with_changes(
                args=[
                    cst.Arg(
                        cst.Name("__class__"),
                        comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
                    ),
                    cst.Arg(cst.Name(self.instance)),
                ]
            )
        return updated_node


class _ReturnRewriter(cst.CSTTransformer):
    """Rewrites the function's own `return` statements (those the analysis found; a nested
    function's are left alone) and records where each new statement came from."""

    def __init__(
        self, returns: frozenset[cst.Return], make_return: Callable[[cst.Return], cst.Return]
    ) -> None:
        self.returns = returns
        self.make_return = make_return
        self.origin: dict[cst.CSTNode, cst.CSTNode] = {}

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> Any:
        if original_node in self.returns:
            return self.make_return(original_node)
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> Any:
        # A line that was only `return f(...)`, now `names = f(...); return ...`: two lines.
        body = updated_node.body
        if len(original_node.body) == 1 and len(body) == 2 and isinstance(body[1], cst.Return):
            first = cst.SimpleStatementLine(
                [body[0].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)],
                leading_lines=updated_node.leading_lines,
            )
            second = cst.SimpleStatementLine(
                [body[1]], trailing_whitespace=updated_node.trailing_whitespace
            )
            self.origin[first] = self.origin[second] = original_node
            return cst.FlattenSentinel([first, second])
        return updated_node

    def on_leave(self, original_node: cst.CSTNode, updated_node: Any) -> Any:
        result = super().on_leave(original_node, updated_node)
        if isinstance(result, (cst.BaseStatement, cst.BaseSmallStatement)) and isinstance(
            original_node, (cst.BaseStatement, cst.BaseSmallStatement)
        ):
            self.origin[result] = original_node
        return result


def _elements(
    value: cst.BaseExpression | None, nest: tuple[Any, ...] | None
) -> list[cst.BaseExpression]:
    """The expressions a `return` writes at its positions (looking into the tuples `nest`
    marks)."""
    if value is None:
        return []
    if isinstance(value, cst.Name) and value.value == "None":
        return []
    if isinstance(value, cst.Tuple):
        return [el for el in flat_elements(value, nest) if el is not None]  # no `*xs`: refused
    return [value]


def _is_docstring(statement: cst.BaseStatement) -> bool:
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return False
    expr = statement.body[0]
    return isinstance(expr, cst.Expr) and isinstance(
        expr.value, (cst.SimpleString, cst.ConcatenatedString)
    )


def _tuple(items: list[cst.BaseExpression]) -> cst.Tuple:
    """A parenthesized tuple; one element gets its trailing comma."""
    if len(items) == 1:
        return cst.Tuple(elements=[cst.Element(items[0], comma=cst.Comma())])
    return cst.Tuple(elements=[cst.Element(v) for v in items])


def _comment_lines(texts: Iterable[str]) -> list[cst.EmptyLine]:
    """Comment lines; a line break inside a text (a `__qualname__` set by hand, a reason that
    quotes a value) is shown escaped, so the comment stays one line."""
    return [
        cst.EmptyLine(indent=True, comment=cst.Comment(f"# {_one_line(t)}" if t else "#"))
        for t in texts
    ]


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


# The statements and expressions generated code is made of; `{...}` are libcst placeholders.
_BIND_UNFLATTEN = "{param} = {unflatten}({source}[{index}])"
_BIND_INDEX = "{param} = {source}[{index}]"
_BIND_STATIC = "{param} = {spec}.static[{key}]"
_FLATTEN = "{flatten}({spec}, {index}, {value})"
_RETURN = "return {state}, {outputs}"

_SCAN_TEMPLATE = """\
def {factory}({params}):
    def {function}({spec}, {state}, {xs}, {broadcast}):
        def {step}({carry}, {x}):
            {body}
        return {scan}({step}, {spec}, {state}, {xs})
    return {function}
"""

_PLAIN_TEMPLATE = """\
def {factory}({params}):
    def {function}({spec}, {state}, {xs}, {broadcast}):
        {body}
    return {function}
"""


@dataclasses.dataclass(frozen=True)
class _Names:
    """Every name the generated code introduces, picked by one `Namer` (see `_pick_names`)."""

    helpers: dict[str, str]  # helper role (`"flatten"`, ...) -> its name
    spec: str
    state: str
    xs: str
    broadcast: str
    carry: str  # the scan's carry and per-step slice (`num_steps > 1`)
    x: str
    marker: str  # the template's placeholder statement for the body
    factory: str
    function: str
    step: str
    unpacked: tuple[str, ...]  # what a `return f(...)` is unpacked into (layout `unpacked`)
    bound: tuple[str, ...]  # what a `return`'s calls are bound to before state is flattened


def generate(
    analysis: Analysis,
    roles: Roles,
    num_steps: int,
    user_globals: Mapping[str, Any],
    freevars: tuple[str, ...],
    index: int = 0,
) -> GeneratedCode:
    """Generate the flattened k-step version of the analysed function.

    **Arguments:**

    - `analysis`: the function's `Analysis`.
    - `roles`: the `Roles` of its parameters.
    - `num_steps`: steps per call (1 generates no scan).
    - `user_globals`: the function's globals (generated names avoid them).
    - `freevars`: the function's closure variable names, in `__code__.co_freevars` order.
    - `index`: unused (the file name, made by the loader, tells programs apart); accepted
      so callers need not change.

    **Returns:**

    A `GeneratedCode` value.
    """
    names = _pick_names(analysis, roles, user_globals, freevars)
    scanning = num_steps > 1
    body, origin = _body(analysis, roles, names, freevars)
    statements = [*_binds(roles, names, scanning), *body]
    header = _header(analysis, roles, num_steps)
    module = _module(names, freevars, scanning, statements, header)
    return GeneratedCode(
        source=module.code,
        factory=names.factory,
        function=names.function,
        helpers=names.helpers,
        line_map=_line_map(module, origin, analysis),
    )


def _pick_names(
    analysis: Analysis, roles: Roles, user_globals: Mapping[str, Any], freevars: tuple[str, ...]
) -> _Names:
    """The generated names, in a fixed order (so they are deterministic), none of them one
    the user's code could mean."""
    name = analysis.funcdef.name.value
    namer = Namer(
        analysis.all_names
        | set(analysis.param_names)
        | set(user_globals)
        | set(freevars)
        | analysis.free_names
        | {name}
    )
    helpers = {h: namer(f"_af_{h}") for h in HELPERS}
    if roles.layout.keys:
        helpers["items"] = namer("_af_items")  # a dict's values by the first call's keys
    spec, state, xs, broadcast = (
        namer(n) for n in ("_af_spec", "_af_state", "_af_xs", "_af_broadcast")
    )
    carry, x, marker = namer("_af_carry"), namer("_af_x"), namer("_af_body")
    factory = namer(f"_autoflat_{name}")
    # The generated function keeps the step's name, unless the body reads that name (a call of
    # the module-level function or step): then it must not be shadowed by the generated one.
    function = namer(name) if name in analysis.free_names else name
    step = namer(f"{name}_step")
    rets = max(len(roles.layout.entries), 1)
    unpacked: tuple[str, ...] = ()
    if roles.layout.kind == "unpacked":
        unpacked = tuple(namer(f"_af_ret{i}") for i in range(rets))
    bound = unpacked
    if roles.state and not bound:
        bound = tuple(namer(f"_af_ret{i}") for i in range(rets))
    return _Names(
        helpers=helpers,
        spec=spec,
        state=state,
        xs=xs,
        broadcast=broadcast,
        carry=carry,
        x=x,
        marker=marker,
        factory=factory,
        function=function,
        step=step,
        unpacked=unpacked,
        bound=bound,
    )


def _body(
    analysis: Analysis, roles: Roles, names: _Names, freevars: tuple[str, ...]
) -> tuple[list[cst.BaseStatement], Mapping[cst.CSTNode, cst.CSTNode]]:
    """The user's statements, their own returns rewritten, under a comment naming where they
    come from; and the user's statement behind each new one (for the line map)."""
    # A nested function that rebinds the step's names (`nonlocal`) may change what a bare name
    # beside a call in a `return` reads.
    rebinds = bool(m.findall(analysis.funcdef, m.Nonlocal()))
    make_return = functools.partial(_new_return, roles, names, rebinds)
    rewriter = _ReturnRewriter(analysis.return_nodes, make_return)
    new_func = cst.ensure_type(analysis.funcdef.visit(rewriter), cst.FunctionDef)
    if "__class__" in freevars and analysis.param_names:
        # Zero-argument `super()` in a method: the generated function is not the method, so
        # name its class (the method's own `__class__` cell) and instance explicitly.
        new_func = cst.ensure_type(
            new_func.visit(_SuperRewriter(analysis.param_names[0])), cst.FunctionDef
        )
    statements = list(cst.ensure_type(new_func.body, cst.IndentedBlock).body)
    if statements and _is_docstring(statements[0]):
        statements = statements[1:]  # the docstring documents the step, it does not run
    if analysis.falls_through:
        statements.append(cst.SimpleStatementLine(body=[make_return(None)]))
    label = (
        f"body of {analysis.funcdef.name.value} "
        f"({where(_short(analysis.filename), analysis.body_first_line)}"
        f"-{analysis.body_last_line})"
    )
    first: Any = statements[0]
    statements[0] = first.with_changes(
        leading_lines=[*_comment_lines([label]), *first.leading_lines]
    )
    if first in rewriter.origin:  # (a rewritten `return` first: its line maps to the user's)
        rewriter.origin[statements[0]] = rewriter.origin[first]
    return statements, rewriter.origin


def _new_return(roles: Roles, names: _Names, rebinds: bool, node: cst.Return | None) -> Any:
    """What one of the function's own `return`s becomes (None: falling off its end).

    `return f(...)` whose value is a tuple with state among its items is unpacked into names
    first (`_af_ret0, _af_ret1 = f(...); return ...`), a tuple of another length raising; a
    dict goes through `_af_items(..., keys)`, which checks its keys.
    """
    if names.unpacked and node is not None and node.value is not None:
        targets = [cst.Name(n) for n in names.unpacked]
        value = node.value
        if roles.layout.keys:
            keys = cst.parse_expression(repr(tuple(roles.layout.keys)))
            value = cst.Call(cst.Name(names.helpers["items"]), [cst.Arg(value), cst.Arg(keys)])
        unpack = cst.Assign(
            targets=[cst.AssignTarget(cst.Tuple([cst.Element(n) for n in targets], [], []))],
            value=value,
            semicolon=cst.Semicolon(whitespace_after=cst.SimpleWhitespace(" ")),
        )
        return cst.FlattenSentinel([unpack, _assemble(roles, names, list(targets), node)])
    returned = node.value if node is not None else None
    elements: list[cst.BaseExpression]
    if roles.layout.whole and isinstance(returned, cst.Tuple):  # `return a, b` as one value
        elements = [returned.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])]
    else:
        elements = _elements(returned, roles.layout.nest)
    calls = [i for i, e in enumerate(elements) if m.findall(e, _CALL)]
    if not calls or len(elements) > len(names.bound):
        return _assemble(roles, names, elements, node)
    # A call may change state in place (`return train(model, optimizer, x)`, an NNX module
    # whose Variables it updates): the `return`'s expressions up to its last call run first,
    # in the order written, and state is flattened after them, as `jax.jit` flattens what the
    # function returned. A bare name among them reads the same object after them, unless a
    # `:=` or a nested function's `nonlocal` could rebind it; what follows the last call reads
    # what the calls left, as written.
    rebinds = rebinds or any(m.findall(e, m.NamedExpr()) for e in elements)
    first = [
        i for i, e in enumerate(elements[: calls[-1] + 1]) if rebinds or not isinstance(e, cst.Name)
    ]
    temps = [cst.Name(names.bound[i]) for i in first]
    target: cst.BaseAssignTargetExpression = temps[0]
    value = elements[first[0]]
    if len(first) > 1:
        target, value = _bare(_tuple(list(temps))), _bare(_tuple([elements[i] for i in first]))
    bind = cst.Assign(
        targets=[cst.AssignTarget(target)],
        value=value,
        semicolon=cst.Semicolon(whitespace_after=cst.SimpleWhitespace(" ")),
    )
    bound = dict(zip(first, temps, strict=True))
    after = [bound.get(i, e) for i, e in enumerate(elements)]
    return cst.FlattenSentinel([bind, _assemble(roles, names, after, node)])


_CALL = m.Call() | m.NamedExpr() | m.Await() | m.Yield()


def _bare(t: cst.Tuple) -> cst.Tuple:
    """A tuple without its parentheses (`a, b = ...`)."""
    return t.with_changes(lpar=[], rpar=[])


def _assemble(
    roles: Roles, names: _Names, elements: list[cst.BaseExpression], node: cst.Return | None
) -> cst.Return:
    """`return (flattened state), (outputs)` from the elements the user returned."""
    entries = roles.layout.entries
    state = roles.state
    returned_at = {state[i]: pos for pos, (kind, i) in enumerate(entries) if kind == "state"}
    flats = [
        parse_template_expression(
            _FLATTEN,
            flatten=cst.Name(names.helpers["flatten"]),
            spec=cst.Name(names.spec),
            index=cst.Integer(str(i)),
            value=elements[returned_at[p]] if p in returned_at else cst.Name(p),
        )
        for i, p in enumerate(state)
    ]
    out_positions = [pos for pos, (kind, _) in enumerate(entries) if kind == "out"]
    outs = [elements[pos] for pos in out_positions] if elements else []
    line = parse_template_statement(_RETURN, state=_tuple(flats), outputs=_tuple(outs))
    new = cst.ensure_type(cst.ensure_type(line, cst.SimpleStatementLine).body[0], cst.Return)
    return new if node is None else new.with_changes(semicolon=node.semicolon)


def _binds(roles: Roles, names: _Names, scanning: bool) -> list[cst.BaseStatement]:
    """One statement per parameter, at the top of the step, binding it to what it takes."""
    binds = [
        _bind(p, role, roles, names, scanning)
        for p, role in zip(roles.params, roles.roles, strict=True)
    ]
    if binds:
        label = (
            "unflatten state and bind this step's inputs"
            if scanning
            else "unflatten state and bind inputs"
        )
        binds[0] = binds[0].with_changes(leading_lines=_comment_lines([label]))
    return binds


def _bind(param: str, role: str, roles: Roles, names: _Names, scanning: bool) -> cst.BaseStatement:
    target = cst.Name(param)
    if role == "scanned":
        return parse_template_statement(
            _BIND_INDEX,
            param=target,
            source=cst.Name(names.x if scanning else names.xs),
            index=cst.Integer(str(roles.of("scanned").index(param))),
        )
    if role == "state":
        source, index = (names.carry if scanning else names.state), roles.state.index(param)
    elif role == "broadcast":
        source, index = names.broadcast, roles.of("broadcast").index(param)
    else:
        return parse_template_statement(
            _BIND_STATIC,
            param=target,
            spec=cst.Name(names.spec),
            key=cst.SimpleString(repr(param)),
        )
    return parse_template_statement(
        _BIND_UNFLATTEN,
        param=target,
        unflatten=cst.Name(names.helpers["unflatten"]),
        source=cst.Name(source),
        index=cst.Integer(str(index)),
    )


def _header(analysis: Analysis, roles: Roles, num_steps: int) -> list[str]:
    """The header comment's lines: the source function, `num_steps`, every parameter's role
    with its evidence (`*args`, `**kwargs` as written: one role each), and what each
    returned position is."""
    stars = {"var_positional": "*", "var_keyword": "**"}
    written_as = {p.name: stars.get(p.kind, "") + p.name for p in analysis.params}
    header = [
        f"autoflat: generated from `{analysis.name}` at "
        f"{where(_short(analysis.filename), analysis.def_line)}",
        f"num_steps: {num_steps}",
        *(f"{written_as[p]}: {e}" for p, e in zip(roles.params, roles.evidence, strict=True)),
    ]
    layout = roles.layout
    if layout.kind != "none":
        output = "output (stacked)" if num_steps > 1 else "output"
        shown = [
            f"state {roles.state[i]}" if kind == "state" else output for kind, i in layout.entries
        ]
        if layout.keys:
            shown = [f"{k!r}: {v}" for k, v in zip(layout.keys, shown, strict=True)]
        text = written(nested(layout.nest, shown)) if layout.nest else ", ".join(shown)
        header.append("returns: " + text)
    return header


def _module(
    names: _Names,
    freevars: tuple[str, ...],
    scanning: bool,
    statements: list[cst.BaseStatement],
    header: list[str],
) -> cst.Module:
    """The template filled in: the factory, the step function, the statements as its body
    (in a `scan` step when scanning) and the header comment."""
    placeholders = {
        "factory": names.factory,
        "function": names.function,
        "spec": names.spec,
        "state": names.state,
        "xs": names.xs,
        "broadcast": names.broadcast,
        "body": names.marker,
    }
    if scanning:
        placeholders.update(
            step=names.step, carry=names.carry, x=names.x, scan=names.helpers["scan"]
        )
    replacements: dict[str, Any] = {k: cst.Name(v) for k, v in placeholders.items()}
    replacements["params"] = cst.Parameters(
        params=[cst.Param(cst.Name(v)) for v in (*names.helpers.values(), *freevars)]
    )
    module = parse_template_module(_SCAN_TEMPLATE if scanning else _PLAIN_TEMPLATE, **replacements)
    module = module.visit(_BodyMarker(names.marker, statements))
    return module.with_changes(header=_comment_lines(header))


def _line_map(
    module: cst.Module, origin: Mapping[cst.CSTNode, cst.CSTNode], analysis: Analysis
) -> tuple[tuple[int, int], ...]:
    """(generated line, user line) for every line of every statement of the user's body."""
    positions = meta.MetadataWrapper(module, unsafe_skip_copy=True).resolve(meta.PositionProvider)
    line_map: dict[int, int] = {}
    for new_node, orig_node in origin.items():
        if new_node not in positions or orig_node not in analysis.positions:
            continue
        g = positions[new_node]
        u = analysis.positions[orig_node]
        n = min(g.end.line - g.start.line, u.end.line - u.start.line)
        for k in range(n + 1):
            line_map.setdefault(g.start.line + k, analysis.user_line(u.start.line + k))
    return tuple(sorted(line_map.items()))


def _short(filename: str) -> str:
    return os.path.basename(filename)
