"""Programs: one generated, loaded function per set of roles.

A `Program` is one generated, loaded function for one set of roles (`Programs` keeps a step's
programs: the one from the source and options, and one per set of Flax NNX modules that a
call passes as per-step inputs). `Programs.for_args` settles the roles of a call's argument
types once (`_roles.infer`) and keeps the resulting `Plan`; a first call's abstract
evaluation of one step is served by a trial trace of the program (`trial.Trial`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from .._analysis.analysis import Analysis
from .._codegen import loading as _loading
from .._codegen.generate import GeneratedCode, generate
from .._handles.lazy import LazyHandle
from .._roles.abstract import one_step_from
from .._roles.infer import arg_kinds, infer
from .._roles.roles import Options, Role, Roles, assign_roles
from .tracing import HELPERS


class Program:
    """One generated, loaded function for one set of roles, and where each role's arguments
    are in the parameter list."""

    __slots__ = (
        "roles",
        "generated",
        "fn",
        "filename",
        "state_idx",
        "scanned_idx",
        "bcast_idx",
        "static_idx",
        "static_unread",
        "written_back_idx",
        "given_back_idx",
        "instance_idx",
        "instance_attrs",
        "instance_pos",
        "static_names",
        "by_shape_bcast",
        "by_shape_scanned",
        "static_numbers",
        "out_positions",
        "__weakref__",
    )

    def __init__(
        self,
        roles: Roles,
        generated: GeneratedCode,
        fn: Callable[..., Any],
        filename: str,
        instance: str | None = None,
        instance_attrs: tuple[str, ...] = (),
        unread: frozenset[str] = frozenset(),
    ):
        self.roles = roles
        self.generated = generated
        self.fn = fn
        self.filename = filename
        idx = {p: i for i, p in enumerate(roles.params)}
        self.state_idx = tuple(idx[p] for p in roles.state)
        self.scanned_idx = tuple(idx[p] for p in roles.of("scanned"))
        self.bcast_idx = tuple(idx[p] for p in roles.of("broadcast"))
        self.static_idx = tuple(idx[p] for p in roles.of("static"))
        # Static parameters the body never reads (Haiku's `update(step, params, ...)`): their
        # values select no compiled version (`static_values`).
        self.static_unread = frozenset(k for k, p in enumerate(roles.of("static")) if p in unread)
        # Broadcast arguments read so by their shapes (rule `no-leading-axis`): positions among
        # `bcast_idx`, checked in every trace (`tracing.refuse_per_step_arrays`).
        rules = dict(zip(roles.params, roles.rules, strict=True))
        self.by_shape_bcast = tuple(
            k for k, p in enumerate(roles.of("broadcast")) if rules[p] == "no-leading-axis"
        )
        # Per-step arguments read so by their shapes (rule `leading-axis`): positions among
        # `scanned_idx`, checked at the program's first calls against the last call's per-step
        # outputs (`fed_back`); and the return position of each per-step output.
        self.by_shape_scanned = tuple(
            k for k, p in enumerate(roles.of("scanned")) if rules[p] == "leading-axis"
        )
        # Python numbers made static by their type (rule `python-scalar`): a step counter among
        # them shows at the next call (`fed_back`).
        self.static_numbers = tuple(
            idx[p] for p in roles.of("static") if rules[p] == "python-scalar"
        )
        self.out_positions = tuple(
            q for q, (kind, _) in enumerate(roles.layout.entries) if kind == "out"
        )
        # (state position, parameter index) of state written back into the caller's object.
        self.written_back_idx = tuple((roles.state.index(p), idx[p]) for p in roles.written_back)
        # (state position, parameter index) of those among them returned as the caller's
        # object (`Roles.given_back`).
        self.given_back_idx = tuple((roles.state.index(p), idx[p]) for p in roles.given_back)
        # A method step's instance and the attributes its body reads (`self.lr`): when the
        # instance is a plain object (not a pytree), their values are part of the call's
        # static key, so a changed attribute recompiles instead of being frozen.
        self.instance_idx = idx[instance] if instance is not None else -1
        self.instance_attrs = instance_attrs if instance is not None else ()
        # Where the instance is among the broadcast arguments (-1: not broadcast, or none).
        self.instance_pos = (
            self.bcast_idx.index(self.instance_idx) if self.instance_idx in self.bcast_idx else -1
        )
        self.static_names = roles.of("static") + tuple(f"{instance}.{a}" for a in instance_attrs)

    def static_values(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The static arguments' values that select a compiled version (None for one the
        body never reads)."""
        if not self.static_unread:
            return tuple(args[i] for i in self.static_idx)
        return tuple(
            None if k in self.static_unread else args[i] for k, i in enumerate(self.static_idx)
        )

    def result(self, handles: list[Any], outputs: Any) -> Any:
        """What the step returns: its state (as handles) and outputs, in the user's order."""
        layout = self.roles.layout
        if layout.kind == "none":
            return None
        return layout.build(
            [handles[j] if kind == "state" else outputs[j] for kind, j in layout.entries]
        )


