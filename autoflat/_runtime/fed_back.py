"""A per-step input read so by its shapes, given back what the step returned as a per-step
output the call before: a carry that was sliced per step.

At num_steps > 1 an argument whose every array leads with num_steps is read as per-step
(rule `leading-axis`). A carry of num_steps rows (an episode return over num_steps
environments, a recurrent state of a batch of num_steps) type-checks read so too: each step
gets one row, and the value the step gives back is stacked as a per-step output, of the same
shape. Nothing in the first call tells the two apart; the calls after it do: a carry's new
value is passed back in, per-step data is not. `FedBack` keeps the last call's per-step
output arrays (weakly, by identity) and `refuse` raises where a later call passes one of them
back at such a parameter, before anything of that call is taken.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax

from .._errors import PER_STEP_FED_BACK, ShapeError, error


class FedBack:
    """The array leaves of a step's last per-step outputs, each with its return position."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        # id(array) -> (weak reference to it, its return position)
        self._last: dict[int, tuple[weakref.ref[Any], int]] = {}

    def remember(self, program: Any, outputs: Any) -> None:
        """After a call: its per-step outputs, where the program reads an argument as per-step
        by its shapes (else nothing could be passed back there)."""
        last: dict[int, tuple[weakref.ref[Any], int]] = {}
        if program.by_shape_scanned and outputs:
            for j, pos in enumerate(program.out_positions):
                for x in jax.tree_util.tree_leaves(outputs[j]):
                    if isinstance(x, jax.Array):
                        last[id(x)] = (weakref.ref(x), pos)
        self._last = last

    def refuse(self, step: Any, program: Any, args: tuple[Any, ...]) -> None:
        """Before a call takes anything: raise a `ShapeError` where an argument read as
        per-step by its shapes holds an array the last call returned as a per-step output."""
        last = self._last
        if not last:
            return
        for j in program.by_shape_scanned:
            i = program.scanned_idx[j]
            for x in jax.tree_util.tree_leaves(args[i]):
                found = last.get(id(x))
                if found is not None and found[0]() is x:
                    self._raise(step, program, program.roles.params[i], found[1])

    @staticmethod
    def _raise(step: Any, program: Any, param: str, pos: int) -> None:
        k = step.num_steps
        raise error(ShapeError, PER_STEP_FED_BACK, step._analysis, param=param, pos=pos, num_steps=k)
