"""A KeyboardInterrupt at every point of a call: the state passed in is intact, or
`step.recover()` returns the call's results, and the next call never blocks.

The sweep depends on no internal name: `sys.settrace` counts the lines that autoflat's own
code executes during a call (the 'line' events of frames whose file is under the package)
and raises `KeyboardInterrupt` at the n-th, for n = 1, 2, ... until a call completes with
no interrupt. After each interrupted call, the next call (`recover()`, or the call again
with the same state) runs in a thread that must finish: a lock left held would hang it.
The state it leaves must equal a plain `jax.jit` loop's from the same values.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

import autoflat

PACKAGE = os.path.dirname(os.path.abspath(autoflat.__file__)) + os.sep


class InterruptAt:
    """Raise `KeyboardInterrupt` at the `n`-th line autoflat's code executes in the block
    (once: CPython stops tracing after the trace function raised). `where` names the line."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0
        self.where: str | None = None

    @property
    def fired(self) -> bool:
        return self.where is not None

    def __enter__(self) -> InterruptAt:
        self._previous = sys.gettrace()
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        self._collecting = False
        gc.callbacks.append(self._gc)
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._previous)
        sys.unraisablehook = self._previous_hook
        gc.callbacks.remove(self._gc)

    def _gc(self, phase: str, info: Any) -> None:
        """Lines run while the garbage collector collects (the finalizers it calls) are not
        counted: Python drops an interrupt there, as it would a real Ctrl-C, and arming the
        trace again from inside a collection broke the code it interrupted (libcst's
        context managers raised "'traceback' object is not callable")."""
        self._collecting = phase == "start"

    def _unraisable(self, info: Any) -> None:
        """The interrupt landed in code the garbage collector ran (a weak reference's
        finalizer: `_codegen.loading._forget`), where Python prints an exception and drops
        it, as it would a real Ctrl-C there: armed again, for the next line."""
        if isinstance(info.exc_value, KeyboardInterrupt) and self.fired:
            self.where = None
            self.n = self.count + 1
            sys.settrace(self._call)
            return
        self._previous_hook(info)

    def _call(self, frame: Any, event: str, arg: Any) -> Any:
        return self._line if frame.f_code.co_filename.startswith(PACKAGE) else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not self.fired and not self._collecting:
            self.count += 1
            if self.count == self.n:
                code = frame.f_code
                self.where = f"{os.path.relpath(code.co_filename, PACKAGE)}:{frame.f_lineno}"
                self.where += f" ({code.co_name})"
                raise KeyboardInterrupt
        return self._line


@dataclasses.dataclass
class Case:
    """How to call one step and read its state."""

    step: Any
    run: Callable[[Any], tuple[Any, Any]]  # state -> (state after, outputs)
    recovered: Callable[[Any, Any], tuple[Any, Any]]  # (state, recover()) -> the same
    values: Callable[[Any], list[np.ndarray]]  # the state's arrays, read without rebuilding
    reference: Callable[[list[np.ndarray]], tuple[list[np.ndarray], Any]]  # jax.jit's


def _next_call(case: Case, state: Any, before: list[np.ndarray]) -> dict[str, Any]:
    """What the caller does after an interrupt: `recover()`, or (nothing to recover) check
    that the state passed in is intact and call again with it. Run in a thread."""
    out: dict[str, Any] = {}
    try:
        try:
            out["result"] = case.recovered(state, case.step.recover())
            out["how"] = "recovered"
        except autoflat.StateError as e:
            if "nothing to recover" not in str(e):
                raise
            tree_allclose(case.values(state), before, exact=True)  # intact (not consumed)
            out["result"] = case.run(state)
            out["how"] = "called again"
    except BaseException as e:  # noqa: BLE001  (reported by the test)
        out["error"] = e
    return out


