"""The public API: `step`, `show`, `stats`, `clear_caches`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from . import _loading, _runtime
from ._errors import AutoflatError
from ._runtime import Stats, Step
from ._transport import PackMode

_F = TypeVar("_F", bound=Callable[..., Any])


class _Sentinel:
    def __repr__(self) -> str:
        return "sentinel"


_sentinel: Any = _Sentinel()


def _names(value: str | Iterable[str] | None, option: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset({value})
    try:
        names = frozenset(value)
    except TypeError:
        raise AutoflatError(
            f"autoflat.step: {option}= takes a parameter name or a sequence of names, got "
            f"{value!r}."
        ) from None
    for n in names:
        if not isinstance(n, str):
            raise AutoflatError(f"autoflat.step: {option}= takes parameter names, got {n!r}.")
    return names


@overload
def step(
    fn: _F,
    *,
    num_steps: int = 1,
    state: str | Iterable[str] | None = None,
    broadcast: str | Iterable[str] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate: bool = True,
    unroll: int | bool = 1,
    lazy: bool = True,
    pack: bool | str = False,
) -> Step: ...


@overload
def step(
    *,
    num_steps: int = 1,
    state: str | Iterable[str] | None = None,
    broadcast: str | Iterable[str] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate: bool = True,
    unroll: int | bool = 1,
    lazy: bool = True,
    pack: bool | str = False,
) -> Callable[[Callable[..., Any]], Step]: ...


def step(
    fn: Any = _sentinel,
    *,
    num_steps: int = 1,
    state: str | Iterable[str] | None = None,
    broadcast: str | Iterable[str] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate: bool = True,
    unroll: int | bool = 1,
    lazy: bool = True,
    pack: bool | str = False,
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
    - `state`: parameter name(s) to carry as state even if the source does not show it
      (inferred otherwise: returned by name, assigned into, or a mutable module).
    - `broadcast`: parameter name(s) whose value is the same for every step of a call.
    - `static_argnames`: parameter name(s) with hashable Python values that select a compiled
      version.
    - `donate`: donate the buffers of state that autoflat itself produced in an earlier call
      (the caller's own arrays are never donated). Handles passed to a donating call are
      consumed.
    - `unroll`: passed to `lax.scan`.
    - `lazy`: return state as lazy handles (the default: no host work until used). With
      False, state comes back as the real objects, rebuilt after every call; passing the same
      objects back in still skips the host flatten when their structure is immutable (tuples,
      NamedTuples, frozen dataclasses, Equinox modules). Use it when returned state is mixed
      with other trees in multi-tree pytree operations (`jax.tree.map(f, a, b)`,
      `optax.apply_updates`, `eqx.partition`), which cannot accept a handle in place of the
      real type.
    - `pack`: how state leaves travel across `jax.jit`. `False`: one buffer per array leaf.
      `True`: every array leaf that is not sharded over several devices (and not a PRNG key)
      is packed, per dtype, into one contiguous buffer. `"auto"`: only leaves of at most
      512 elements are packed; larger ones (weights) keep their own buffers. Fewer buffers
      means less host time per call; packing costs device copies in and out of the buffers,
      and a longer first compile (each packed leaf gets kernels of its own, where XLA would
      compile the kernels of same-shaped flat leaves once). See docs/performance.md.

    **Returns:**

    A `Step`: call it as the original function.

    **Raises:**

    `AutoflatError` if the function's source cannot be read or transformed.

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
    make = functools.partial(
        Step,
        num_steps=num_steps,
        state=_names(state, "state"),
        broadcast=_names(broadcast, "broadcast"),
        static_argnames=_names(static_argnames, "static_argnames"),
        donate=bool(donate),
        unroll=unroll,
        lazy=bool(lazy),
        pack=_pack_mode(pack),
    )
    if fn is _sentinel:
        return make
    return make(fn)


def _pack_mode(pack: Any) -> PackMode:
    if pack is False or pack is True or pack == "auto":
        return pack  # type: ignore[no-any-return]
    raise AutoflatError(f'autoflat.step: pack must be False, True or "auto", got {pack!r}.')


def _as_step(fn: Any) -> Step:
    if isinstance(fn, Step):
        return fn
    raise AutoflatError(f"expected a function decorated with @autoflat.step, got {fn!r}.")


def show(fn: Step, *, print_: bool = True) -> str:
    """The generated Python that runs for a decorated step: exactly the compiled text.

    **Arguments:**

    - `fn`: a function decorated with `autoflat.step`.
    - `print_`: also print it (default True).

    **Returns:**

    The generated source. Roles are inferred from the source when the step is decorated and
    completed with run-time types at its first call (a Flax NNX module argument becomes state):
    before the first call this shows the roles from the source alone; after it, the most
    recently generated version.

    ```python
    >>> import autoflat
    >>> @autoflat.step
    ... def inc(x):
    ...     return x + 1
    >>> print(autoflat.show(inc, print_=False).splitlines()[0])
    # autoflat: generated from `inc` at <doctest autoflat._api.show[1]>:2

    ```
    """
    s = _as_step(fn)
    programs = s.programs
    source = programs[-1].generated.source
    if print_:
        print(source)
    return source


def stats(fn: Step) -> Stats:
    """A snapshot of a decorated step's counters (calls, fast-path hits, host flattens,
    copies, traces, rebuilds).

    **Arguments:**

    - `fn`: a function decorated with `autoflat.step`.

    **Returns:**

    A `Stats` value (a copy: it does not change as the step runs).
    """
    return _as_step(fn).stats.snapshot()


def clear_caches() -> None:
    """Empty every autoflat cache: compiled functions, interned structures, generated files.

    Decorated steps stay usable; they retrace on their next call.
    """
    _runtime.clear_all()
    _loading.clear()
