"""Stage 3: generate the flattened, k-step version of a step function (libcst templates).

The output is one readable Python module holding a factory. The factory's parameters are
everything that enters the generated code from outside: autoflat's helpers and the user's
closure variables (whose original cells are bound at load time, so they stay live). Inside it,
the generated function takes the state as flat leaves, rebuilds the user's objects inside the
trace, runs the user's body unchanged (comments and formatting kept) as the body of a
`lax.scan` step with every `return` rewritten to `(new state), (outputs)`, and returns flat
leaves plus stacked outputs.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import libcst as cst
import libcst.metadata as meta
from libcst.helpers import parse_template_module

from ._analysis import Analysis
from ._errors import where
from ._roles import Roles

HELPERS = ("unflatten", "flatten", "scan")


@dataclasses.dataclass(frozen=True)
class GeneratedCode:
    """Generated source as a value: what `show()` prints is exactly what is compiled.

    - `source`: the module text.
    - `factory`: the name of the factory function it defines.
    - `function`: the name of the generated step function inside the factory.
    - `helpers`: maps each helper role (`"flatten"`, ...) to its name in the source.
    - `freevars`: the user's closure variables, factory parameters after the helpers.
    - `line_map`: (generated line, user line) pairs for the lines of the user's body.
    """

    source: str
    factory: str
    function: str
    helpers: Mapping[str, str]
    freevars: tuple[str, ...]
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
    """Replaces the marker statement of a template by the user's statements (kept as objects,
    so their positions can be looked up afterwards)."""

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


class _ReturnRewriter(cst.CSTTransformer):
    """Rewrites the returns of the function's own scope; records where each statement came
    from so the line map can be built."""

    METADATA_DEPENDENCIES = ()

    def __init__(self, make_return: Any) -> None:
        self.make_return = make_return
        self.depth = -1  # the root function itself is entered first
        self.origin: dict[cst.CSTNode, cst.CSTNode] = {}

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.depth += 1
        return True

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> Any:
        self.depth -= 1
        return self._keep(original_node, updated_node)

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        self.depth += 1
        return True

    def leave_Lambda(self, original_node: cst.Lambda, updated_node: cst.Lambda) -> Any:
        self.depth -= 1
        return updated_node

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.depth += 1
        return True

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> Any:
        self.depth -= 1
        return self._keep(original_node, updated_node)

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> Any:
        if self.depth == 0:
            return self.make_return(original_node)
        return updated_node

    def _keep(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:
        self.origin[updated] = self.origin.get(original, original)
        return updated

    def on_leave(self, original_node: cst.CSTNode, updated_node: Any) -> Any:
        result = super().on_leave(original_node, updated_node)
        if isinstance(result, (cst.BaseStatement, cst.BaseSmallStatement)) and isinstance(
            original_node, (cst.BaseStatement, cst.BaseSmallStatement)
        ):
            self.origin[result] = original_node
        return result


def _elements(value: cst.BaseExpression | None) -> list[cst.BaseExpression]:
    if value is None:
        return []
    if isinstance(value, cst.Name) and value.value == "None":
        return []
    if isinstance(value, cst.Tuple):
        return [el.value for el in value.elements]
    return [value]


def _tuple(items: list[cst.BaseExpression]) -> cst.Tuple:
    """A parenthesized tuple; one element gets its trailing comma."""
    if len(items) == 1:
        return cst.Tuple(elements=[cst.Element(items[0], comma=cst.Comma())])
    return cst.Tuple(elements=[cst.Element(v) for v in items])


def _comment_lines(texts: Iterable[str]) -> list[cst.EmptyLine]:
    return [cst.EmptyLine(indent=True, comment=cst.Comment(f"# {t}" if t else "#")) for t in texts]


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
    - `index`: a number that makes the generated file name unique.

    **Returns:**

    A `GeneratedCode` value.
    """
    funcdef = analysis.funcdef
    name = funcdef.name.value
    namer = Namer(
        analysis.all_names
        | set(analysis.param_names)
        | set(user_globals)
        | set(freevars)
        | analysis.free_names
        | {name}
    )
    helpers = {h: namer(f"_af_{h}") for h in HELPERS}
    spec, state_in, xs_in, bcast_in = (
        namer(n) for n in ("_af_spec", "_af_state", "_af_xs", "_af_broadcast")
    )
    carry, x, marker = namer("_af_carry"), namer("_af_x"), namer("_af_body")
    factory = namer(f"_autoflat_{name}")
    step_name = namer(f"{name}_step")
    scanning = num_steps > 1

    state = roles.state
    returned_at = {
        state[i]: pos for pos, (kind, i) in enumerate(roles.layout.entries) if kind == "state"
    }
    out_positions = [pos for pos, (kind, _) in enumerate(roles.layout.entries) if kind == "out"]

    def make_return(node: cst.Return | None) -> cst.Return:
        elements = _elements(node.value if node is not None else None)
        flats: list[cst.BaseExpression] = []
        for i, p in enumerate(state):
            value = elements[returned_at[p]] if p in returned_at else cst.Name(p)
            flats.append(
                cst.Call(
                    func=cst.Name(helpers["flatten"]),
                    args=[cst.Arg(cst.Name(spec)), cst.Arg(cst.Integer(str(i))), cst.Arg(value)],
                )
            )
        outs = [elements[pos] for pos in out_positions] if elements else []
        value = _tuple([_tuple(flats), _tuple(outs)]).with_changes(lpar=[], rpar=[])
        if node is None:
            return cst.Return(value=value)
        return cst.Return(value=value, semicolon=node.semicolon)

    # The user's body, returns rewritten (nested functions' returns untouched).
    rewriter = _ReturnRewriter(make_return)
    new_func = cst.ensure_type(funcdef.visit(rewriter), cst.FunctionDef)
    body_block = cst.ensure_type(new_func.body, cst.IndentedBlock)
    statements = list(body_block.body)
    if analysis.falls_through:
        statements.append(cst.SimpleStatementLine(body=[make_return(None)]))
    body_label = (
        f"body of {name} ({where(_short(analysis.filename), analysis.body_first_line)}"
        f"-{analysis.body_last_line})"
    )
    first: Any = statements[0]
    statements[0] = first.with_changes(
        leading_lines=[*_comment_lines([body_label]), *first.leading_lines]
    )
    origin = rewriter.origin

    # Binding of every parameter at the top of the step.
    binds: list[str] = []
    bcast = roles.of("broadcast")
    xs_names = roles.of("scanned")
    state_src = carry if scanning else state_in
    x_src = x if scanning else xs_in
    for p, role in zip(roles.params, roles.roles, strict=True):
        if role == "state":
            binds.append(f"{p} = {helpers['unflatten']}({state_src}[{state.index(p)}])")
        elif role == "scanned":
            binds.append(f"{p} = {x_src}[{xs_names.index(p)}]")
        elif role == "broadcast":
            binds.append(f"{p} = {helpers['unflatten']}({bcast_in}[{bcast.index(p)}])")
        else:
            binds.append(f"{p} = {spec}.static[{p!r}]")
    bind_stmts = [cst.parse_statement(b + "\n") for b in binds]
    if bind_stmts:
        label = (
            "unflatten state and bind this step's inputs"
            if scanning
            else "unflatten state and bind inputs"
        )
        bind_stmts[0] = bind_stmts[0].with_changes(leading_lines=_comment_lines([label]))

    header = [
        f"autoflat: generated from `{analysis.name}` at "
        f"{where(_short(analysis.filename), analysis.def_line)}",
        f"num_steps: {num_steps}",
        *(
            f"{p}: {r} ({why})"
            for p, r, why in zip(roles.params, roles.roles, roles.reasons, strict=True)
        ),
    ]
    if roles.layout.kind != "none":
        shown = []
        for kind, i in roles.layout.entries:
            shown.append(
                f"state {state[i]}"
                if kind == "state"
                else "output" + (" (stacked)" if scanning else "")
            )
        header.append("returns: " + ", ".join(shown))

    names = {
        "factory": factory,
        "function": name,
        "spec": spec,
        "state": state_in,
        "xs": xs_in,
        "broadcast": bcast_in,
        "body": marker,
    }
    if scanning:
        names.update(step=step_name, carry=carry, x=x, scan=helpers["scan"])
        template = _SCAN_TEMPLATE
    else:
        template = _PLAIN_TEMPLATE
    replacements: dict[str, Any] = {k: cst.Name(v) for k, v in names.items()}
    for i, v in enumerate([*helpers.values(), *freevars]):
        replacements[f"p{i}"] = cst.Name(v)
    params = ", ".join(f"{{p{i}}}" for i in range(len(helpers) + len(freevars)))
    module = parse_template_module(template.replace("{params}", params), **replacements)
    module = module.visit(_BodyMarker(marker, [*bind_stmts, *statements]))
    module = module.with_changes(header=_comment_lines(header))
    source = module.code

    # Line map: generated line -> user line, for every statement of the user's body.
    wrapper = meta.MetadataWrapper(module, unsafe_skip_copy=True)
    gen_pos = wrapper.resolve(meta.PositionProvider)
    line_map: dict[int, int] = {}
    for new_node, orig_node in origin.items():
        if new_node not in gen_pos or orig_node not in analysis.positions:
            continue
        g = gen_pos[new_node]
        u = analysis.positions[orig_node]
        n = min(g.end.line - g.start.line, u.end.line - u.start.line)
        for k in range(n + 1):
            line_map.setdefault(g.start.line + k, analysis.user_line(u.start.line + k))
    return GeneratedCode(
        source=source,
        factory=factory,
        function=name,
        helpers=helpers,
        freevars=freevars,
        line_map=tuple(sorted(line_map.items())),
    )


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


def _short(filename: str) -> str:
    import os

    return os.path.basename(filename)
