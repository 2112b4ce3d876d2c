"""Stage 1, first half: find a step function's source text.

`unwrap_function` takes the plain function out of a `jax.jit` or `eqx.filter_jit` wrapper
(autoflat compiles the step itself) and refuses what it cannot see through: a
`functools.partial`, a `jax.jit` with options autoflat would drop, any other wrapper (which
would silently not run). `read_source` reads the function's dedented source, its file and first
line, or raises a `SourceError` saying why it cannot (a lambda, code typed at a REPL).
"""

from __future__ import annotations

import functools
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from ._errors import (
    FUNCTOOLS_PARTIAL,
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


def unwrap_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The plain Python function under a `jax.jit` or `eqx.filter_jit` wrapper, which autoflat
    replaces (it compiles the step itself).

    **Raises:**

    `SourceError` for a `functools.partial`, whose bound arguments autoflat cannot see; for a
    `jax.jit` with options (static arguments, donation, shardings) autoflat would drop; and
    for any other wrapper (`functools.wraps`, `jax.vmap`, ...): autoflat regenerates the
    function from its source, so a wrapper under it would silently not run.
    """
    seen = set()
    while id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            inner: Any = fn
            while isinstance(inner, functools.partial):
                inner = inner.func
            raise error(SourceError, FUNCTOOLS_PARTIAL, location_of(inner))
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
            raise error(SourceError, JIT_OPTIONS, location_of(_innermost(wrapped)), options=options)
        fn = wrapped
    return fn


def _jit_kind(fn: Any) -> str | None:
    """`jax.jit` or `eqx.filter_jit` if `fn` is one of them, else None."""
    if type(fn).__name__ == "PjitFunction" and hasattr(fn, "lower"):
        return "jax.jit"
    eqx = sys.modules.get("equinox")
    if eqx is not None and type(fn).__name__ == "_JitWrapper":
        return "eqx.filter_jit"
    return None


def _jit_options(fn: Any) -> str:
    """The options of a `jax.jit` that autoflat would drop, in words ("" if none or unknown:
    JAX before 0.5 does not expose them)."""
    info = getattr(fn, "_jit_info", None)
    if info is None:
        return ""
    found = []
    for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
        if getattr(info, name, ()):
            found.append(f"{name}={getattr(info, name)!r}")
    if getattr(info, "user_specified_in_shardings", False):
        found.append("in_shardings")
    if any(
        type(s).__name__ != "UnspecifiedValue" for s in getattr(info, "out_shardings_leaves", ())
    ):
        found.append("out_shardings")
    return ", ".join(found)


def _wrapper_name(fn: Any) -> str:
    """A wrapper's own name (`functools.wraps` copies the wrapped function's onto it)."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        return f"{code.co_qualname} ({where(code.co_filename, code.co_firstlineno)})"
    return type(fn).__qualname__


def _innermost(fn: Any) -> Any:
    seen = set()
    while id(fn) not in seen and getattr(fn, "__wrapped__", None) is not None:
        seen.add(id(fn))
        fn = fn.__wrapped__
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
