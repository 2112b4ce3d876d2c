"""Programs, call specs, the spec cache, and the traced entry that `jax.jit` compiles.

A `Program` is one generated, loaded function for one set of roles (`Programs` keeps a step's
programs: the one from the source and options, and one per set of Flax NNX modules that a
call passes as per-step inputs). A `CallSpec` is everything static about a call: the program,
the structures, placements and layouts of the state, the broadcast structures, the static
arguments. It is interned by `SpecCache` and is the static argument of the step's single
`jax.jit` of `entry`, so JAX's own cache gives one compile per distinct (spec, input shapes).

`entry` is what is traced: it unpacks the state, runs the generated function, pins each
state output to its input's sharding, strips weak types (so the next call does not compile
again), and packs the state again when the transport packs it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _loading, _transport
from ._analysis import Analysis
from ._codegen import GeneratedCode, generate
from ._errors import UNHASHABLE_STATIC, CallError, Location, error
from ._handles import LazyHandle
from ._infer import arg_kinds, infer
from ._nnx import Link
from ._roles import Options, Roles, assign_roles
from ._structure import FlatState, Placement, Structure, is_array
from ._tracing import HELPERS, linking
from ._transport import Layout, PackMode


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
        self.static_names = roles.of("static") + tuple(f"{instance}.{a}" for a in instance_attrs)

    def result(self, handles: list[Any], outputs: Any) -> Any:
        """What the step returns: its state (as handles) and outputs, in the user's order."""
        shape = self.roles.layout.kind
        if shape == "none":
            return None
        items = [
            handles[j] if kind == "state" else outputs[j] for kind, j in self.roles.layout.entries
        ]
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
        self._plans: dict[Any, tuple[Program, tuple[tuple[int, ...], ...]]] = {}
        # Roles from the source and options alone; made now so bad returns fail at decoration.
        self.base = self._get(assign_roles(analysis, options))

    def _get(self, roles: Roles) -> Program:
        program = self._by_roles.get(roles)
        if program is None:
            index = len(self._by_roles)
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

    def for_args(
        self, args: tuple[Any, ...], may_mutate: bool
    ) -> tuple[Program, tuple[tuple[int, ...], ...]]:
        """The program for a call, and the Python scalar leaves of each state argument that
        become arrays: roles are inferred at the first call with arguments of these types
        (`_infer`) and kept for every later one."""
        key = (arg_kinds(args, LazyHandle), may_mutate)
        plan = self._plans.get(key)
        if plan is None:
            inferred = infer(
                self._analysis, self._options, self._num_steps, self._user_fn, args, may_mutate
            )
            plan = self._plans[key] = (self._get(inferred.roles), inferred.to_array)
        return plan

    def all(self) -> list[Program]:
        return list(self._by_roles.values())


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

    @property
    def program(self) -> Program:
        program = self._program()
        assert program is not None, "a CallSpec outlived its step"
        return program

    def __repr__(self) -> str:
        return f"CallSpec({self.fn.name}, static={self.static})"


class SpecCache:
    """A step's interned `CallSpec`s, keyed by their parts (structures are interned, so the
    key compares by identity except for static arguments, which compare by value)."""

    def __init__(
        self, analysis: Analysis, num_steps: int, unroll: int | bool, pack: PackMode
    ) -> None:
        self._analysis = analysis
        self._num_steps = num_steps
        self._unroll = unroll
        self._pack = pack
        self._specs: dict[Any, CallSpec] = {}

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
        key = (program, *structures, *placements, *layouts, links, *bcast_structures, *static)
        try:
            spec = self._specs.get(key)
        except TypeError:
            raise self._unhashable(program, static) from None
        if spec is None:
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
        return spec

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


def entry(
    note_trace: Callable[[CallSpec, Any], None] | None,
    spec: CallSpec,
    state_leaves: tuple[list[Any], ...],
    xs: tuple[Any, ...],
    bcast_leaves: tuple[list[Any], ...],
    *,
    repack: bool = True,
) -> Any:
    """The traced function: leaves in, leaves and stacked outputs out (see the module doc).

    `jax.jit` takes it as `functools.partial(entry, note_trace)` with `spec` static."""
    if note_trace is not None:
        note_trace(spec, (state_leaves, xs, bcast_leaves))
    state = tuple(
        FlatState(s, a if layout is None else _transport.unpack(layout, a))
        for s, a, layout in zip(spec.structures, state_leaves, spec.layouts, strict=True)
    )
    if spec.links is not None:
        state = _linked(spec.links, state)
    bcast = tuple(FlatState(s, a) for s, a in zip(spec.bcast_structures, bcast_leaves, strict=True))
    with linking():
        state_out, outputs = spec.program.fn(spec, state, xs, bcast)
    leaving = tuple(_leaving(spec, k, flat, repack) for k, flat in enumerate(state_out))
    if spec.links is not None:
        # A shared Variable's new value leaves once, with the argument it came in with.
        leaving = tuple(
            flat if link is None else FlatState(flat.structure, link.drop(flat.arrays))
            for flat, link in zip(leaving, spec.links, strict=True)
        )
    return leaving, outputs


