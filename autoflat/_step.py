"""`Step`, the decorated step function: a thin facade over the stages.

A `Step` reads and checks its options once, analyses the function (`_analysis`), makes its
programs (`_runtime.program`), and holds the per-step caches. A call is
`_runtime.call.prepare` → `_runtime.launch.launch` → `_runtime.finish.finish`; `lower`,
`trace` and `eval_shape` prepare a call the same way and hand it to JAX's ahead-of-time
stages instead of running it. `source` is the generated text that
`autoflat.show` returns.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import jax

from . import _caches
from ._analysis.analysis import Analysis, analyse
from ._analysis.source import Bound, bound_arguments, jit_static_names, unwrap_function
from ._errors import (
    BAD_FLAG,
    BAD_NAMES,
    BAD_NUM_STEPS,
    BAD_PACK,
    DECORATOR_ORDER,
    NOTHING_TO_RECOVER,
    Location,
    OptionError,
    SourceError,
    StateError,
    error,
    where,
)
from ._handles.lazy import LazyHandle, Origin
from ._handles.nnx import NnxState, take_graph_cache
from ._roles.options import check_bound_variadic
from ._roles.roles import Options
from ._runtime.call import prepare
from ._runtime.diagnostics import Diagnostics, Stats
from ._runtime.entry import entry, jitted, landed, relinked
from ._runtime.fed_back import FedBack
from ._runtime.finish import finish, hand_over
from ._runtime.launch import check_pending, launch, note_recoverable, runner
from ._runtime.program import Program, Programs
from ._runtime.specs import SpecCache
from ._runtime.stages import Lowered, Traced
from ._runtime.trial import maker as trial_maker
from ._transport.layout import PackMode
from ._transport.structure import Structure

_all_steps: weakref.WeakSet[Step] = weakref.WeakSet()


class GeneratedSource(str):
    """The generated Python of a step: a `str` that shows as the code in a REPL."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


