"""What a decorated step tells about itself: its counters and the recompile warning.

`Stats` counts calls, fast-path hits, host flattens, copies, traces, rebuilds and the
operations on packed leaves run leaf by leaf (the user reads a snapshot with
`autoflat.stats(fn)`). `Diagnostics` holds one step's `Stats` and notes every trace: what
changed since the previous one, and, once a step has been traced `RECOMPILE_WARN_AFTER`
times, the `AutoflatRecompileWarning` that the step's next call issues before it takes
anything.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax

from .. import _jax

RECOMPILE_WARN_AFTER = 8
CHANGES_KEPT = 16  # causes of recompiles kept per step (`autoflat.profile` reports them)


class AutoflatRecompileWarning(UserWarning):
    """Warned when one decorated step keeps being traced and compiled again."""


AutoflatRecompileWarning.__module__ = "autoflat"


@dataclasses.dataclass
class Stats:
    """Counters of one decorated step function.

    - `calls`: calls of the step.
    - `fast_path`: state arguments taken with no host flatten: lazy handles, and Flax NNX
      objects unchanged since this step's last call.
    - `flattens`: host-side `tree_flatten`s of state and broadcast arguments (a broadcast
      argument that is one array is not counted: it has no tree).
    - `copies`: state arguments copied before donation (they were not autoflat's own), or
      packed into fresh buffers.
    - `traces`: traces of the generated function for a call or `lower` (each is followed by
      an XLA compile).
    - `rebuilds`: lazy handles from this step rebuilt into real objects.
    - `leaf_by_leaf`: operations on packed leaves that the step's whole-buffer evaluation
      does not run on the packed buffer (not elementwise: a matmul, a sort), so it cuts their
      leaves out and runs them leaf by leaf; counted at each trace (0 when nothing is packed).
    """

    calls: int = 0
    fast_path: int = 0
    flattens: int = 0
    copies: int = 0
    traces: int = 0
    rebuilds: int = 0
    leaf_by_leaf: int = 0

    def snapshot(self) -> Stats:
        return dataclasses.replace(self)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


class Diagnostics:
    """One step's counters and its record of traces (see the module doc)."""

    __slots__ = ("stats", "qualname", "where", "changes", "_last_key", "_warned", "_pending")

    def __init__(self, qualname: str, where: str) -> None:
        self.stats = Stats()
        self.qualname = qualname
        self.where = where
        self.changes: list[str] = []  # why each trace after the first happened, the last few
        self._last_key: Any = None
        self._warned = False
        self._pending: str | None = None

    def note_trace(self, spec: Any, inputs: Any) -> Stats:
        """Called while tracing `spec` with `inputs` (the leaves the compiled program takes);
        gives the counters that the trace adds to."""
        self.stats.traces += 1
        # (leaves and their tree apart: mapped back into the tree, a user's class would be
        # rebuilt around these tuples, and its own checks may refuse them: jmp's loss scales)
        leaves, tree = jax.tree_util.tree_flatten(inputs)
        shapes = (tree, tuple((t.shape, t.dtype, _jax.weak_type(t)) for t in leaves))
        key = (spec, shapes)
        change = describe_change(self._last_key, key) if self._last_key is not None else ""
        if change:
            self.changes[: -CHANGES_KEPT + 1] = []
            self.changes.append(change)
        self._last_key = key
        if self.stats.traces >= RECOMPILE_WARN_AFTER and not self._warned:
            self._warned = True
            # Issued by `warn_if_pending` at the start of the step's next call, before that
            # call takes anything: if the caller's filters make it an error, the results of
            # this call are bound and the next call's arguments untouched.
            self._pending = (
                f"autoflat: `{self.qualname}` ({self.where}) has been traced and "
                f"compiled {self.stats.traces} times; the last change was: {change}. "
                "Keep structures, static arguments and input shapes fixed between calls (pad "
                "the final batch, keep counters as arrays), or this step recompiles often."
            )
        return self.stats

    def warn_if_pending(self, stacklevel: int) -> None:
        if self._pending is not None:
            message, self._pending = self._pending, None
            warnings.warn(message, AutoflatRecompileWarning, stacklevel=stacklevel + 1)

    def forget_traces(self) -> None:
        self._last_key = None


def describe_change(old: Any, new: Any) -> str:
    """What differs between two traces' (spec, input shapes), in words."""
    old_spec, old_shapes = old
    new_spec, new_shapes = new
    names = new_spec.program.roles.state
    if old_spec.program is not new_spec.program:
        return "the roles of the parameters (a mutable module appeared or went away)"
    for n, a, b in zip(names, old_spec.structures, new_spec.structures, strict=False):
        if a is not b:
            return f"the structure of state `{n}`"
    for n, a, b in zip(
        new_spec.program.roles.of("broadcast"),
        old_spec.bcast_structures,
        new_spec.bcast_structures,
        strict=False,
    ):
        if a is not b:
            return f"the structure of broadcast argument `{n}`"
    for n in new_spec.static:
        if old_spec.static.get(n, object()) != new_spec.static[n]:
            old_value, new_value = old_spec.static.get(n), new_spec.static[n]
            return f"the value of static argument `{n}` ({old_value!r} -> {new_value!r})"
    if old_spec.placements != new_spec.placements:
        return "the sharding of the state"
    if old_spec.layouts != new_spec.layouts:
        return "the packing of the state"
    if old_spec.links != new_spec.links:
        return "which Flax NNX Variables the state arguments share"
    if old_shapes != new_shapes:
        return "the shapes, dtypes or weak types of the inputs"
    return "nothing autoflat can see (the jit cache was cleared?)"
