"""Programs, call specs and the spec cache.

A `Program` is one generated, loaded function for one set of roles (`Programs` keeps a step's
programs: the one from the source and options, and one per set of Flax NNX modules that a
call passes as per-step inputs). A `CallSpec` is everything static about a call: the program,
the structures, placements and layouts of the state, the broadcast structures, the static
arguments. It is interned by `SpecCache` and is the static argument of the step's single
`jax.jit` of `_entry.entry`, so JAX's own cache gives one compile per distinct (spec, input
shapes).

A method step's instance that is a plain object (not a pytree) is part of its specs' keys,
held weakly (`instance.Instance`); when it is freed, its specs leave the cache (`_freed`).

A first call whose role inference evaluates one step abstractly (`_roles.abstract`) takes that
evaluation from a trace of the program it is about to run (`_Trial`): the program of the roles
the source and the arguments' types give, traced under the step's own `jax.jit` for the call's
spec and abstract inputs. Where the inference then settles on those very roles, the call's
launch finds that trace in JAX's cache: the step is traced once, as under `jax.jit`. Else the
trial is undone (its trace not counted, its spec and program dropped) and the call goes on as
it would have.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from .._analysis.analysis import Analysis
from .._codegen import loading as _loading
from .._codegen.generate import GeneratedCode, generate
from .._errors import UNHASHABLE_STATIC, CallError, Location, error
from .._handles.lazy import LazyHandle
from .._handles.nnx import Link
from .._handles.writeback import is_mutable_module
from .._roles.abstract import one_step_from
from .._roles.infer import arg_kinds, infer
from .._roles.roles import Options, Role, Roles, assign_roles
from .._roles.rules import Call, defaulted
from .._transport.layout import Layout, PackMode, host_layout, mode_for, pack_on_device
from .._transport.structure import Placement, Structure, flatten, is_array, placement_of
from .instance import Instance
from .tracing import HELPERS, capturing


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
        "written_back_idx",
        "instance_idx",
        "instance_attrs",
        "instance_pos",
        "static_names",
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
        # (state position, parameter index) of state written back into the caller's object.
        self.written_back_idx = tuple((roles.state.index(p), idx[p]) for p in roles.written_back)
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

    def result(self, handles: list[Any], outputs: Any) -> Any:
        """What the step returns: its state (as handles) and outputs, in the user's order."""
        shape = self.roles.layout.kind
        if shape == "none":
            return None
        items = [
            handles[j] if kind == "state" else outputs[j] for kind, j in self.roles.layout.entries
        ]
        if self.roles.layout.keys:
            return dict(zip(self.roles.layout.keys, items, strict=True))
        return items[0] if shape == "single" else tuple(items)


