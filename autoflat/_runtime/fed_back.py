"""A per-step input read so by its shapes, given back what the step returned as a per-step
output the call before: a carry that was sliced per step.

At num_steps > 1 an argument whose every array leads with num_steps is read as per-step
(rule `leading-axis`). A carry of num_steps rows (an episode return over num_steps
environments, a recurrent state of a batch of num_steps) type-checks read so too: each step
gets one row, and the value the step gives back is stacked as a per-step output. Nothing in
the first call tells the two apart; the calls after it do: a carry's new value is passed back
in, per-step data is not. `FedBack` keeps a call's per-step output arrays (weakly, by
identity), and `refuse` raises where the next call passes one of them back at such an
argument, before anything of that call is taken, if one step's value at that position has the
shapes the argument had (the value it could be the new one of).

A step counter passed as a Python int is the other such reading: static at num_steps > 1,
the same for every step of a call, where k calls of the step under `jax.jit` see k values.
The next call shows it: the int has grown or shrunk by num_steps (`step(t, ...)` in a loop
over `range(0, n, num_steps)`, a countdown), and `refuse` raises, naming per-step indices,
unless the body never reads it (Haiku's LSTM example passes `step` and does not use it).

Only the first `CHECKED_CALLS` calls of a program are recorded, each call's per-step outputs
added to those of the calls before it: a carry is passed back from the second call of its
stream on, where two streams of calls (two agents trained by one step in turn, a method step
on instances in turn) take turns, the call after the other stream's; later calls pay nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import numpy as np

from .._errors import COUNTER_BY_NUM_STEPS, PER_STEP_FED_BACK, OptionError, ShapeError, error

# Calls of one program whose per-step outputs are recorded (and the next one checked): up to
# three streams of calls taking turns show a carry passed back.
CHECKED_CALLS = 4


class FedBack:
    """What a step's calls returned as per-step outputs, and the static Python ints the last
    one took, while its program is new."""

    __slots__ = ("_last", "_shapes", "_numbers", "_program", "_left")

    def __init__(self) -> None:
        # id(array) -> (a weak reference to it, its output index), over the recorded calls
        self._last: dict[int, tuple[weakref.ref[Any], int]] = {}
        # per output index, one step's shapes of its leaves; per parameter, its leaves' shapes
        self._shapes: tuple[dict[int, list[tuple[int, ...]]], dict[str, list[Any]]] = ({}, {})
        # per parameter index, the Python int the last call passed (a static number)
        self._numbers: dict[int, int] = {}
        self._program: Any = None
        self._left = 0

    def remember(self, program: Any, args: tuple[Any, ...], outputs: Any) -> None:
        """After a call: its static Python ints; its per-step outputs, where the program reads
        an argument as per-step by its shapes (else nothing could be passed back there), and
        those arguments' shapes."""
        if program is not self._program:
            self._program, self._left, self._last = program, CHECKED_CALLS, {}
        if self._left <= 0:  # (past the first calls: nothing recorded, nothing made)
            if self._last or self._numbers:
                self._last, self._numbers = {}, {}
            return
        self._left -= 1
        self._numbers = {i: args[i] for i in program.static_numbers if type(args[i]) is int}
        if not (program.by_shape_scanned and outputs):
            return
        last = {i: ref for i, ref in self._last.items() if ref[0]() is not None}
        out_shapes: dict[int, list[tuple[int, ...]]] = {}
        for j in range(len(program.out_positions)):
            leaves = jax.tree_util.tree_leaves(outputs[j])
            out_shapes[j] = [np.shape(x)[1:] for x in leaves]
            for x in leaves:
                if isinstance(x, jax.Array):
                    last[id(x)] = (weakref.ref(x), j)
        names = program.roles.params
        arg_shapes = {
            names[i]: [np.shape(x) for x in jax.tree_util.tree_leaves(args[i])]
            for i in (program.scanned_idx[j] for j in program.by_shape_scanned)
        }
        self._last, self._shapes = last, (out_shapes, arg_shapes)

    def refuse(self, step: Any, program: Any, args: tuple[Any, ...]) -> None:
        """Before a call takes anything: raise an `OptionError` where a static Python int
        moved by num_steps since the last call (a step counter), and a `ShapeError` where an
        argument read as per-step by its shapes holds an array the last call returned as a
        per-step output (in one of the program's first calls) whose one step's value has the
        shapes that argument had then."""
        if program is not self._program:
            return
        k = step.num_steps
        unread = step._analysis.unread  # (a counter the body never reads changes nothing)
        for i, before in self._numbers.items():
            param = program.roles.params[i]
            if (
                k > 1
                and type(args[i]) is int
                and abs(args[i] - before) == k
                and param not in unread
            ):
                _counter(step, param, before, args[i])
        last = self._last
        if not last:
            return
        out_shapes, arg_shapes = self._shapes
        for j in program.by_shape_scanned:
            i = program.scanned_idx[j]
            param = program.roles.params[i]
            for x in jax.tree_util.tree_leaves(args[i]):
                found = last.get(id(x))
                if found is None or found[0]() is not x:
                    continue
                if out_shapes.get(found[1]) == arg_shapes.get(param):
                    _raise(step, program, param, found[1])


def _raise(step: Any, program: Any, param: str, j: int) -> None:
    layout = program.roles.layout
    pos = program.out_positions[j]
    if layout.keys:  # a returned dict: its positions are its keys
        at, option = f"the returned key {layout.keys[pos]!r}", f'state="{param}"'
    else:
        at, option = f"return position {pos}", f'state={{"{param}": {pos}}}'
    raise error(
        ShapeError,
        PER_STEP_FED_BACK,
        step._analysis,
        param=param,
        at=at,
        option=option,
        num_steps=step.num_steps,
    )


def _counter(step: Any, param: str, before: int, now: int) -> None:
    k = step.num_steps
    raise error(
        OptionError,
        COUNTER_BY_NUM_STEPS,
        step._analysis,
        param=param,
        before=before,
        now=now,
        num_steps=k,
        last=before + k - 1 if now > before else before - k + 1,
    )
