"""A first call's trial: its abstract evaluation of one step, taken from the program's trace.

A first call whose role inference evaluates one step abstractly (`_roles.abstract`) takes that
evaluation from a trace of the program it is about to run (`Trial`): the program of the roles
the source and the arguments' types give, traced under the step's own `jax.jit` for the call's
spec and abstract inputs. Where the inference then settles on those very roles, the call's
launch finds that trace in JAX's cache: the step is traced once, as under `jax.jit`. Else the
trial is undone (its trace not counted, its spec and program dropped) and the call goes on as
it would have.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .._handles.lazy import LazyHandle
from .._handles.writeback import is_mutable_module
from .._roles.roles import Role, Roles, assign_roles
from .._roles.rules import Call, defaulted
from .._transport.host import host_layout, mode_for, pack_on_device
from .._transport.structure import flatten, is_array, placement_of
from .program import Program, Programs
from .specs import CallSpec
from .tracing import capturing


class Trial:
    """A first call's program traced before its roles are settled (see the module doc).

    `serve` is what `eval_one_step` asks during the call's inference (`one_step_from`). The
    first time it is asked with roles that evaluate the step as the program of the tentative
    roles runs it (the roles of rules 1 to 12 with nothing matched: the same static and
    per-step parameters; state and broadcast are alike to one step), it traces that program
    for the call under the step's `jax.jit`, capturing one step's return value
    (`tracing.capturing`), and serves it from then on. Only for arguments whose spec and
    inputs it can make as `_runtime.call.prepare` makes them (`dry_call`): no handle, no
    Flax NNX object or other state written back, no method's instance, no `lazy=False`
    objects. `settle` keeps the trace if the inference settled on those roles, else undoes
    it. A step makes its trials with `maker`."""

    def __init__(self, programs: Programs, args: tuple[Any, ...], may_mutate: bool, step: Any):
        self.programs, self.step, self.args, self.may_mutate = programs, step, args, may_mutate
        self.asked = False  # whether the tentative roles were made
        self.roles: Roles | None = None  # the tentative roles, where a trial can be made
        self.program: Program | None = None  # the tentative roles' program, once traced
        self.new = False  # whether that program was generated for the trial
        self.spec: CallSpec | None = None
        self.out: tuple[Any] | None = None  # one step's abstract output, once captured
        self.saved: tuple[Any, ...] = ()  # the step's diagnostics before the trace

    def serve(
        self, fn: Callable[..., Any], values: dict[str, Any], roles: dict[str, Role], n: int
    ) -> tuple[Any] | None:
        programs = self.programs
        if fn is not programs.user_fn or n != programs.num_steps:
            return None
        tentative = self._tentative()
        if tentative is None or not alike(tentative, roles):
            return None
        if self.program is None:
            self._trace(tentative)
        return self.out

    def _tentative(self) -> Roles | None:
        if self.asked:
            return self.roles
        self.asked = True
        programs, args, step = self.programs, self.args, self.step
        options = programs.options
        if options.instance is not None or step._last or LazyHandle in map(type, args):
            return None
        values = dict(zip(programs.analysis.param_names, args, strict=True))
        k = programs.num_steps
        call = Call(
            values,
            k,
            self.may_mutate,
            defaults=defaulted(programs.user_fn, values) if k > 1 else frozenset(),
            state_at=dict(options.state_at),
        )
        try:
            roles = assign_roles(programs.analysis, options, call)
        except Exception:
            return None  # a parameter no rule settles without matching: refused by `infer`
        if roles.written_back or roles.layout.kind == "unpacked":
            return None
        if any(is_mutable_module(values[p]) for p in roles.state):
            return None
        self.roles = roles
        return roles

    def _trace(self, roles: Roles) -> None:
        programs, step = self.programs, self.step
        diag = step._diag
        stats = diag.stats
        # (saved in one statement, before `program` is set: `settle` restores them once it is,
        # whatever line an interrupt comes at)
        self.saved = (
            stats.traces,
            stats.leaf_by_leaf,
            diag._last_key,
            list(diag.changes),
            diag._warned,
            diag._pending,
        )
        self.new = not programs.has(roles)
        self.program = programs.get(roles)
        try:
            self.spec, inputs = dry_call(step, self.program, self.args)
            with capturing(self.spec) as found:
                step._jit.trace(self.spec, *inputs)
        except Exception:
            return  # the inference evaluates the step itself, and says what is wrong
        if found:
            self.out = (found[0],)

    def settle(self, program: Program | None, to_array: tuple[tuple[int, ...], ...]) -> None:
        """Keep the trial's trace if the call runs its program with state taken as the trial
        took it (no Python scalar made an array), else undo it."""
        if self.program is None:
            return
        if self.out is not None and program is self.program and not any(to_array):
            return
        diag, step = self.step._diag, self.step
        stats = diag.stats
        stats.traces, stats.leaf_by_leaf, diag._last_key, diag.changes[:] = self.saved[:4]
        diag._warned, diag._pending = self.saved[4:]
        if self.spec is not None:
            step._specs.forget(self.spec)
        if self.new and program is not self.program:
            self.programs.drop(self.program)


def alike(tentative: Roles, roles: dict[str, Role]) -> bool:
    """Whether the roles an abstract evaluation takes evaluate the step as the program of
    `tentative` runs it: the same static and per-step parameters (state and broadcast are
    alike to one step)."""
    for p, role in zip(tentative.params, tentative.roles, strict=True):
        other = roles[p]
        if role != other and {role, other} & {"static", "scanned"}:
            return False
    return True


def dry_call(
    step: Any, program: Program, args: tuple[Any, ...]
) -> tuple[CallSpec, tuple[Any, ...]]:
    """The spec and the inputs of the compiled program that `_runtime.call.prepare` makes for
    a first call of `program` with `args` (no handle, no state written back, no method's
    instance), but with the caller's own arrays where it would copy them (the same abstract
    values: a trace takes nothing)."""
    structures, leaves, placements, layouts = [], [], [], []
    mode = mode_for(step.pack, False, step.num_steps)
    for i in program.state_idx:
        a = args[i]
        structure, arrays = flatten(a)
        placement = placement_of(arrays)
        layout = None if is_array(a) else host_layout(arrays, placement, mode)
        structures.append(structure)
        placements.append(placement)
        layouts.append(layout)
        if layout is None:
            leaves.append(arrays)
        else:
            calls = layout.host_calls[0]
            leaves.append(pack_on_device(layout, arrays))
            layout.host_calls[0] = calls  # (not one of the call's own packs: `_HOST_CALLS`)
    broadcast = [flatten(args[i]) for i in program.bcast_idx]
    static = program.static_values(args)
    spec = step._specs.get(
        program, structures, placements, layouts, None, [s for s, _ in broadcast], static
    )
    xs = tuple(args[i] for i in program.scanned_idx)
    return spec, (tuple(leaves), xs, tuple(a for _, a in broadcast))


def maker(step: Any) -> Callable[[Programs, tuple[Any, ...], bool], Trial]:
    """What makes the first-call trials of `step` (`Programs.for_args`)."""
    return functools.partial(Trial, step=step)