def _linked(links: tuple[Link | None, ...], state: tuple[FlatState, ...]) -> tuple[FlatState, ...]:
    """The state with the leaves it shares filled in and its links set (see `_nnx.Link`)."""
    full: list[list[Any]] = []
    out = []
    for flat, link in zip(state, links, strict=True):
        arrays = flat.arrays if link is None else link.expand(flat.arrays, full)
        full.append(arrays)
        out.append(FlatState(flat.structure, arrays, None, link))
    return tuple(out)


def relinked(spec: CallSpec, state_out: tuple[FlatState, ...]) -> tuple[FlatState, ...]:
    """A launch's state outputs with the shared leaves filled in again (the host side of
    `entry`'s `link.drop`)."""
    if spec.links is None:
        return state_out
    full: list[list[Any]] = []
    out = []
    for flat, link in zip(state_out, spec.links, strict=True):
        if link is not None and link.imports:
            flat = FlatState(flat.structure, link.expand(flat.arrays, full))
        full.append(flat.arrays)
        out.append(flat)
    return tuple(out)


def _leaving(spec: CallSpec, k: int, flat: FlatState, repack: bool) -> FlatState:
    """State output `k` as it leaves the program: pinned, strongly typed, packed."""
    placement = spec.placements[k]
    same = flat.structure is spec.structures[k]
    arrays = flat.arrays
    if placement is not None and same:
        arrays = [
            a if s is None else jax.lax.with_sharding_constraint(a, s)
            for a, s in zip(arrays, placement.shardings, strict=True)
        ]
    # A weakly typed state leaf (`debias = jnp.array(1.0)` in a step) would make the next
    # call's input differ from this one's and compile the step again.
    arrays = [jax.lax.convert_element_type(a, a.dtype) if _weak(a) else a for a in arrays]
    written_back = any(j == k for j, _ in spec.program.written_back_idx)
    linked = spec.links is not None and spec.links[k] is not None
    pack = not linked and _transport.mode_for(spec.pack, written_back)
    if repack and pack and not jax.tree_util.treedef_is_leaf(flat.structure.treedef):
        # Back into buffers of the same layout (a new one if the structure changed).
        multi = (
            [s is not None for s in placement.shardings]
            if placement is not None and same
            else [False] * len(arrays)
        )
        avals = [(tuple(jnp.shape(a)), jnp.result_type(a)) for a in arrays]
        layout = _transport.layout_for(avals, multi, pack)
        if layout is not None:
            return FlatState(flat.structure, _transport.pack(layout, arrays), layout)
    return FlatState(flat.structure, arrays)


def _weak(a: Any) -> bool:
    return bool(getattr(getattr(a, "aval", None), "weak_type", False))


# Primitives that run Python on the host while the program runs: it can fail there, after
# the inputs were donated (`jax.pure_callback`, `io_callback`, `jax.debug.callback`/`print`,
# and what builds on them: `eqx.error_if`, host-side checks).
_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "callback"})


def calls_back(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr, or any jaxpr inside it, calls back to the host."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CALLBACKS:
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and calls_back(inner):
                    return True
    return False


def jitted(note_trace: Callable[[CallSpec, Any], None], donate: Any) -> tuple[Any, Any]:
    """A step's `jax.jit`s of `entry`, spec static: the one it runs (state leaves donated if
    `donate`) and, with `donate=True`, one that does not donate, for programs that must keep
    their inputs (`_launch.runner`). Both wrap the same function, so JAX traces a spec once for
    the two."""
    fn = functools.partial(entry, note_trace)
    jit = jax.jit(fn, static_argnums=0, donate_argnums=(1,) if donate else ())
    return jit, jax.jit(fn, static_argnums=0) if donate is True else None


_MISSING = object()
_plain: dict[type, bool] = {}


class _Attribute:
    """An attribute value of a method's plain-object instance, as part of a call's static key:
    equal by type and value when hashable, else by identity (an array, a model)."""

    __slots__ = ("value", "_key")

    def __init__(self, value: Any) -> None:
        self.value = value
        key: Any
        if is_array(value):
            key = id(value)
        else:
            try:
                key = (type(value), hash(value), value)
            except TypeError:
                key = id(value)
        self._key = key

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Attribute):
            return False
        if isinstance(self._key, int):
            return other.value is self.value
        return self._key == other._key

    def __repr__(self) -> str:
        if self.value is _MISSING:
            return "<unset>"
        if is_array(self.value):
            return f"a new {self.value.dtype}{list(self.value.shape)} array"
        return repr(self.value)


def instance_attributes(program: Program, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The static-key part of a method step's plain-object instance: the attributes its body
    reads (nothing for a pytree instance, whose leaves are broadcast inputs)."""
    obj = args[program.instance_idx]
    t = type(obj)
    plain = _plain.get(t)
    if plain is None:
        plain = _plain[t] = hasattr(obj, "__dict__") and jax.tree_util.treedef_is_leaf(
            jax.tree_util.tree_structure(obj)
        )
    if not plain:
        return (None,) * len(program.instance_attrs)
    d = obj.__dict__
    return tuple(_Attribute(d.get(a, _MISSING)) for a in program.instance_attrs)
