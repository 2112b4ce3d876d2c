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
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from .._codegen import loading as _loading
from .._errors import CONSUMED_BY_INTERRUPTED, NOT_AN_ARRAY, CallError, StateError, error
from .._handles.lazy import LazyHandle
from .._transport.structure import is_array
from .entry import calls_back
from .entry import landed as landed_result
from .program import CallSpec

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
    program that also writes back into the caller's objects is waited for before they are."""
    __tracebackhide__ = True
    spec, inputs = call.spec, call.inputs()
    claimed = _claim(step, call.donated) if call.donated and step.donate else ()
    # The results land in the call's `landed` from C (`deque.extend` of a `starmap`), with no
    # Python bytecode between the program's return and their store: a KeyboardInterrupt
    # that Python raises right after the program returned leaves them reachable from the step
    # (`Step.recover`, through `step._in_flight`), not lost with the inputs it consumed.
    landed = call.landed
    try:
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
        if landed and isinstance(e, Exception):
            landed.clear()  # the program failed while it ran: its results are broken
        if not landed and not _consumed(call):
            # The program did not run: nothing donated, nothing to recover.
            if step._in_flight is call:
                step._in_flight = None
            for h in claimed:
                object.__setattr__(h, "_af_consumed_by", 0)
        if not isinstance(e, Exception):
            if not landed and _consumed(call):
                e.add_note(_LOST)
                for h in claimed:  # gone with the results: say so when they are used
                    by = object.__getattribute__(h, "_af_consumed_by")
                    object.__setattr__(h, "_af_consumed_by", -by)
            raise
        if isinstance(e, TypeError):
            _raise_if_not_arrays(step, call, e)
        program = call.program
        _loading.rewrite_traceback(
            e,
            program.generated,
            program.filename,
            step._analysis.filename,
            step._analysis.funcdef.name.value,
            step._analysis.name,
        )
        raise
    return landed_result(spec, landed[0])


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


_claim_lock = threading.Lock()


def _claim(step: Any, handles: list[LazyHandle]) -> list[LazyHandle]:
    """Mark the handles whose buffers a launch may donate as consumed by this call, at once
    and before it runs: another thread passing one of them gets the consumed error, not JAX's
    "buffer deleted". A launch that fails, or does not donate, gives them back."""
    call = step._diag.stats.calls
    with _claim_lock:
        for h in handles:
            LazyHandle._af_check(h)
        for h in handles:
            object.__setattr__(h, "_af_consumed_by", call)
            object.__setattr__(h, "_af_consumer", step._origin)
    return handles


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