class Programs:
    """The programs of one step, generated on first use and kept for its lifetime."""

    def __init__(
        self, analysis: Analysis, options: Options, user_fn: Callable[..., Any], num_steps: int
    ) -> None:
        self.analysis = analysis
        self.options = options
        self.user_fn = user_fn
        self.num_steps = num_steps
        self._by_roles: dict[Roles, Program] = {}
        self._made = 0  # programs generated, for their file names (one may be dropped)
        self._plans: dict[Any, Plan] = {}
        # Roles from the source and options alone; made now so bad returns fail at decoration.
        self.base = self.get(assign_roles(analysis, options))

    def get(self, roles: Roles) -> Program:
        """The program of `roles`, generated and loaded on first use."""
        program = self._by_roles.get(roles)
        if program is None:
            index = self._made
            self._made += 1
            analysis = self.analysis
            generated = generate(
                analysis,
                roles,
                self.num_steps,
                self.user_fn.__globals__,  # type: ignore[attr-defined]
                self.user_fn.__code__.co_freevars,  # type: ignore[attr-defined]
                index,
            )
            filename = _loading.filename_for(
                analysis.funcdef.name.value, index, analysis.filename, analysis.def_line
            )
            fn = _loading.load(generated, self.user_fn, HELPERS, filename)
            instance = self.options.instance
            attrs = tuple(a for q, a in analysis.attribute_reads if q == instance)
            program = self._by_roles[roles] = Program(
                roles, generated, fn, filename, instance, attrs, analysis.unread
            )
        return program

    def for_args(
        self, args: tuple[Any, ...], may_mutate: bool, trial: TrialMaker | None = None
    ) -> Plan:
        """The plan for a call: roles are inferred at the first call with arguments of these
        types (`_infer`) and kept for every later one. An abstract evaluation that the
        inference asks for comes from the trial `trial(self, args, may_mutate)` makes, where
        it can (`trial.Trial`)."""
        key = (arg_kinds(args, LazyHandle), may_mutate)
        plan = self._plans.get(key)
        if plan is None:
            made = None if trial is None else trial(self, args, may_mutate)
            try:
                with one_step_from(None if made is None else made.serve):
                    inferred = infer(
                        self.analysis, self.options, self.num_steps, self.user_fn, args, may_mutate
                    )
                program = self.get(inferred.roles)
            except BaseException:
                if made is not None:
                    made.settle(None, ())
                raise
            if made is not None:
                made.settle(program, inferred.to_array)
            plan = self._plans[key] = Plan(
                program, inferred.to_array, [None] * len(inferred.roles.state)
            )
        return plan

    def has(self, roles: Roles) -> bool:
        return roles in self._by_roles

    def drop(self, program: Program) -> None:
        """Forget `program` (a trial's, which no plan took)."""
        if self._by_roles.get(program.roles) is program:
            del self._by_roles[program.roles]

    def all(self) -> list[Program]:
        return list(self._by_roles.values())


class Trial(Protocol):
    """What `Programs.for_args` asks of a first call's trial (`trial.Trial`)."""

    def serve(
        self, fn: Callable[..., Any], values: dict[str, Any], roles: dict[str, Role], n: int
    ) -> tuple[Any] | None: ...

    def settle(self, program: Program | None, to_array: tuple[tuple[int, ...], ...]) -> None: ...


# (programs, args, may_mutate) -> the call's trial
TrialMaker = Callable[["Programs", tuple[Any, ...], bool], Trial]


class Plan(NamedTuple):
    """What the first call with arguments of some types settled for every later one.

    - `program`: the generated program;
    - `to_array`: per state position, the leaves that are Python scalars at the first call
      and become arrays (`_scalars.scalars_to_array`);
    - `firsts`: per state position, the structure of the first call's value (set by that
      call): a later value of the same tree with a Python number where the first had an
      array has it made an array again (`_call._take_state`).
    """

    program: Program
    to_array: tuple[tuple[int, ...], ...]
    firsts: list[Any]
