"""The launch of a prepared call: which of the step's `jax.jit`s runs it (donating or not),
claiming the donated handles, running it so that its results survive an interrupt, and
errors raised while it runs pointed at the user's code.

A program runs without donation when its first trace (which the run then reuses) shows it
calls back to the host (it can fail while running, after donated inputs are gone) or that a
state output cannot reuse its input's buffers, unless the step asked for `donate="always"`;
and no program is donated while `jax_debug_nans` or `jax_debug_infs` is on (see
`checks_nans`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from .._codegen import loading as _loading
from .._errors import (
    CONSUMED,
    CONSUMED_BY_INTERRUPTED,
    INTERRUPTED_RECOVERABLE,
    NOT_AN_ARRAY,
    CallError,
    ConsumedError,
    StateError,
    error,
)
from .._handles.lazy import LazyHandle
from .._roles.hazards import note_per_step_by_shape
from .._transport.structure import is_array
from .entry import calls_back
from .entry import landed as landed_result
from .specs import CallSpec

if TYPE_CHECKING:
    from .call import Call


def launch(
    step: Any, call: Call, compiled: Callable[..., Any] | None = None, donating: bool = False
) -> Any:
    """Run the compiled program on a prepared call: the step's `jax.jit`, or an ahead-of-time
    executable `compiled` (which takes the inputs without the spec; `donating`: whether it
    was lowered to donate them). Sets `call.donating` to what the launch did.

    With `donate=True`, a program that calls back to the host (found at its first trace) runs
    without donation: it can fail while running, after donated inputs are gone. Such a
    program that also writes back into the caller's objects is waited for before they are.

    An exception anywhere in here, an interrupt included, leaves the state passed in intact
    (the handles this call claimed are given back) unless the program ran: then its results
    are in `call.landed`, for `finish` or `Step.recover`."""
    __tracebackhide__ = True
    spec, inputs = call.spec, call.inputs()
    # The results land in the call's `landed` from C (`deque.extend` of a `starmap`), with no
    # Python bytecode between the program's return and their store: a KeyboardInterrupt
    # that Python raises right after the program returned leaves them reachable from the step
    # (`Step.recover`, through `step._in_flight`), not lost with the inputs it consumed.
    landed = call.landed
    try:
        if call.donated and step.donate:
            _claim(step, call)
        if compiled is not None:
            call.donating = donating
            landed.extend(itertools.starmap(compiled, (inputs,)))
        else:
            jit = runner(step, spec, inputs)
            call.donating = bool(step.donate) and jit is step._jit
            landed.extend(itertools.starmap(jit, ((spec, *inputs),)))
        if spec.calls_back and call.program.written_back_idx:
            # It can fail while it runs, after this returned (on an accelerator): wait for
            # it, so that a failure raises here and not later from the caller's objects,
            # which the write-back would have filled with broken arrays in place of values.
            jax.block_until_ready(landed[0])
    except BaseException as e:
        _failed(step, call, e)
        raise
    return landed_result(spec, landed[0])


def _failed(step: Any, call: Call, e: BaseException) -> None:
    """What a launch that raised `e` leaves: its inputs intact and the handles it claimed
    given back, if the program did not run; its results for `recover()`, if they landed; else
    (an interrupt in JAX's Python after the program ran) the consumed handles say their
    results are lost. An error from the program points at the user's code."""
    __tracebackhide__ = True
    landed = call.landed
    if landed and isinstance(e, Exception):
        landed.clear()  # the program failed while it ran: its results are broken
    if not landed and not _consumed(call):
        # The program did not run: nothing donated, nothing to recover.
        if step._in_flight is call:
            step._in_flight = None
        _unclaim(call)
    if not isinstance(e, Exception):
        if landed:
            note_recoverable(step, e)
        elif _consumed(call):
            e.add_note(_LOST)
            for h in call.claimed:  # gone with the results: say so when they are used
                by = object.__getattribute__(h, "_af_consumed_by")
                object.__setattr__(h, "_af_consumed_by", -abs(by))
        _release(call)
        return
    _release(call)
    if isinstance(e, TypeError):
        _raise_if_not_arrays(step, call, e)
    program = call.program
    scanned = program.roles.of("scanned")
    by_shape = [scanned[k] for k in program.by_shape_scanned]
    note_per_step_by_shape(e, by_shape, step.num_steps)
    _loading.rewrite_traceback(
        e,
        program.generated,
        program.filename,
        step._analysis.filename,
        step._analysis.funcdef.name.value,
        step._analysis.name,
        _local_names(step._user_fn),
    )


def _local_names(fn: Any) -> frozenset[str] | None:
    """The names a frame of the user's function `fn` has as locals: its local, cell and free
    variables (what its frame shows under `jax.jit`)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return frozenset((*code.co_varnames, *code.co_cellvars, *code.co_freevars))


def note_recoverable(step: Any, e: BaseException) -> None:
    """Add to an interrupt (`e`, not an `Exception`) that came after the step's program ran
    the note that says `recover()` returns the call's results."""
    note = INTERRUPTED_RECOVERABLE.format(name=step._analysis.name, where=step._analysis.where)
    if note not in getattr(e, "__notes__", ()):
        e.add_note(note)


# An interrupt raised by Python code that JAX ran after the program (on its first call for
# some input shapes, JAX's dispatch is Python): the donated inputs are gone, the results too.
_LOST = (
    "autoflat: the interrupt came after the compiled program ran and before its results "
    "reached autoflat: the state passed to this call was consumed (donated) and its results "
    "are lost. Restart from a checkpoint or from state you kept."
)


def _consumed(call: Call) -> bool:
    """Whether the program ran and consumed state the caller holds: the buffers of a handle
    passed as state, or arrays of a state object (written into it by an earlier call, and
    donated without a copy). Copies autoflat made for the call do not count."""
    for i in call.program.state_idx:
        a = call.args[i]
        if type(a) is LazyHandle:
            arrays = object.__getattribute__(a, "_af_arrays")
        else:
            arrays = jax.tree_util.tree_leaves(a)
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in arrays):
            return True
    return False


