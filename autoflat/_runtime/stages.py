"""Ahead-of-time stages of a step, as `jax.jit` offers them: `Traced`, `Lowered`, `Compiled`.

Each wraps JAX's own stage object (`.jax`) for one prepared call of a step. The compiled
program takes the flat inputs autoflat builds (state leaves, per-step inputs, broadcast
leaves: `Lowered.args`); `Compiled` is called with the step's own arguments instead, and runs
them through the same call path as the step, only with this executable.
"""

from __future__ import annotations

from typing import Any

from .._errors import AOT_MISMATCH, CallError, error
from .call import Call, prepare
from .finish import finish, hand_over
from .launch import launch


class Traced:
    """A traced step (`Step.trace(*args)`): `.jaxpr`, `.lower()`, and JAX's `Traced` as `.jax`."""

    def __init__(self, step: Any, call: Call, traced: Any, donating: bool) -> None:
        self._step = step
        self._call = call
        self.jax = traced
        self._donating = donating

    @property
    def jaxpr(self) -> Any:
        return self.jax.jaxpr

    def lower(self) -> Lowered:
        return Lowered(self._step, self._call, self.jax.lower(), self._donating)


class Lowered:
    """A lowered step (`Step.lower(*args)`): `.compile()`, `.as_text()`, `.cost_analysis()`,
    JAX's `Lowered` as `.jax` and the compiled program's flat inputs as `.args`."""

    def __init__(self, step: Any, call: Call, lowered: Any, donating: bool) -> None:
        self._step = step
        self._call = call
        self.jax = lowered
        self._donating = donating  # whether the program donates the state leaves

    @property
    def args(self) -> tuple[Any, ...]:
        """What the compiled program takes: (state leaves, per-step inputs, broadcast leaves).
        With donation on, the state leaves are donated by a call of `Compiled.jax`."""
        return self._call.inputs()

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return str(self.jax.as_text(*args, **kwargs))

    def cost_analysis(self) -> Any:
        return self.jax.cost_analysis()

    def compile(self) -> Compiled:
        return Compiled(self._step, self._call.spec, self.jax.compile(), self._donating)


class Compiled:
    """A compiled step (`Step.lower(*args).compile()`): call it with the step's arguments.

    `cost_analysis()`, `memory_analysis()` and `as_text()` are JAX's; `.jax` is JAX's
    `Compiled` (the bare program, taking `Lowered.args`)."""

    def __init__(self, step: Any, spec: Any, compiled: Any, donating: bool) -> None:
        self._step = step
        self._spec = spec
        self.jax = compiled
        self._donating = donating

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        step = self._step
        step._diag.warn_if_pending(stacklevel=2)
        call = prepare(step, *step._with_bound(args, kwargs))
        if call.spec is not self._spec:
            raise error(CallError, AOT_MISMATCH, step._analysis)
        step.stats.calls += 1
        step._in_flight = call
        state_out, outputs = launch(step, call, self.jax, self._donating)
        return hand_over(call, finish(step, call, state_out, outputs))

    def cost_analysis(self) -> Any:
        return self.jax.cost_analysis()

    def memory_analysis(self) -> Any:
        return self.jax.memory_analysis()

    def as_text(self) -> str:
        return str(self.jax.as_text())
