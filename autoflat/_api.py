"""The public functions: the `step` decorator, `show`, `stats`, `profile`, `clear_caches`."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, overload

from . import _caches
from ._analysis.source import jit_static_names, jitted_method
from ._errors import NOT_A_STEP, CallError
from ._runtime.diagnostics import Stats
from ._runtime.profile import Profile, measure
from ._step import GeneratedSource, Step
from ._transport.layout import PackMode

_F = TypeVar("_F", bound=Callable[..., Any])


class _Sentinel:
    def __repr__(self) -> str:
        return "sentinel"


_sentinel: Any = _Sentinel()


@overload
def step(
    fn: _F,
    *,
    num_steps: int = 1,
    state: str | Iterable[str] | Mapping[str, int] | None = None,
    broadcast: str | Iterable[str] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    per_step: str | Iterable[str] | None = None,
    donate: bool | Literal["always"] = True,
    unroll: int | bool = 1,
    lazy: bool = True,
    pack: PackMode | None = None,
) -> Step: ...


@overload
def step(
    *,
    num_steps: int = 1,
    state: str | Iterable[str] | Mapping[str, int] | None = None,
    broadcast: str | Iterable[str] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    per_step: str | Iterable[str] | None = None,
    donate: bool | Literal["always"] = True,
    unroll: int | bool = 1,
    lazy: bool = True,
    pack: PackMode | None = None,
) -> Callable[[Callable[..., Any]], Step]: ...


def step(
    fn: Any = _sentinel,
    *,
    num_steps: int = 1,
    state: str | Iterable[str] | Mapping[str, int] | None = None,
    broadcast: str | Iterable[str] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    per_step: str | Iterable[str] | None = None,
    donate: bool | Literal["always"] = True,
    unroll: int | bool = 1,
    lazy: bool = True,
    pack: PackMode | None = None,
) -> Any:
    """Compile a training step so that state crosses `jax.jit` as flat leaves, k steps a call.

    The function's source is analysed and a new function is generated (see `autoflat.show`):
    state arguments travel as cached structures plus leaf lists, the body runs as a
    `lax.scan` of `num_steps` steps, and state comes back as lazy handles that rebuild the real
    objects only when used. Passing those handles back in is the fast path.

    **Arguments:**

    - `fn`: the step function (usable as `@autoflat.step` or `@autoflat.step(...)`).
    - `num_steps`: steps per call. With `k > 1`, per-step inputs carry a leading axis of
      length `k` (a final chunk may be shorter) and per-step outputs are stacked along one.
      With 1 (the default), nothing gets a leading axis: a drop-in for `jax.jit(fn)`.
    - `state`: parameter name(s) to carry as state when the source does not return them by
      name, or a mapping `{"p": 0}` from parameter to the return position that gives back its
      new value. Inferred otherwise: returned by name, assigned into, a mutable module, or a
      return position whose abstract value matches the parameter's at the first call (see
      the Roles page). A declared state that no return position matches is an error.
    - `broadcast`: parameter name(s) whose value is the same for every step of a call.
    - `static_argnames`: parameter name(s) with hashable Python values that select a compiled
      version.
    - `per_step`: parameter name(s) sliced along their leading axis, one slice per step.
      Inferred otherwise at the first call: with `num_steps=k > 1`, arrays whose every leaf
      has a leading axis of k are per-step, arrays without it are broadcast, Python scalars
      and strings are static, and objects JAX cannot trace are broadcast.
    - `donate`: donate the buffers of state that autoflat itself produced in an earlier call
      (the caller's own arrays are never donated). Handles passed to a donating call are
      consumed. A program that calls back to the host (`jax.pure_callback`, `io_callback`,
      `jax.debug.callback` or `print`, `eqx.error_if`) can fail while it runs, after donated
      inputs are gone, so it is not donated; `"always"` donates it all the same.
    - `unroll`: passed to `lax.scan`.
    - `lazy`: return state as lazy handles (the default: no host work until used). With
      False, state comes back as the real objects, rebuilt after every call; passing the same
      objects back in still skips the host flatten when their structure is immutable (tuples,
      NamedTuples, frozen dataclasses, Equinox modules). Use it when returned state is mixed
      with other trees in multi-tree pytree operations (`jax.tree.map(f, a, b)`,
      `optax.apply_updates`, `eqx.partition`), which cannot accept a handle in place of the
      real type.
    - `pack`: how state leaves travel across `jax.jit`. `"auto"` (the default): leaves of at
      most 512 elements are packed, per dtype, into one contiguous buffer when a state holds
      at least 32 of them; larger leaves (weights) keep their own buffers, and so does state
      written back into the caller's objects (Flax NNX mutation style) and state returned
      as real objects (`lazy=False`, which would unpack it on every call). `False`: one buffer
      per array leaf. `True`: every array leaf that is not sharded over several devices (and
      not a PRNG key) is packed. Fewer buffers means less host time per call; packing costs
      device copies in and out of the buffers. Inside the step, the elementwise operations
      that every packed leaf goes through alike (an optimizer's update) run once on the
      whole buffer, which compiles faster than one buffer per leaf. Results are those
      of one buffer per leaf, to the last bits: XLA simplifies a whole-buffer computation
      otherwise (`a / b / c`). See docs/performance.md.
      The environment variable `AUTOFLAT_PACK` (`off`, `on` or `auto`) sets the default.
      Shared Flax NNX Variables travel one buffer per leaf under every mode.

    **Returns:**

    A `Step`: call it as the original function.

    **Raises:**

    `autoflat.SourceError` if the function's source cannot be read or transformed,
    `autoflat.OptionError` (a `ValueError`) for options that do not fit the function.

    ```python
    >>> import autoflat, jax.numpy as jnp
    >>> @autoflat.step(num_steps=3)
    ... def count(total, x):
    ...     total = total + x
    ...     return total, total * 2
    >>> total, doubled = count(jnp.array(0.0), jnp.array([1.0, 2.0, 3.0]))
    >>> print(total, doubled)
    6.0 [ 2.  6. 12.]

    ```
    """

    def make(fn: Callable[..., Any], jit_static: frozenset[str] = frozenset()) -> Any:
        method = jitted_method(fn)
        if method is not None:
            # `jax.jit(self.update)` as jaxopt's solvers hold it: the method, as a method step
            # (its jit's static arguments static here too)
            return make(method, jit_static_names(fn))
        if inspect.ismethod(fn) or _bound_method(fn):
            # `autoflat.step(self.train_step)`, as `jax.jit` takes it: the method's function
            # as a method step, reached through its instance (as decorating it in the class).
            # An Equinox module's methods are bound by Equinox's own `BoundMethod`.
            bound: Any = fn
            return make(bound.__func__, jit_static).__get__(bound.__self__)
        if (
            not inspect.isroutine(fn)
            and not isinstance(fn, (functools.partial, Step))
            and not hasattr(fn, "__wrapped__")
            and inspect.isfunction(inspect.getattr_static(type(fn), "__call__", None))
        ):
            # An object whose class defines `__call__` (an Equinox module as the step), as
            # `jax.jit` takes it: its bound `__call__`.
            instance: Any = fn
            return make(instance.__call__)
        return Step(
            fn,
            num_steps=num_steps,
            state=state,
            broadcast=broadcast,
            static_argnames=_with_names(static_argnames, jit_static),
            per_step=per_step,
            donate=donate,
            unroll=unroll,
            lazy=lazy,
            pack=default_pack() if pack is None else pack,
        )

    if fn is _sentinel:
        return make
    return make(fn)


def _with_names(names: str | Iterable[str] | None, more: frozenset[str]) -> Any:
    """`static_argnames=` with the names of `more` added (None stays None without them)."""
    if not more:
        return names
    given = [names] if isinstance(names, str) else list(names or ())
    return [*given, *sorted(more - set(given))]


def _bound_method(fn: Any) -> bool:
    """A method bound to its instance by another type than Python's (Equinox's
    `BoundMethod`): it has the function and the instance, and wraps that function, or
    Python's bound method of it."""
    func = getattr(fn, "__func__", None)
    wrapped = getattr(fn, "__wrapped__", None)
    return (
        inspect.isfunction(func)
        and hasattr(fn, "__self__")
        and (wrapped is func or getattr(wrapped, "__func__", None) is func)
    )


def default_pack() -> Any:
    """`pack=` when the decorator does not say: from `AUTOFLAT_PACK`, else "auto"."""
    mode = os.environ.get("AUTOFLAT_PACK", "auto")
    try:
        return {"off": False, "on": True, "auto": "auto"}[mode]
    except KeyError:
        raise ValueError(f"AUTOFLAT_PACK must be off, on or auto, got {mode!r}") from None


def _as_step(fn: Any, api: str) -> Step:
    if isinstance(fn, functools.partial) and isinstance(fn.func, Step):
        fn = fn.func  # a method step reached through an instance
    if isinstance(fn, Step):
        return fn
    raise CallError(NOT_A_STEP.format(api=api, value=fn))


def show(fn: Step) -> GeneratedSource:
    """The generated Python that runs for a decorated step: exactly the compiled text.

    **Arguments:**

    - `fn`: a function decorated with `autoflat.step`.

    **Returns:**

    The generated source, a `str` (which a REPL shows as the code; `print` it in a script).
    Roles are inferred from the source when the step is decorated and completed with run-time
    types at its first call (a Flax NNX module argument becomes state): before the first call
    this shows the roles from the source alone; after it, the most recently generated version.

    ```python
    >>> import autoflat
    >>> @autoflat.step
    ... def inc(x):
    ...     return x + 1
    >>> print(autoflat.show(inc).splitlines()[0])
    # autoflat: generated from `inc` at <doctest autoflat._api.show[1]>:2

    ```
    """
    return _as_step(fn, "show").source


def stats(fn: Step) -> Stats:
    """A snapshot of a decorated step's counters (calls, fast-path hits, host flattens,
    copies, traces, rebuilds, operations on packed leaves run leaf by leaf).

    **Arguments:**

    - `fn`: a function decorated with `autoflat.step`.

    **Returns:**

    A `Stats` value (a copy: it does not change as the step runs).
    """
    return _as_step(fn, "stats").stats.snapshot()


def clear_caches() -> None:
    """Empty every autoflat cache: compiled functions, interned structures, generated files.

    Decorated steps stay usable; they retrace on their next call.
    """
    _caches.clear_all()


def profile(fn: Step, *args: Any, calls: int = 20, **kwargs: Any) -> Profile:
    """Where a step's time goes, measured on these arguments: print it for a short report.

    The step runs on copies of the state arguments: the caller's state, handles and
    Flax NNX objects are not touched, and the step's counters and caches are as they were
    afterwards (it reuses the step's compiled program: after the step's first call on
    arguments of these shapes it compiles only a small program that computes nothing, to
    time JAX's dispatch of the buffers). It measures the host time of a call (autoflat's own
    and the dispatch), the device time of one step, and from them the share of each step's
    time spent on the host and the smallest `num_steps` that brings it under 5%; the time of
    a step in a loop of calls back to back and the share of it beyond the device time; and
    the flattens, copies and rebuilds per call, where the step's handles were rebuilt, and
    why it recompiled.

    **Arguments:**

    - `fn`: a function decorated with `autoflat.step` (or a method step through its instance).
    - `*args`, `**kwargs`: arguments as for a call of the step.
    - `calls`: how many calls to time one by one, and in each of three loops back to back
      (the program alone runs about 5 × `calls` times).

    **Returns:**

    A `Profile`: its fields and properties are the figures (`host_s`, `device_s`,
    `host_share`, `host_bound`, `suggested_num_steps`, `loop_overhead`, ...); `str()` is the
    report.

    ```python
    >>> import autoflat, jax.numpy as jnp
    >>> @autoflat.step
    ... def sgd(w, x):
    ...     return w - 0.1 * x * w
    >>> p = autoflat.profile(sgd, jnp.ones(3), jnp.ones(3), calls=3)
    >>> p.num_steps, p.suggested_num_steps >= 1
    (1, True)

    ```
    """
    step_ = _as_step(fn, "profile")
    if isinstance(fn, functools.partial):
        args = (*fn.args, *args)
    args, kwargs = step_._with_bound(args, kwargs)
    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"autoflat.profile: calls must be a positive int, got {calls!r}")
    return measure(step_, args, kwargs, calls)
