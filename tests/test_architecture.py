"""The package's shape, read from its files: the stages import one way, functions stay short,
and JAX's private API is used in one module only.

These read the source with `ast`; they run nothing of autoflat.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autoflat"

# The layers, in the order they may import each other: a module imports only from its own
# layer or an earlier one. The shared modules come first (any stage imports them), the facade
# last. CONTRIBUTING.md and docs/how-it-works.md give the same order.
LAYERS: list[tuple[str, ...]] = [
    ("_errors", "_caches", "_jax"),  # shared
    ("_analysis",),
    ("_transport",),
    ("_handles",),
    ("_roles",),
    ("_codegen",),
    ("_runtime",),
    ("_feeding",),
    ("__init__", "_api", "_step"),  # the facade
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}

MAX_CODE_LINES = 80


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name (within the package, `_roles.infer`) -> file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in it (lazy imports and
    `TYPE_CHECKING` blocks included)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    if name == "__init__":
        here = []
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "autoflat":
                base, node_module = [], node.module.split(".", 1)[1:]
                targets = [".".join(node_module)] if node_module else []
                base = []
            else:
                continue
            if node.level:
                mod = [*base, *(node.module.split(".") if node.module else [])]
                targets = [".".join(mod)] if mod else []
                targets += [".".join([*mod, a.name]) for a in node.names]
            else:
                mod = targets[0].split(".") if targets else []
                targets += [".".join([*mod, a.name]) for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("autoflat."):
                    targets.append(a.name.split(".", 1)[1])
        out |= {t for t in targets if t in known and t != name}
    return out


def _layer(module: str) -> int:
    return LAYER_OF[module.split(".")[0]]


def test_every_module_belongs_to_a_layer():
    missing = sorted(m for m in _modules() if m.split(".")[0] not in LAYER_OF)
    assert not missing, f"modules outside the layers of {__file__}: {missing}"


def test_stages_import_only_earlier_stages():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name not in LAYER_OF and name.split(".")[0] not in LAYER_OF:
            continue
        for target in _imports(name, path, set(modules)):
            if _layer(target) > _layer(name):
                wrong.append(f"{name} imports {target}")
    assert not wrong, "an earlier stage imports a later one:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles_between_modules():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    # a package's __init__ importing nothing of its own is the rule here; drop package -> child
    # edges that only name the child (from . import x) in case one appears
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_each_stage_package_says_what_it_owns_takes_and_hands_on():
    for names in LAYERS:
        for name in names:
            init = PACKAGE / name / "__init__.py"
            if not init.exists():
                continue
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            for word in ("Owns", "Takes in", "Hands on"):
                assert word in doc, f"{init.name} of {name} does not say what it {word.lower()}"


def _code_lines(lines: list[str], node: ast.AST) -> int:
    doc: set[int] = set()
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (
            isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if i not in doc and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")
    )


def test_no_function_is_longer_than_80_lines_of_code():
    long = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = _code_lines(lines, node)
                if n > MAX_CODE_LINES:
                    long.append(f"{name}.{node.name} ({path.name}:{node.lineno}): {n} lines")
    assert not long, "functions over 80 lines of code:\n" + "\n".join(sorted(long))


def test_jax_private_api_only_in_the_compatibility_module():
    """`jax._src`, `jax.extend`, `jax.core` and jaxpr equation internals are reached through
    `autoflat._jax` only, so a JAX release that changes them fails that module's tests."""
    private = ("jax._src", "jax.extend", "jax.core", "jax.interpreters")
    found = []
    for name, path in _modules().items():
        if name == "_jax":
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                mods = [ast.unparse(node)]
            else:
                continue
            for m in mods:
                if any(m == p or m.startswith(p + ".") for p in private):
                    found.append(f"{name}:{node.lineno}: {m}")
        for attr in (
            "get_bind_params",
            ".eqns",
            ".invars",
            ".outvars",
            ".constvars",
            "_jit_info",
            "PjitFunction",
            "sharding.SingleDeviceSharding",  # (deprecated by JAX 0.12.1)
            "import SingleDeviceSharding",
            ", SingleDeviceSharding",
        ):
            if attr in text:
                found.append(f"{name}: {attr}")
    assert not found, "JAX internals outside autoflat/_jax.py:\n" + "\n".join(sorted(set(found)))
