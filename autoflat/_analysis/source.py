"""Stage 1, first half: find a step function's source text.

`unwrap_function` takes the plain function out of a `jax.jit` or `eqx.filter_jit` wrapper
(autoflat compiles the step itself) and out of `functools.partial`s (`bound_arguments` gives
what they bind), and refuses what it cannot see through: a `jax.jit` with options autoflat
would drop, any other wrapper (which would silently not run). `read_source` reads the
function's dedented source, its file and first line, or raises a `SourceError` saying why
it cannot (a lambda, code typed at a REPL).
"""

from __future__ import annotations
import __future__

import dataclasses
import dis
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Mapping
from typing import Any

from .. import _jax
from .._errors import (
    JIT_OPTIONS,
    NO_SOURCE,
    WRAPPED_STEP,
    Location,
    SourceError,
    error,
    where,
)


def location_of(fn: Any) -> Location:
    """Name and `file:line` of `fn` for messages raised before there is an `Analysis`."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return Location(name, where("<unknown>", 0))
    return Location(name, where(code.co_filename, code.co_firstlineno))


@dataclasses.dataclass(frozen=True)
class Bound:
    """What the `functools.partial`s around a step bind, merged as calling them would: the
    positional arguments (the innermost partial's first) and the keywords (an outer
    partial's win)."""

    args: tuple[Any, ...] = ()
    keywords: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.args or self.keywords)