def sweep(case: Case, state: Any, limit: int = 5000) -> dict[str, int]:
    """Interrupt a call of `case.step` on `state` at its n-th line for every n; check each
    (see the module doc). Returns how the interrupted calls were resumed, counted."""
    counts = {"recovered": 0, "called again": 0}
    for n in range(1, limit):
        before = case.values(state)
        expected_state, expected_out = case.reference(before)
        with InterruptAt(n) as at:
            try:
                result = case.run(state)
            except KeyboardInterrupt as e:
                interrupt: KeyboardInterrupt | None = e
            else:
                interrupt = None
        if not at.fired:  # the call ran through: the sweep is done
            assert interrupt is None
            tree_allclose(case.values(result[0]), expected_state)
            tree_allclose(result[1], expected_out)
            counts["points"] = n - 1
            break
        assert interrupt is not None, f"the interrupt at {at.where} was swallowed"
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.update(_next_call(case, state, before)), daemon=True
        )
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), f"after an interrupt at {at.where}, the next call hangs"
        if "error" in box:
            raise AssertionError(f"after an interrupt at {at.where}") from box["error"]
        if box["how"] == "recovered":
            notes = "".join(getattr(interrupt, "__notes__", ()))
            assert ".recover()` returns them" in notes, at.where
        counts[box["how"]] += 1
        result = box["result"]
        new_state, out = result
        try:
            tree_allclose(case.values(new_state), expected_state)
            tree_allclose(out, expected_out)
        except AssertionError as e:
            raise AssertionError(f"after an interrupt at {at.where} ({box['how']})") from e
        state = new_state
    else:  # pragma: no cover
        raise AssertionError(f"no call completed within {limit} interrupts")
    # The sweep crossed the launch: some interrupts came before the program ran, some after.
    assert counts["recovered"] and counts["called again"], counts
    return counts


# --- the steps ------------------------------------------------------------------------------


def update(state, x):
    """Functional style: the new state returned (lazy handles, donated next call)."""
    state = {"w": state["w"] * 0.5 + x, "n": state["n"] + 1}
    return state, jnp.sum(x)


def update_in_place(state, x):
    """Mutation style: the new state written back into the caller's dict."""
    state["w"] = state["w"] * 0.5 + x
    state["n"] = state["n"] + 1
    return jnp.sum(x)


def _xs(k: int) -> jax.Array:
    return jnp.arange(k * 3, dtype=jnp.float32).reshape((k, 3) if k > 1 else (3,))


def _jit_reference(k: int) -> Callable[[list[np.ndarray]], tuple[list[np.ndarray], Any]]:
    """`k` calls of `jax.jit(update)` from the state's values (`[n, w]`, in leaf order)."""
    jitted = jax.jit(update)
    xs = _xs(k)

    def reference(values: list[np.ndarray]) -> tuple[list[np.ndarray], Any]:
        state = {"n": jnp.asarray(values[0]), "w": jnp.asarray(values[1])}
        outs = []
        for i in range(k):
            state, out = jitted(state, xs[i] if k > 1 else xs)
            outs.append(out)
        return jax.tree_util.tree_leaves(state), jnp.stack(outs) if k > 1 else outs[0]

    return reference


def _leaves(state: Any) -> list[np.ndarray]:
    # A handle's leaves, read as JAX reads them (no rebuild: the next call stays on the fast
    # path, and donates the handle's buffers).
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def _start() -> dict[str, jax.Array]:
    return {"w": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}


def _functional(k: int, warm: bool = True, **options: Any) -> tuple[Case, Any]:
    """A functional step's case, and its state after two calls (`warm`): a handle it
    returned, donated by the next call."""
    step = autoflat.step(update, num_steps=k, **options)
    xs = _xs(k)
    case = Case(
        step=step,
        run=lambda s: step(s, xs),
        recovered=lambda s, r: r,
        values=_leaves,
        reference=_jit_reference(k),
    )
    state = _start()
    for _ in range(2 if warm else 0):
        state, _ = step(state, xs)
    return case, state