class Programs:
    """The programs of one step, generated on first use and kept for its lifetime."""

    def __init__(
        self, analysis: Analysis, options: Options, user_fn: Callable[..., Any], num_steps: int
    ) -> None:
        self._analysis = analysis
        self._options = options
        self._user_fn = user_fn
        self._num_steps = num_steps
        self._by_roles: dict[Roles, Program] = {}
        self._made = 0  # programs generated, for their file names (one may be dropped)
        self._plans: dict[Any, Plan] = {}
        # Roles from the source and options alone; made now so bad returns fail at decoration.
        self.base = self._get(assign_roles(analysis, options))

    def _get(self, roles: Roles) -> Program:
        program = self._by_roles.get(roles)
        if program is None:
            index = self._made
            self._made += 1
            analysis = self._analysis
            generated = generate(
                analysis,
                roles,
                self._num_steps,
                self._user_fn.__globals__,  # type: ignore[attr-defined]
                self._user_fn.__code__.co_freevars,  # type: ignore[attr-defined]
                index,
            )
            filename = _loading.filename_for(
                analysis.funcdef.name.value, index, analysis.filename, analysis.def_line
            )
            fn = _loading.load(generated, self._user_fn, HELPERS, filename)
            instance = self._options.instance
            attrs = tuple(a for q, a in analysis.attribute_reads if q == instance)
            program = self._by_roles[roles] = Program(
                roles, generated, fn, filename, instance, attrs
            )
        return program

    def for_args(self, args: tuple[Any, ...], may_mutate: bool, step: Any = None) -> Plan:
        """The plan for a call: roles are inferred at the first call with arguments of these
        types (`_infer`) and kept for every later one. Given the `step` calling, an abstract
        evaluation that the inference asks for comes from a trace of the program the call
        will run, where it can (`_Trial`)."""
        key = (arg_kinds(args, LazyHandle), may_mutate)
        plan = self._plans.get(key)
        if plan is None:
            trial = None if step is None else _Trial(self, step, args, may_mutate)
            try:
                with one_step_from(None if trial is None else trial.serve):
                    inferred = infer(
                        self._analysis,
                        self._options,
                        self._num_steps,
                        self._user_fn,
                        args,
                        may_mutate,
                    )
                program = self._get(inferred.roles)
            except BaseException:
                if trial is not None:
                    trial.settle(None, ())
                raise
            if trial is not None:
                trial.settle(program, inferred.to_array)
            plan = self._plans[key] = Plan(
                program, inferred.to_array, [None] * len(inferred.roles.state)
            )
        return plan

    def drop(self, program: Program) -> None:
        """Forget `program` (a trial's, which no plan took)."""
        if self._by_roles.get(program.roles) is program:
            del self._by_roles[program.roles]

    def all(self) -> list[Program]:
        return list(self._by_roles.values())


class _Trial:
    """A first call's program traced before its roles are settled (see the module doc).

    `serve` is what `eval_one_step` asks during the call's inference (`one_step_from`). The
    first time it is asked with roles that evaluate the step as the program of the tentative
    roles runs it (the roles of rules 1 to 12 with nothing matched: the same static and
    per-step parameters; state and broadcast are alike to one step), it traces that program
    for the call under the step's `jax.jit`, capturing one step's return value
    (`tracing.capturing`), and serves it from then on. Only for arguments whose spec and
    inputs it can make as `_runtime.call.prepare` makes them (`_dry_call`): no handle, no
    Flax NNX object or other state written back, no method's instance, no `lazy=False`
    objects. `settle` keeps the trace if the inference settled on those roles, else undoes
    it."""

    def __init__(self, programs: Programs, step: Any, args: tuple[Any, ...], may_mutate: bool):
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
        if fn is not programs._user_fn or n != programs._num_steps:
            return None
        tentative = self._tentative()
        if tentative is None or not _alike(tentative, roles):
            return None
        if self.program is None:
            self._trace(tentative)
        return self.out

    def _tentative(self) -> Roles | None:
        if self.asked:
            return self.roles
        self.asked = True
        programs, args, step = self.programs, self.args, self.step
        options = programs._options
        if options.instance is not None or step._last or LazyHandle in map(type, args):
            return None
        values = dict(zip(programs._analysis.param_names, args, strict=True))
        k = programs._num_steps
        call = Call(
            values,
            k,
            self.may_mutate,
            defaults=defaulted(programs._user_fn, values) if k > 1 else frozenset(),
            state_at=dict(options.state_at),
        )
        try:
            roles = assign_roles(programs._analysis, options, call)
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
        self.new = roles not in programs._by_roles
        self.program = programs._get(roles)
        diag = step._diag
        stats = diag.stats
        self.saved = (stats.traces, stats.leaf_by_leaf, diag._last_key, list(diag.changes))
        self.saved += (diag._warned, diag._pending)
        try:
            self.spec, inputs = _dry_call(step, self.program, self.args)
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