class Step:
    """A step function transformed by `autoflat.step`. Call it like the original.

    Also offers JAX's ahead-of-time stages for the same arguments: `lower(*args)` (then
    `.compile()`, `.cost_analysis()`, `.as_text()`), `trace(*args)` and `eval_shape(*args)`.
    """

    __qualname__: str  # set by functools.update_wrapper, as are __name__, __doc__, __wrapped__

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        num_steps: int = 1,
        state: str | Iterable[str] | Mapping[str, int] | None = None,
        broadcast: str | Iterable[str] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        per_step: str | Iterable[str] | None = None,
        donate: bool | Literal["always"] = True,
        unroll: int | bool = 1,
        lazy: bool = True,
        pack: PackMode = "auto",
    ) -> None:
        if isinstance(fn, (staticmethod, classmethod)):
            # `@autoflat.step` above `@staticmethod`: the binding would go wrong later.
            inner = fn.__func__
            code = inner.__code__
            at = Location(inner.__qualname__, where(code.co_filename, code.co_firstlineno))
            raise error(SourceError, DECORATOR_ORDER, at, wrapper=type(fn).__name__)
        self._user_fn = unwrap_function(fn)
        # `functools.partial(train_step, tx=tx)`: the function, and what the partials bind.
        self._bound = bound_arguments(fn)
        analysis = self._analysis = analyse(fn)
        options = _options(fn, analysis, self._bound, state, broadcast, static_argnames, per_step)
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise error(OptionError, BAD_NUM_STEPS, analysis, value=num_steps)
        if not (pack is False or pack is True or pack == "auto"):
            raise error(OptionError, BAD_PACK, analysis, value=pack)
        params = analysis.param_names
        self.num_steps = num_steps
        _check_flags(analysis, donate=donate, lazy=lazy, unroll=unroll)
        if num_steps > 1:
            check_bound_variadic(analysis, options, _bound_into_variadic(self._bound, analysis))
        self.donate: bool | Literal["always"] = donate
        self.unroll = unroll
        self.lazy = lazy
        if pack == "auto" and not lazy:
            # lazy=False rebuilds real objects (an array per leaf) after every call: under
            # "auto" their state travels a buffer per leaf (no device call to unpack them).
            pack = False
        self.pack: PackMode = pack
        self._signature = inspect.signature(self._user_fn)
        self._params = params
        # (A call with as many positional arguments as there are parameters is taken as it
        # is, with no `inspect.Signature.bind`; never with `*args` or `**kwargs`.)
        self._n_params = -1 if analysis.variadic else len(params)
        self._bound_tail = _keyword_tail(self._bound, params)
        self._diag = Diagnostics(analysis.name, analysis.where)
        self._origin = Origin(analysis.name, analysis.where, self._diag.stats)
        # Checks the options against the source and makes the program from the source alone,
        # so bad options and returns fail at decoration.
        self._programs = Programs(analysis, options, self._user_fn, num_steps)
        self._trial = trial_maker(self)  # first-call trials (`_runtime.trial`)
        # (Renews the jits, so JAX lets go of programs of instances since freed: `SpecCache`.)
        self._specs = SpecCache(analysis, num_steps, unroll, pack, _renewer(self))
        # Identity caches (docs/how-it-works.md lists them with what invalidates each):
        # lazy=False: per state position, the last (object, handle) this step returned.
        self._last: dict[int, tuple[Any, LazyHandle]] = {}
        # Broadcast arguments: per position, (object, structure, arrays) of an immutable one.
        self._bcast_last: dict[int, tuple[Any, Structure, list[Any]]] = {}
        # Flax NNX objects passed again and again (mutation style).
        self._nnx = NnxState()
        # The last call's per-step outputs, refused where passed back as a per-step input.
        self._fed_back = FedBack()
        # The last call in progress (its program's results land in it), kept until it
        # finishes (`recover`).
        self._in_flight: Any = None
        # The step's jit, and the same program without donation for programs that must keep
        # their inputs (they call back to the host, or their state changes shape).
        self._jit, self._jit_keep = jitted(self._diag.note_trace, self.donate)
        functools.update_wrapper(self, fn)
        if self._bound:  # a partial has no name: the function's, and the partial as wrapped
            functools.update_wrapper(self, self._user_fn, updated=())
            self.__wrapped__ = fn
        _all_steps.add(self)

    @property
    def stats(self) -> Stats:
        """The step's live counters (`autoflat.stats(fn)` gives a snapshot)."""
        return self._diag.stats

    @property
    def _may_mutate(self) -> bool:
        return "flax.nnx" in sys.modules

    @property
    def programs(self) -> list[Program]:
        return self._programs.all()

    @property
    def source(self) -> GeneratedSource:
        """The generated Python that runs: before the first call, from the source's roles;
        after it, the most recently generated program (run-time types may add state)."""
        return GeneratedSource(self._programs.all()[-1].generated.source)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # `_runtime.profile._call_and_chain` times these phases: keep the two alike.
        __tracebackhide__ = True
        if self._bound:
            args, kwargs = self._with_bound(args, kwargs)
        take_graph_cache()  # a call through nnx.cached_partial: Flax's cache is ours to take
        # A recompile warning noted by an earlier call, issued before this one takes anything:
        # the caller's filters may make it an error, and then every state is still usable.
        self._diag.warn_if_pending(stacklevel=2)
        self._diag.stats.calls += 1
        pending = self._in_flight
        if pending is not None and pending.landed:
            check_pending(self, pending, args, kwargs)
        call = prepare(self, args, kwargs)
        # From here an interrupt at any point leaves the state passed in intact or the
        # results for `recover()`: `launch` gives back what it claimed unless the program ran,
        # and the step keeps the call until `hand_over` returns its result.
        self._in_flight = call
        try:
            state_out, outputs = launch(self, call)
            return hand_over(call, finish(self, call, state_out, outputs))
        except BaseException as e:
            if not isinstance(e, Exception) and (call.landed or call.handed):
                note_recoverable(self, e)
            raise

    def recover(self) -> Any:
        """The result of the last call, when a `KeyboardInterrupt` (or another exception
        raised from a signal handler) stopped it after its compiled program ran, at any point
        up to the call's return (the interrupt then carries a note that says so).

        By then the program has consumed the state passed in (its buffers were donated), and
        its new state exists only in the step: `recover()` returns it as the call would have
        (handles, outputs, write-backs into the caller's objects done). An interrupt before the
        program ran leaves the inputs intact instead, and there is nothing to recover. Call it
        before the step's next call, which forgets the interrupted one.

        **Raises:** `StateError` when there is nothing to recover."""
        call = self._in_flight
        if call is None or not (call.handed or call.landed):
            raise error(StateError, NOTHING_TO_RECOVER, self._analysis)
        if call.handed:  # it finished; the interrupt came before it returned
            return hand_over(call, call.handed[0])
        state_out, outputs = landed(call.spec, call.landed[0])
        return hand_over(call, finish(self, call, state_out, outputs))

    def _with_bound(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A call's arguments with what the step's `functools.partial`s bind, as calling the
        partial passes them: bound positionals first, and a keyword of the call overrides a
        bound one. Keywords bound for the last parameters go in by position when the call
        passes the others by position (no `inspect.Signature.bind` on each call)."""
        bound = self._bound
        if not bound:
            return args, kwargs
        if not kwargs and self._bound_tail is not None:
            if len(bound.args) + len(args) + len(self._bound_tail) == self._n_params:
                return (*bound.args, *args, *self._bound_tail), kwargs
        return (*bound.args, *args), {**bound.keywords, **kwargs}

    # --- JAX's ahead-of-time stages ---------------------------------------------------------
    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace and lower the step for these arguments without running it (as
        `jax.jit(f).lower`): `.compile()` gives a callable `Compiled` with `cost_analysis()`
        and `memory_analysis()`. Nothing is donated or written back."""
        call = prepare(self, *self._with_bound(args, kwargs))
        jit = runner(self, call.spec, call.inputs())
        donating = bool(self.donate) and jit is self._jit
        return Lowered(self, call, jit.lower(call.spec, *call.inputs()), donating)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Trace the step for these arguments (as `jax.jit(f).trace`): `.jaxpr`, `.lower()`."""
        call = prepare(self, *self._with_bound(args, kwargs))
        jit = runner(self, call.spec, call.inputs())
        donating = bool(self.donate) and jit is self._jit
        return Traced(self, call, jit.trace(call.spec, *call.inputs()), donating)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The step's result for these arguments as `jax.ShapeDtypeStruct`s, in the shape the
        step returns (state as its real objects), computed without compiling or running."""
        call = prepare(self, *self._with_bound(args, kwargs))
        fn = functools.partial(entry, None, call.spec, repack=False, as_list=False)
        state_out, outputs = jax.eval_shape(fn, *call.inputs())
        state = [flat.structure.unflatten(flat.arrays) for flat in relinked(call.spec, state_out)]
        return call.program.result(state, outputs)

    # --- conveniences -----------------------------------------------------------------------
    def clear_cache(self) -> None:
        """Forget this step's compiled programs, specs and identity caches."""
        self._specs.clear()
        self._bcast_last.clear()
        self._nnx.cache = None
        self._last.clear()
        self._fed_back = FedBack()
        self._diag.forget_traces()
        self._renew_jits()

    def _renew_jits(self) -> None:
        """New `jax.jit`s of the step: JAX forgets the programs it compiled for the old ones."""
        self._jit, self._jit_keep = jitted(self._diag.note_trace, self.donate)

    def __repr__(self) -> str:
        return f"<autoflat.step {self.__qualname__} num_steps={self.num_steps}>"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)