def _in_place(k: int, warm: bool = True, **options: Any) -> tuple[Case, Any]:
    """A mutation-style step's case, and its state after two calls (`warm`): a dict holding
    buffers autoflat wrote, donated by the next call without a copy."""
    step = autoflat.step(update_in_place, num_steps=k, **options)
    xs = _xs(k)
    case = Case(
        step=step,
        run=lambda s: (s, step(s, xs)),
        recovered=lambda s, r: (s, r),
        values=_leaves,
        reference=_jit_reference(k),
    )
    state = _start()
    for _ in range(2 if warm else 0):
        step(state, xs)
    return case, state


@pytest.mark.parametrize("k", [1, 2])
def test_an_interrupt_anywhere_in_a_call_of_a_functional_step(k):
    """Handles passed back, donated: an interrupt while the call claimed them lost them
    ("consumed by call N", nothing to recover), or left a lock held that hung every step."""
    case, state = _functional(k)
    counts = sweep(case, state)
    assert counts["points"] > 50, counts  # the whole call was swept


@pytest.mark.parametrize("k", [1, 2])
def test_an_interrupt_anywhere_in_a_call_of_a_mutation_style_step(k):
    """State written back into the caller's dict: an interrupt after the write-back and
    before the call returned left recover() with nothing, and a call again ran the step
    twice."""
    case, state = _in_place(k, pack=False)
    counts = sweep(case, state)
    assert counts["points"] > 50, counts


def test_a_finished_call_leaves_nothing_to_recover():
    """The step keeps a call's result only until the call returns it: after that, nothing
    to recover, and the step holds neither the result nor the inputs."""
    import gc
    import weakref

    case, state = _functional(1)
    state, _ = case.run(state)
    with pytest.raises(autoflat.StateError, match="nothing to recover"):
        case.step.recover()
    passed, batch = weakref.ref(state), jnp.ones(3)
    returned = weakref.ref(case.step(state, batch)[0])
    kept = weakref.ref(batch)
    del state, batch
    gc.collect()
    assert passed() is None and returned() is None and kept() is None


# --- longer variants ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(
    "options",
    [{"pack": True}, {"lazy": False}, {"donate": "always"}, {"donate": False}],
    ids=["packed", "not-lazy", "donate-always", "no-donation"],
)
def test_an_interrupt_anywhere_with_other_options(k, options):
    case, state = _functional(k, **options)
    sweep(case, state)
    case, state = _in_place(k, **options)
    sweep(case, state)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_an_interrupt_anywhere_in_a_call_of_a_flax_nnx_step(k):
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))
            self.n = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def train(model, x):
        model.w[...] = model.w[...] * 0.5 + x
        model.n[...] = model.n[...] + 1
        return jnp.sum(x)

    step = autoflat.step(train, num_steps=k)
    xs = _xs(k)
    case = Case(
        step=step,
        run=lambda m: (m, step(m, xs)),
        recovered=lambda m, r: (m, r),
        values=lambda m: [np.asarray(m.n[...]), np.asarray(m.w[...])],
        reference=_jit_reference(k),
    )
    model = Model()
    step(model, xs)
    step(model, xs)
    sweep(case, model)


STRIDE = 17  # the first-call sweep interrupts every STRIDE-th line


@pytest.mark.slow
@pytest.mark.parametrize("make", [_functional, _in_place], ids=["functional", "in-place"])
def test_an_interrupt_anywhere_in_a_first_call(make):
    """The first call (roles, code generation, tracing, compiling), at every `STRIDE`-th
    line: a new step each time, whose next call resumes as after any interrupt."""
    k = 2
    expected_state, expected_out = _jit_reference(k)(_leaves(_start()))
    for n in range(STRIDE, 100_000, STRIDE):
        case, state = make(k, warm=False)
        with InterruptAt(n) as at:
            try:
                result = case.run(state)
            except KeyboardInterrupt:
                result = None
        if not at.fired:
            tree_allclose(_leaves(result[0]), expected_state)
            break
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.update(_next_call(case, state, _leaves(_start()))), daemon=True
        )
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), f"after an interrupt at {at.where}, the next call hangs"
        if "error" in box:
            raise AssertionError(f"after an interrupt at {at.where}") from box["error"]
        new_state, out = box["result"]
        tree_allclose(_leaves(new_state), expected_state)
        tree_allclose(out, expected_out)