def _alike(tentative: Roles, roles: dict[str, Role]) -> bool:
    """Whether the roles an abstract evaluation takes evaluate the step as the program of
    `tentative` runs it: the same static and per-step parameters (state and broadcast are
    alike to one step)."""
    for p, role in zip(tentative.params, tentative.roles, strict=True):
        other = roles[p]
        if role != other and {role, other} & {"static", "scanned"}:
            return False
    return True


def _dry_call(
    step: Any, program: Program, args: tuple[Any, ...]
) -> tuple[CallSpec, tuple[Any, ...]]:
    """The spec and the inputs of the compiled program that `_runtime.call.prepare` makes for
    a first call of `program` with `args` (no handle, no state written back, no method's
    instance), but with the caller's own arrays where it would copy them (the same abstract
    values: a trace takes nothing)."""
    structures, leaves, placements, layouts = [], [], [], []
    for i in program.state_idx:
        a = args[i]
        structure, arrays = flatten(a)
        placement = placement_of(arrays)
        layout = None if is_array(a) else host_layout(arrays, placement, mode_for(step.pack, False))
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
    static = tuple(args[i] for i in program.static_idx)
    spec = step._specs.get(
        program, structures, placements, layouts, None, [s for s, _ in broadcast], static
    )
    xs = tuple(args[i] for i in program.scanned_idx)
    return spec, (tuple(leaves), xs, tuple(a for _, a in broadcast))


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


class CallSpec:
    """Everything static about one call; interned by `SpecCache`, compared by identity.

    JAX's caches keep the static arguments of the calls they traced after the step is gone, so
    a spec holds its program weakly (the step's `Programs` holds it) and its function's name
    and location rather than its source analysis: a dropped step leaves only this small
    object behind."""

    __slots__ = (
        "_program",
        "structures",
        "placements",
        "layouts",
        "links",
        "bcast_structures",
        "static",
        "num_steps",
        "unroll",
        "pack",
        "fn",
        "keeps_inputs",
        "calls_back",
        "landing",
        "__weakref__",
    )

    def __init__(
        self,
        program: Program,
        structures: tuple[Structure, ...],
        placements: tuple[Placement | None, ...],
        layouts: tuple[Layout | None, ...],
        links: tuple[Link | None, ...] | None,
        bcast_structures: tuple[Structure, ...],
        static: dict[str, Any],
        num_steps: int,
        unroll: int | bool,
        pack: PackMode,
        fn: Analysis,
    ) -> None:
        self._program = weakref.ref(program)
        self.structures = structures
        self.placements = placements
        self.layouts = layouts
        self.links = links  # Flax NNX Variables shared between state arguments (`_nnx.Link`)
        self.bcast_structures = bcast_structures
        self.static = static
        self.num_steps = num_steps
        self.unroll = unroll
        self.pack = pack
        self.fn = Location(fn.name, fn.where)  # the step's name and location, for messages
        # Whether it runs without donation (set at its first trace; see `_launch.runner`): the
        # program calls back to the host (`calls_back`: it can fail after its inputs are
        # gone), or a state output cannot reuse its input's buffers.
        self.keeps_inputs: bool | None = None
        self.calls_back = False  # the program calls back to the host (set with keeps_inputs)
        # What the program's flat result stands for (set at its first trace; see
        # `_entry.flat_result`): per state output its (structure, layout), the outputs' treedef.
        self.landing: tuple[tuple[tuple[Structure, Layout | None], ...], Any] | None = None

    @property
    def program(self) -> Program:
        program = self._program()
        assert program is not None, "a CallSpec outlived its step"
        return program

    def __repr__(self) -> str:
        return f"CallSpec({self.fn.name}, static={self.static})"