def check_pending(step: Any, pending: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before a call, while an interrupted call's results wait for `recover()`: refuse state
    that call consumed (its arrays are gone) with an error that says where the new state is,
    before the call forgets the interrupted one. (A consumed handle raises the consumed
    error by itself.)"""
    for leaf in jax.tree_util.tree_leaves((args, kwargs), is_leaf=lambda x: type(x) is LazyHandle):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise error(
                StateError,
                CONSUMED_BY_INTERRUPTED,
                step._analysis,
                call=step._diag.stats.calls - 1,
            )


def _raise_if_not_arrays(step: Any, call: Call, cause: Exception) -> None:
    """JAX's "Error interpreting argument to <Step._entry>... xs[1]" in the user's words: the
    per-step argument holding a value that is not an array. (Per-step inputs go into the
    compiled program as they are; the non-array leaves of state and broadcast arguments are
    static parts of their structures, and never reach it.)"""
    if "interpreting argument" not in str(cause):
        return
    program = call.program
    for i in program.scanned_idx:
        param = program.roles.params[i]
        value = call.args[i]
        if type(value) is LazyHandle:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            if not (is_array(leaf) or isinstance(leaf, (bool, int, float, complex))):
                raise error(
                    CallError,
                    NOT_AN_ARRAY,
                    step._analysis,
                    path=f"{param}{jax.tree_util.keystr(path)}",
                    type=type(leaf).__name__,
                    param=param,
                    role="a per-step input",
                ) from cause


# The handles being claimed, by `id`, each to the `Call.claim` of the call claiming it, for
# as long as that call checks and marks them. `dict.setdefault` takes an entry atomically, so
# two threads passing one handle never both claim it, with no lock: an interrupt can come at
# any line, and a lock it left held would hang every later call of every step.
_claiming: dict[int, tuple[int, Any]] = {}


def _claim(step: Any, call: Call) -> None:
    """Mark the handles whose buffers a launch may donate as consumed by this call, before it
    runs: another thread passing one of them gets the consumed error, not JAX's "buffer
    deleted". A launch that fails, or does not donate, gives them back (`_unclaim`, from
    `call.claimed`, which lists a handle before it is marked).

    First every handle is taken (`_claiming`) and checked, then marked, then let go: an
    interrupt at any point leaves only what `_failed` undoes."""
    token = call.claim = (step._diag.stats.calls, step._origin)
    handles = call.donated
    for h in handles:
        owner = _claiming.setdefault(id(h), token)
        if owner is not token:  # another thread's call is claiming it now
            raise error(
                ConsumedError,
                CONSUMED,
                owner[1],
                param=object.__getattribute__(h, "_af_param"),
                call=owner[0],
            )
        LazyHandle._af_check(h)
    claimed = call.claimed
    for h in handles:
        claimed.append(h)
        object.__setattr__(h, "_af_consumer", token[1])
        object.__setattr__(h, "_af_consumed_by", token[0])
    _release(call)


def _unclaim(call: Call) -> None:
    """Give back the handles this call marked consumed (its program did not run)."""
    for h in call.claimed:
        object.__setattr__(h, "_af_consumed_by", 0)
    call.claimed.clear()


def _release(call: Call) -> None:
    """Let go of the entries of `_claiming` this call holds."""
    token = getattr(call, "claim", None)
    if token is None:
        return
    for h in call.donated:
        if _claiming.get(id(h)) is token:
            _claiming.pop(id(h), None)


def checks_nans() -> bool:
    """Whether `jax_debug_nans` or `jax_debug_infs` is on. On a NaN (an inf) in a result, JAX
    runs the program again, op by op on the same inputs, to name the operation that made it:
    inputs a donating launch has consumed. JAX does not donate while these are on, but a
    program it compiled before the flag was set would: autoflat launches without donation
    then (one more compile, the first time)."""
    return bool(jax.debug_nans.value or jax.debug_infs.value)


def runner(step: Any, spec: CallSpec, inputs: tuple[Any, ...]) -> Any:
    """The step's `jax.jit` that runs `spec`: donating, unless (decided at its first trace,
    which the jit then reuses) the program may fail at run time, or a state output cannot
    reuse its input's buffers, and the step did not ask for `donate="always"`; never
    donating while `checks_nans()`."""
    if spec.keeps_inputs is None:
        traced = step._jit.trace(spec, *inputs)
        spec.calls_back = calls_back(traced.jaxpr)
        spec.keeps_inputs = spec.calls_back or _reshapes_state(spec, inputs[0], traced)
    if not step.donate:
        return step._jit
    return step._jit_keep if checks_nans() or _keeps(step, spec) else step._jit


def _reshapes_state(spec: CallSpec, state_in: tuple[list[Any], ...], traced: Any) -> bool:
    """Whether a state output differs from its input in shapes or dtypes (at `num_steps=1`,
    a parameter returned by name that the step rebinds: `x = f(x); return model, x`). Its
    donated buffers could not hold the output: JAX would warn and the copy made for the
    donation would be wasted, so such a program runs without donation."""
    state_out = landed_result(spec, traced.out_info)[0]
    for arrays, flat in zip(state_in, state_out, strict=True):
        if len(arrays) != len(flat.arrays) or any(
            (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype)
            for a, b in zip(arrays, flat.arrays, strict=True)
        ):
            return True
    return False


def _keeps(step: Any, spec: CallSpec) -> bool:
    return step.donate is True and bool(spec.keeps_inputs)