def unwrap_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The plain Python function under `jax.jit`, `eqx.filter_jit` and `nnx.jit` wrappers,
    which autoflat replaces (it compiles the step itself), and under `functools.partial`s
    (`bound_arguments` gives what they bind). A partial of a bound method is its function
    with the instance bound first.

    **Raises:**

    `SourceError` for a `jax.jit` with options (shardings, static positions without a name)
    autoflat would drop; and for any other wrapper (`functools.wraps`, `jax.vmap`, ...):
    autoflat regenerates the function from its source, so a wrapper under it would silently
    not run.
    """
    return _unwrap(fn)[0]


def bound_arguments(fn: Callable[..., Any]) -> Bound:
    """What the `functools.partial`s around a step (outside or inside its `jax.jit`) bind."""
    return _unwrap(fn)[1]


def _unwrap(fn: Any) -> tuple[Callable[..., Any], Bound]:
    args: tuple[Any, ...] = ()
    keywords: dict[str, Any] = {}
    seen = set()
    while id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            # partial(partial(f, a), b)(x) is f(a, b, x): inner positionals first, and an
            # outer keyword overrides an inner one.
            args = (*fn.args, *args)
            keywords = {**fn.keywords, **keywords}
            fn = fn.func
            if inspect.ismethod(fn):  # partial(model.train_step, ...)
                args = (fn.__self__, *args)
                fn = fn.__func__
            continue
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is None or not callable(wrapped):
            break
        kind = _jit_kind(fn)
        if kind is None:
            raise error(
                SourceError,
                WRAPPED_STEP,
                location_of(_innermost(wrapped)),
                wrapper=_wrapper_name(fn),
            )
        options = _jit_options(fn)
        if options:
            at = location_of(_innermost(wrapped))
            raise error(SourceError, JIT_OPTIONS, at, options=options, wrapper=kind)
        fn = wrapped
        if inspect.ismethod(fn):  # partial(jax.jit(model.train_step), ...): as a partial's
            args = (fn.__self__, *args)
            fn = fn.__func__
    return fn, Bound(args, keywords)


def jitted_method(fn: Any) -> Any | None:
    """The bound method inside a `jax.jit` (`eqx.filter_jit`, `nnx.jit`) of it (jaxopt's
    solvers hold `self.update = jax.jit(self.update)`), or None. A jit with options autoflat
    cannot take raises, as around a function."""
    wrapped = getattr(fn, "__wrapped__", None)
    if _jit_kind(fn) is None or not (
        inspect.ismethod(wrapped) or hasattr(wrapped, "__self__") and hasattr(wrapped, "__func__")
    ):
        return None
    options = _jit_options(fn)
    if options:
        at = location_of(_innermost(wrapped))
        raise error(SourceError, JIT_OPTIONS, at, options=options, wrapper=_jit_kind(fn))
    return wrapped


def _jit_kind(fn: Any) -> str | None:
    """`jax.jit`, `eqx.filter_jit` or `nnx.jit` if `fn` is one of them, else None."""
    if _jax.is_jax_jit(fn):
        return "jax.jit"
    eqx = sys.modules.get("equinox")
    if eqx is not None and type(fn).__name__ == "_JitWrapper":
        return "eqx.filter_jit"
    if type(fn).__name__ == "JitWrapped" and type(fn).__module__.startswith("flax.nnx"):
        return "nnx.jit"  # autoflat does its graph handling (split, merge, write-back) too
    return None


def jit_static_names(fn: Any) -> frozenset[str]:
    """The static arguments, by name, of the `jax.jit` wrappers around a step (JAX names the
    `static_argnums` too): autoflat takes them as `static_argnames=`."""
    names: set[str] = set()
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if _jit_kind(fn) == "jax.jit":
            info = _jax.jit_info(fn)
            names.update(getattr(info, "static_argnames", ()) or ())
        fn = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)
    return frozenset(names)


def _parameters(fn: Any) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(_innermost(fn)).parameters.values())
    except (TypeError, ValueError):
        return []


def _unnamed_static(fn: Any, info: Any) -> list[str]:
    """A `jax.jit`'s static arguments that name no parameter, in words: a position past the
    named ones, or a negative one with `*args` (it counts from the call's last argument); a
    name that is a key of `**kwargs`."""
    P = inspect.Parameter
    parameters = _parameters(fn)
    params = [p.name for p in parameters if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    first = 0 if any(p.kind is P.VAR_POSITIONAL for p in parameters) else -len(params)
    found = []
    nums = tuple(getattr(info, "static_argnums", ()) or ())
    unnamed = tuple(i for i in nums if not first <= i < len(params))
    if unnamed:
        found.append(f"static_argnums={unnamed!r} (no parameter name)")
    named = {p.name for p in parameters if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    keys = tuple(n for n in getattr(info, "static_argnames", ()) or () if n not in named)
    if keys and any(p.kind is P.VAR_KEYWORD for p in parameters):
        found.append(
            f"static_argnames={keys!r} (keys of `**kwargs`: make each a keyword-only "
            "parameter, `def f(w, *, n, **kwargs)`)"
        )
    return found


def _jit_options(fn: Any, kind: str = "") -> str:
    """The options of a `jax.jit` that autoflat cannot take over, in words ("" if none or
    unknown: JAX before 0.5 does not expose them): shardings, and for `nnx.jit` any option
    (its inner `jax.jit` sees other arguments than the step's)."""
    if _jit_kind(fn) == "nnx.jit":
        # Its inner `jax.jit` carries the options (and out_shardings of nnx's own making).
        inner = _jit_options(fn.jitted_fn, "nnx.jit-inner").split(", ")
        found = [o for o in inner if o and o != "out_shardings"]
        found += [n for n in ("in_shardings", "out_shardings") if getattr(fn, n, None)]
        return ", ".join(dict.fromkeys(found))
    info = _jax.jit_info(fn)
    if info is None:
        return ""
    found = []
    if kind == "nnx.jit-inner":
        for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
            if getattr(info, name, ()):
                found.append(f"{name}={getattr(info, name)!r}")
    else:
        # Static arguments are taken over by name (`jit_static_names`), donation is autoflat's
        # own; a static argument without a parameter's name (in `*args`, `**kwargs`) is not.
        found += _unnamed_static(fn, info)
    if getattr(info, "user_specified_in_shardings", False):
        found.append("in_shardings")
    if any(
        type(s).__name__ != "UnspecifiedValue" for s in getattr(info, "out_shardings_leaves", ())
    ):
        found.append("out_shardings")
    return ", ".join(found)


def _wrapper_name(fn: Any) -> str:
    """A wrapper's own name (`functools.wraps` copies the wrapped function's onto it)."""
    if _jax.is_transformed(fn):
        return "a JAX transformation (jax.grad, jax.vmap, ...)"
    code = getattr(fn, "__code__", None)
    if code is not None:
        return f"{code.co_qualname} ({where(code.co_filename, code.co_firstlineno)})"
    return type(fn).__qualname__


def _innermost(fn: Any) -> Any:
    seen = set()
    while id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        else:
            break
    return fn


def read_source(fn: Callable[..., Any]) -> tuple[str, str, int]:
    """(dedented source, file name, first line) of `fn`."""
    at = location_of(fn)
    if not inspect.isfunction(fn):
        raise error(SourceError, NO_SOURCE, at, reason=f"it is a {type(fn).__name__}")
    if fn.__name__ == "<lambda>":
        raise error(SourceError, NO_SOURCE, at, reason="it is a lambda")
    try:
        lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError) as e:
        raise error(SourceError, NO_SOURCE, at, reason=str(e)) from None
    return textwrap.dedent("".join(lines)), filename, first


# The compiler flags of `from __future__` imports, which change what a body compiles to.
_FUTURE_FLAGS = functools.reduce(
    lambda a, name: a | getattr(__future__, name).compiler_flag, __future__.all_feature_names, 0
)


def matches_code(fn: Any, source: str) -> bool | None:
    """Whether `source` (the dedented `def` read from the function's file) compiles to the
    function's own code object: False when the file was edited after the function was
    imported; None when the source cannot be compiled apart from its module.

    The `def` is compiled in a scope like its own: inside a function that binds its free
    variables (so they compile as closure loads, not globals), and inside a class when it uses
    zero-argument `super()` (the `__class__` cell). Line numbers are not part of the
    comparison, so moving the function in its file is not an edit."""
    code = fn.__code__
    free = [v for v in code.co_freevars if v != "__class__"]
    lines: list[str] = []
    indent = ""
    if free:
        lines.append("def __autoflat_scope__():")
        indent = "    "
        lines.append(f"{indent}{', '.join(free)} = {', '.join(['None'] * len(free))}")
    if "__class__" in code.co_freevars:
        lines.append(f"{indent}class __autoflat_class__:")
        indent += "    "
    text = "\n".join(lines) + "\n" + textwrap.indent(source, indent)
    try:
        module = compile(
            text, code.co_filename, "exec", flags=code.co_flags & _FUTURE_FLAGS, dont_inherit=True
        )
    except (SyntaxError, ValueError):
        return None
    found = _find_code(module, code.co_name)
    if found is None:
        return False
    return _same_code(found, code)


def _find_code(code: types.CodeType, name: str) -> types.CodeType | None:
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            if c.co_name == name and not c.co_name.startswith("__autoflat_"):
                return c
            if c.co_name.startswith("__autoflat_"):
                inner = _find_code(c, name)
                if inner is not None:
                    return inner
    return None


# Instructions left out of the comparison, and ones compared as another: how the compiler
# spells a call or a name load depends on the module around the function (a name bound by an
# `import` is called without LOAD_METHOD on Python 3.11), not on the body.
_SKIPPED = frozenset(
    {
        "CACHE", "NOP", "EXTENDED_ARG", "RESUME", "PUSH_NULL", "PRECALL", "COPY_FREE_VARS",
        "MAKE_CELL", "RETURN_GENERATOR",
    }
)  # fmt: skip
_AS = {
    "LOAD_METHOD": "LOAD_ATTR",
    "LOAD_GLOBAL": "LOAD_NAME",
    "LOAD_DEREF": "LOAD_NAME",
    "LOAD_CLASSDEREF": "LOAD_NAME",
    "LOAD_FROM_DICT_OR_DEREF": "LOAD_NAME",
    "LOAD_FROM_DICT_OR_GLOBALS": "LOAD_NAME",
}
_JUMPS = frozenset([*dis.hasjrel, *getattr(dis, "hasjabs", ()), *getattr(dis, "hasjump", ())])


def _instructions(code: types.CodeType) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for ins in dis.get_instructions(code):
        if ins.opname in _SKIPPED:
            continue
        arg = ins.argval
        if ins.opcode in _JUMPS:
            arg = None  # offsets shift with the skipped instructions
        elif isinstance(arg, types.CodeType):
            arg = "<code>"  # compared on its own
        elif isinstance(arg, float | complex):
            arg = repr(arg)  # NaN
        elif ins.opname == "STORE_NAME" and arg == "__qualname__" and out:
            # A class body's qualified name says where the `def` was compiled
            # (`make_step.<locals>.step.<locals>.Out`): only its own part is compared.
            op, name = out[-1]
            if isinstance(name, str):
                out[-1] = (op, name.rpartition("<locals>.")[2])
        out.append((_AS.get(ins.opname, ins.opname), arg))
    return out


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    if (
        a.co_varnames != b.co_varnames
        or a.co_freevars != b.co_freevars
        or a.co_cellvars != b.co_cellvars
        or a.co_argcount != b.co_argcount
        or a.co_kwonlyargcount != b.co_kwonlyargcount
        or _instructions(a) != _instructions(b)
    ):
        return False
    nested_a = [c for c in a.co_consts if isinstance(c, types.CodeType)]
    nested_b = [c for c in b.co_consts if isinstance(c, types.CodeType)]
    return len(nested_a) == len(nested_b) and all(
        _same_code(x, y) for x, y in zip(nested_a, nested_b, strict=True)
    )