class SpecCache:
    """A step's interned `CallSpec`s, keyed by their parts (structures are interned, so the
    key compares by identity except for static arguments, which compare by value).

    A method step's plain-object instance is in the key as an `Instance`, which holds it
    weakly: when it is freed, its specs are dropped (`_freed`). JAX's cache still holds their
    compiled programs, with the arrays the body read from the instance as constants; the next
    compile that finds no spec left (a loop making a new instance each time) starts the step's
    `jax.jit`s afresh (`renew`), which costs no compile, and lets those go too."""

    def __init__(
        self,
        analysis: Analysis,
        num_steps: int,
        unroll: int | bool,
        pack: PackMode,
        renew: Callable[[], None] | None = None,
    ) -> None:
        self._analysis = analysis
        self._num_steps = num_steps
        self._unroll = unroll
        self._pack = pack
        self._renew = renew
        self._specs: dict[Any, CallSpec] = {}
        # Plain-object instances by id, and the keys of each one's specs (`_instance`).
        self._instances: dict[int, Instance] = {}
        self._owned: dict[int, list[Any]] = {}
        self._stale = False  # JAX's cache holds programs of instances since freed

    def get(
        self,
        program: Program,
        structures: list[Structure],
        placements: list[Placement | None],
        layouts: list[Layout | None],
        links: tuple[Link | None, ...] | None,
        bcast_structures: list[Structure],
        static: tuple[Any, ...],
    ) -> CallSpec:
        j = program.instance_pos
        instance = None
        if j >= 0 and bcast_structures[j].root_type is None:
            s = bcast_structures[j]
            if s.n_arrays == 0:  # a plain object (a static leaf): held weakly, by identity
                instance = self._instance(s)
                bcast_structures = [*bcast_structures]
                bcast_structures[j] = instance.structure
        key = (program, *structures, *placements, *layouts, links, *bcast_structures, *static)
        try:
            spec = self._specs.get(key)
        except TypeError:
            raise self._unhashable(program, static) from None
        if spec is None:
            if self._stale and not self._specs and self._renew is not None:
                self._stale = False
                self._renew()
            spec = self._specs[key] = CallSpec(
                program,
                tuple(structures),
                tuple(placements),
                tuple(layouts),
                links,
                tuple(bcast_structures),
                dict(zip(program.static_names, static, strict=True)),
                self._num_steps,
                self._unroll,
                self._pack,
                self._analysis,
            )
            if instance is not None:
                self._owned.setdefault(instance.oid, []).append(key)
        return spec

    def _instance(self, structure: Structure) -> Instance:
        """The `Instance` of the object that `structure` (a single static leaf) holds."""
        obj = structure.static_leaves[0]
        instance = self._instances.get(id(obj))
        if instance is None or instance.ref() is not obj:
            self._owned.pop(id(obj), None)
            free = functools.partial(_freed, weakref.ref(self), id(obj))
            instance = self._instances[id(obj)] = Instance(obj, structure, free)
        return instance

    def free(self, oid: int) -> None:
        """Forget the specs of the instance that had id `oid`, now freed."""
        self._instances.pop(oid, None)
        for key in self._owned.pop(oid, ()):
            spec = self._specs.pop(key, None)
            if spec is not None and spec.keeps_inputs is not None:  # it was traced
                self._stale = True

    def forget(self, spec: CallSpec) -> None:
        """Drop `spec` (a first call's trial, which the call does not run)."""
        for key in [key for key, found in self._specs.items() if found is spec]:
            del self._specs[key]

    def _unhashable(self, program: Program, static: tuple[Any, ...]) -> Exception:
        for p, v in zip(program.static_names, static, strict=True):
            try:
                hash(v)
            except TypeError:
                return error(
                    CallError, UNHASHABLE_STATIC, self._analysis, param=p, type=type(v).__name__
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def clear(self) -> None:
        self._specs.clear()
        self._instances.clear()
        self._owned.clear()
        self._stale = False


def _freed(cache: weakref.ref[SpecCache], oid: int, ref: Any) -> None:
    """The weak reference callback of an `Instance` (run when its object is freed)."""
    specs = cache()
    if specs is not None:
        specs.free(oid)