def _instance_param(params: tuple[str, ...], named: set[str] | frozenset[str]) -> str | None:
    """A method's instance parameter (`self`, `cls`) unless an option names it: the same
    for every step (its arrays, if it is a pytree, are broadcast; anything else is static)."""
    if params and params[0] in ("self", "cls") and params[0] not in named:
        return params[0]
    return None


def _renewer(step: Step) -> Callable[[], None]:
    """`step._renew_jits`, holding the step weakly (its spec cache keeps this)."""
    ref = weakref.ref(step)

    def renew() -> None:
        s = ref()
        if s is not None:
            s._renew_jits()

    return renew


def _bound_names(bound: Bound, params: tuple[str, ...], variadic: frozenset[str]) -> frozenset[str]:
    """The parameters a step's `functools.partial`s bind: the first ones by position, the
    others by name (a keyword that is no parameter fails at the call, as the partial would).
    Never `*args` or `**kwargs`, whose value the call may add to."""
    named = frozenset(params[: len(bound.args)]) | (frozenset(bound.keywords) & set(params))
    return named - variadic


def _bound_into_variadic(bound: Bound, analysis: Any) -> dict[str, str]:
    """Per variadic parameter that a step's `functools.partial`s bind into (`partial(f, a, b)`
    of `def f(a, *args)`; a keyword no named parameter takes, with `**kwargs`), what they
    bind there, in words."""
    into: dict[str, str] = {}
    positional = 0
    for p in analysis.params:
        if p.kind == "var_positional" and len(bound.args) > positional:
            n = len(bound.args) - positional
            into[p.name] = f"{n} positional argument{'s' if n > 1 else ''}"
        elif p.kind == "var_keyword":
            takes = ("positional_or_keyword", "keyword_only")
            named = {q.name for q in analysis.params if q.kind in takes}
            extra = sorted(set(bound.keywords) - named)
            if extra:
                into[p.name] = "the keyword " + ", ".join(f"`{k}`" for k in extra)
        elif p.kind.startswith("positional"):
            positional += 1
    return into


