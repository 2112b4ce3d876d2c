"""Call specs and the spec cache.

A `CallSpec` is everything static about a call: the program, the structures, placements and
layouts of the state, the broadcast structures, the static arguments. It is interned by
`SpecCache` and is the static argument of the step's single `jax.jit` of `entry.entry`, so
JAX's own cache gives one compile per distinct (spec, input shapes).

A method step's instance that is a plain object (not a pytree) is part of its specs' keys,
held weakly (`instance.Instance`); when it is freed, its specs leave the cache (`_freed`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from .._analysis.analysis import Analysis
from .._errors import UNHASHABLE_STATIC, CallError, Location, error
from .._handles.nnx import Link
from .._transport.layout import Layout, PackMode
from .._transport.structure import Placement, Structure
from .instance import Instance
from .program import Program


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
