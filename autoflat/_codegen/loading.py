"""Stage 4: generated code made into the live function that runs, its lines kept findable.

`load` compiles the generated module under a descriptive file name such as
`<autoflat:update:0 from train.py:31>`, registers its lines with `linecache` (so tracebacks,
`inspect` and pdb show them) and builds the step function from the factory's inner code
object with the user's own `__globals__` and closure cells, so both stay live; autoflat's
helpers get fresh cells. `rewrite_traceback` points the traceback entries of an error raised
in the user's body at the user's file and line (the technique Jinja uses for templates).
"""

from __future__ import annotations

import linecache
import os
import sys
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import USER_ERROR_NOTE, where
from .generate import GeneratedCode

_registered: set[str] = set()
# Every file name ever given out (names are never reused, even after their program is freed).
_taken: set[str] = set()


def filename_for(name: str, index: int, user_file: str, line: int) -> str:
    """The file name generated code is compiled under: `<autoflat:NAME:INDEX from FILE:LINE>`,
    with INDEX the first not yet taken by any program (two steps made from one function get
    names of their own, so neither shows the other's lines).

    The angle brackets matter. `linecache` never looks such a name up on disk or through a
    module's `__loader__`; any other name would, after `linecache.clearcache()`, be read
    through the loader of the module whose globals the code runs with (the user's) and show
    lines of the user's file.
    """
    base = os.path.basename(user_file)
    while (filename := f"<autoflat:{name}:{index} from {base}:{line}>") in _taken:
        index += 1
    _taken.add(filename)
    return filename


def _register(filename: str, source: str) -> None:
    """Give `linecache` the lines of `source` under `filename` (mtime None: never checked
    against a file, so `linecache.checkcache()` keeps them)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    _registered.add(filename)


def load(
    generated: GeneratedCode,
    user_fn: Callable[..., Any],
    helpers: Mapping[str, Any],
    filename: str,
) -> types.FunctionType:
    """Compile `generated` and return its step function, bound to `user_fn`'s live globals
    and closure cells.

    **Arguments:**

    - `generated`: the `GeneratedCode`.
    - `user_fn`: the user's (unwrapped) function.
    - `helpers`: helper role -> object, for the names in `generated.helpers`.
    - `filename`: the file name to compile under (registered with `linecache`).
    """
    code = compile(generated.source, filename, "exec", dont_inherit=True)
    _register(filename, generated.source)

    factory = _find_code(code, generated.factory)
    inner = _find_code(factory, generated.function)
    values: dict[str, Any] = {
        generated.helpers[k]: v for k, v in helpers.items() if k in generated.helpers
    }
    user_cells = dict(
        zip(user_fn.__code__.co_freevars, user_fn.__closure__ or (), strict=True)  # type: ignore[attr-defined]
    )
    cells = []
    for name in inner.co_freevars:
        if name in values:
            cells.append(types.CellType(values[name]))
        elif name in user_cells:
            cells.append(user_cells[name])
        else:  # pragma: no cover - the generator only references these two kinds
            raise RuntimeError(f"autoflat: unexpected free variable {name!r} in generated code")
    fn = types.FunctionType(
        inner,
        user_fn.__globals__,  # type: ignore[attr-defined]
        generated.function,
        None,
        tuple(cells),
    )
    fn.__qualname__ = getattr(user_fn, "__qualname__", generated.function)
    fn.__module__ = getattr(user_fn, "__module__", None)  # type: ignore[assignment]
    # The lines stay in `linecache` while the function lives (tracebacks, pdb), no longer.
    weakref.finalize(fn, _forget, filename)
    return fn


def _forget(filename: str) -> None:
    linecache.cache.pop(filename, None)
    _registered.discard(filename)


def _find_code(code: types.CodeType, name: str) -> types.CodeType:
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and c.co_name == name:
            return c
    raise RuntimeError(f"autoflat: no code object {name!r} in generated module")  # pragma: no cover


def _fake_frame_tb(
    filename: str,
    line: int,
    funcname: str,
    f_locals: Mapping[str, Any] | None = None,
    f_globals: dict[str, Any] | None = None,
) -> types.TracebackType | None:
    """A traceback entry whose frame claims to run `funcname` at `filename:line`, with
    `f_locals` as its locals and `f_globals` as its globals: what `pdb.pm()`, IDE debuggers
    and pytest's `--showlocals` read of it. (Module-level code run by `exec` with a dict of
    locals has that very dict as its frame's `f_locals`.)"""
    code = compile("\n" * (line - 1) + f"raise {_MARKER}", filename, "exec")
    code = code.replace(co_name=funcname)
    namespace = dict(f_locals or {})
    namespace[_MARKER] = _Marker()
    try:
        exec(code, {} if f_globals is None else f_globals, namespace)
    except _Marker:
        tb = sys.exc_info()[2]
        del namespace[_MARKER]  # the frame's locals are the body's alone
        return tb.tb_next if tb is not None else None
    return None  # pragma: no cover


_MARKER = "__autoflat_marker__"


class _Marker(Exception):
    pass


def _body_locals(frame: types.FrameType, names: frozenset[str] | None) -> dict[str, Any]:
    """The locals of a generated frame that the user's own frame would have under
    `jax.jit`: those among `names` (the user's function's local, cell and free variables),
    none of the generated code's own; all of them where `names` is None."""
    f_locals = frame.f_locals
    if names is None:
        return dict(f_locals)
    return {k: v for k, v in f_locals.items() if k in names}


def rewrite_traceback(
    exc: BaseException,
    generated: GeneratedCode,
    filename: str,
    user_file: str,
    funcname: str,
    qualname: str,
    local_names: frozenset[str] | None = None,
) -> None:
    """Point the traceback entries of the user's body at the user's file and line, and add a
    note naming the line. Each such entry's frame has the locals the body had when it
    raised (of those, `local_names` if given: the names the user's function has), as the
    user's own frame has them under `jax.jit`, for post-mortem debuggers.

    The generated lines are registered with `linecache` again first if something (a
    `linecache.clearcache()`) dropped them, so the entries left in the generated file still
    show their lines when the traceback is printed.
    """
    if filename not in linecache.cache:
        _register(filename, generated.source)
    tb = exc.__traceback__
    entries = []
    user_line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            mapped = generated.user_line(tb.tb_lineno)
            if mapped is not None:
                user_line = mapped
                frame = tb.tb_frame
                # The generated function that runs the body (its `def` is generated) takes
                # the user's function's name and locals; a function the body defines (a
                # `loss_fn`) is the user's code through and through, and keeps its own.
                body = generated.user_line(frame.f_code.co_firstlineno) is None
                fake = _fake_frame_tb(
                    user_file,
                    mapped,
                    funcname if body else frame.f_code.co_name,
                    _body_locals(frame, local_names if body else None),
                    frame.f_globals,
                )
                if fake is not None:
                    entries.append((fake.tb_frame, fake.tb_lasti, fake.tb_lineno))
                    tb = tb.tb_next
                    continue
        entries.append((tb.tb_frame, tb.tb_lasti, tb.tb_lineno))
        tb = tb.tb_next
    if user_line is None:
        return
    new_tb = None
    for frame, lasti, lineno in reversed(entries):
        new_tb = types.TracebackType(new_tb, frame, lasti, lineno)
    exc.__traceback__ = new_tb
    note = USER_ERROR_NOTE.format(name=qualname, where=where(user_file, user_line))
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