def _keyword_tail(bound: Bound, params: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The bound keywords' values in parameter order, when they bind exactly the last
    parameters (`partial(train_step, learning_rate_fn=schedule)`), else None."""
    n = len(bound.keywords)
    if not n or set(params[-n:]) != set(bound.keywords) or len(params) - n < len(bound.args):
        return None
    return tuple(bound.keywords[p] for p in params[-n:])


def _check_flags(analysis: Any, *, donate: Any, lazy: Any, unroll: Any) -> None:
    """Options that are not role names: checked at decoration, not at the first call."""
    checks = (
        (
            "donate",
            donate,
            donate is True or donate is False or donate == "always",
            'True, False or "always"',
        ),
        ("lazy", lazy, isinstance(lazy, bool), "True or False"),
        (
            "unroll",
            unroll,
            isinstance(unroll, bool) or (isinstance(unroll, int) and unroll >= 1),
            "an int >= 1, True or False (as lax.scan takes it)",
        ),
    )
    for option, value, ok, allowed in checks:
        if not ok:
            raise error(
                OptionError, BAD_FLAG, analysis, option=option, value=value, allowed=allowed
            )


def _options(
    fn: Callable[..., Any],
    analysis: Analysis,
    bound: Bound,
    state: str | Iterable[str] | Mapping[str, int] | None,
    broadcast: str | Iterable[str] | None,
    static_argnames: str | Iterable[str] | None,
    per_step: str | Iterable[str] | None,
) -> Options:
    """The role options as parameter names (each checked against the source)."""
    state_, broadcast_, static_, per_step_ = (
        _names(value, option, analysis)
        for value, option in (
            (state, "state"),
            (broadcast, "broadcast"),
            (static_argnames, "static_argnames"),
            (per_step, "per_step"),
        )
    )
    # A `jax.jit(..., static_argnums=2)` under autoflat: its static arguments are static
    # here too (its donation is autoflat's own: the state it carries).
    static_ |= jit_static_names(fn) - state_ - broadcast_ - per_step_
    params = analysis.param_names
    return Options(
        state=state_,
        broadcast=broadcast_,
        static=static_,
        per_step=per_step_,
        state_at=_positions(state, analysis),
        instance=_instance_param(params, state_ | static_ | broadcast_),
        bound=_bound_names(bound, params, analysis.variadic),
    )


def _names(value: Any, option: str, analysis: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset({value})
    if isinstance(value, (bytes, bytearray)):
        raise error(OptionError, BAD_NAMES, analysis, option=option, value=value)
    if isinstance(value, Mapping):
        value = list(value)
    try:
        names = frozenset(value)
    except TypeError:
        raise error(OptionError, BAD_NAMES, analysis, option=option, value=value) from None
    for n in names:
        if not isinstance(n, str):
            raise error(OptionError, BAD_NAMES, analysis, option=option, value=value)
    return names


def _positions(value: Any, analysis: Any) -> tuple[tuple[str, int], ...]:
    """`state={"p": 0}`: each state parameter with the return position that gives it back."""
    if not isinstance(value, Mapping):
        return ()
    for pos in value.values():
        if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
            raise error(OptionError, BAD_NAMES, analysis, option="state", value=value)
    return tuple(sorted(value.items()))


@_caches.register
def _clear_steps() -> None:
    for step in list(_all_steps):
        step.clear_cache()
