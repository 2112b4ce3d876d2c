"""Stage 5: the runtime. Compiled-function cache, the call path, and the in-trace helpers.

The call path of a decorated step:

- *fast path*: a state argument that is an unconsumed lazy handle costs O(1) Python work:
  its interned structure and leaf list are used as they are (no `tree_flatten`, no treedef
  comparison beyond identity);
- *Flax NNX fast path*: the same NNX objects as the last call, unchanged since (checked by
  identity against a snapshot, see `_nnx`), reuse that call's structure and the buffers it
  wrote into their Variables;
- *slow path*: anything else is flattened once and its structure interned; with donation on,
  its leaves are copied first, so the caller's own buffers are never donated;
- outputs are wrapped in lazy handles without unflattening.

Everything static about a call (structures, placements, static arguments, the generated
program) is one interned `CallSpec`, the static argument of a single `jax.jit`, so JAX's own
cache gives one compile per distinct (structures, static args, input shapes, chunk length).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import operator
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _loading, _structure, _transport
from ._analysis import Analysis, analyse, unwrap_function
from ._codegen import GeneratedCode, generate
from ._errors import (
    BAD_CALL,
    BAD_SCAN_LENGTH,
    CANNOT_WRITE_BACK,
    NOT_RETURNED,
    SHARED_VARIABLE,
    STRUCTURE_CHANGED,
    UNHASHABLE_STATIC,
    AutoflatError,
)
from ._handles import _UNBUILT, LazyHandle, Origin, new_handle
from ._nnx import NnxCache, get_raw, set_raw
from ._roles import Options, Roles, assign_roles, check_options, is_mutable_module
from ._structure import FlatState, Placement, Structure, flatten, placement_of
from ._transport import Layout, PackMode

RECOMPILE_WARN_AFTER = 8


class AutoflatRecompileWarning(UserWarning):
    """Warned when one decorated step keeps being traced and compiled again."""


@dataclasses.dataclass
class Stats:
    """Counters of one decorated step function.

    - `calls`: calls of the step.
    - `fast_path`: state arguments taken with no host flatten: lazy handles, and Flax NNX
      objects unchanged since this step's last call.
    - `flattens`: host-side `tree_flatten`s of state and broadcast arguments.
    - `copies`: state arguments copied before donation (they were not autoflat's own).
    - `traces`: traces of the generated function (each is followed by an XLA compile).
    - `rebuilds`: lazy handles from this step rebuilt into real objects.
    - `replays`: calls that skipped argument handling altogether: their state arguments were
      unconsumed, unchanged handles with the last call's structures, placements and layouts
      (in a training loop, the handles the last call returned) and their static and
      broadcast arguments the last call's very objects.
    """

    calls: int = 0
    fast_path: int = 0
    flattens: int = 0
    copies: int = 0
    traces: int = 0
    rebuilds: int = 0
    replays: int = 0

    def snapshot(self) -> Stats:
        return dataclasses.replace(self)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


class Program:
    """One generated, loaded function for one set of roles."""

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
        "entries",
    )

    def __init__(
        self, roles: Roles, generated: GeneratedCode, fn: Callable[..., Any], filename: str
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
        self.written_back_idx = tuple((roles.state.index(p), idx[p]) for p in roles.written_back)
        self.entries = roles.layout.entries


class CallSpec:
    """Everything static about one call; interned, compared by identity."""

    __slots__ = (
        "program",
        "structures",
        "placements",
        "bcast_structures",
        "static",
        "num_steps",
        "unroll",
        "step",
        "layouts",
        "__weakref__",
    )

    def __init__(
        self,
        program: Program,
        structures: tuple[Structure, ...],
        placements: tuple[Placement | None, ...],
        bcast_structures: tuple[Structure, ...],
        static: dict[str, Any],
        num_steps: int,
        unroll: int | bool,
        step: Step,
        layouts: tuple[Layout | None, ...] = (),
    ) -> None:
        self.program = program
        self.structures = structures
        self.placements = placements
        self.bcast_structures = bcast_structures
        self.static = static
        self.num_steps = num_steps
        self.unroll = unroll
        self.step = step
        self.layouts = layouts or (None,) * len(structures)

    def __repr__(self) -> str:
        return f"CallSpec({self.step.__name__}, static={self.static})"


def _one_input(i: int, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[i],)


def _no_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return ()


class Replay:
    """What a step's next call can reuse when it passes back handles like those it returned.

    The common training loop, `model, opt_state, loss = step(model, opt_state, batch)`,
    passes the same static and broadcast objects every call and, as state, handles whose
    structure, placement and layout are those of the last call's spec. Such a call needs no
    argument binding, no structure or cache lookup and no broadcast handling: the checks
    below, all by identity, stand for them. Any handle that passes them would take the
    general path's handle fast path to the same spec, so which handles they are (the last
    call's, older ones with `donate=False`, another step's) does not matter.
    """

    __slots__ = ("spec", "state", "xs_of", "fixed", "bcast_leaves", "n_state")

    def __init__(self, spec: CallSpec, args: tuple[Any, ...], bcast_leaves: tuple[Any, ...]):
        program = spec.program
        self.spec = spec
        # Per state argument: (position, structure, placement, layout) a handle must have.
        self.state = tuple(
            zip(program.state_idx, spec.structures, spec.placements, spec.layouts, strict=True)
        )
        self.n_state = len(program.state_idx)
        # The per-step inputs, as the tuple the compiled entry takes.
        scanned = program.scanned_idx
        self.xs_of: Callable[[tuple[Any, ...]], tuple[Any, ...]]
        if len(scanned) > 1:
            self.xs_of = operator.itemgetter(*scanned)
        elif scanned:
            self.xs_of = functools.partial(_one_input, scanned[0])
        else:
            self.xs_of = _no_inputs
        # Static and broadcast arguments: the very objects of the recorded call.
        self.fixed = tuple((i, args[i]) for i in (*program.static_idx, *program.bcast_idx))
        self.bcast_leaves = bcast_leaves


# --- helpers the generated code calls (inside the trace) ---------------------------------


def _unflatten(flat: FlatState) -> Any:
    return flat.structure.unflatten(flat.arrays)


def _flatten(spec: CallSpec, index: int, value: Any) -> FlatState:
    if type(value) is LazyHandle:
        value = LazyHandle._af_get(value)
    structure, arrays = flatten(value)
    expected = spec.structures[index]
    if structure is not expected and structure.key == expected.key:
        structure = expected  # equal, though interned apart (after `autoflat.clear_caches()`)
    if spec.num_steps > 1 and structure is not expected:
        param = spec.program.roles.state[index]
        raise AutoflatError(
            STRUCTURE_CHANGED.format(
                name=spec.step.__name__,
                where=spec.step._analysis.where,
                param=param,
                diff=_structure.describe_difference(param, expected, None, structure, arrays),
                num_steps=spec.num_steps,
            )
        )
    return FlatState(structure, arrays)


def _scan(
    step: Callable[..., Any], spec: CallSpec, init: tuple[FlatState, ...], xs: tuple[Any, ...]
) -> Any:
    leaves = jax.tree_util.tree_leaves(xs)
    lengths = set()
    for leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            _bad_length(spec, "a per-step input is a scalar, with no leading axis of steps")
        lengths.add(shape[0])
    if len(lengths) > 1:
        _bad_length(spec, f"per-step inputs disagree on their leading axis: {sorted(lengths)}")
    length = lengths.pop() if lengths else spec.num_steps
    if length > spec.num_steps:
        _bad_length(spec, f"per-step inputs have a leading axis of {length}, more than num_steps")

    def checked(carry: Any, x: Any) -> Any:
        new_carry, ys = step(carry, x)
        for i, (old, new) in enumerate(zip(carry, new_carry, strict=True)):
            for a, b in zip(old.arrays, new.arrays, strict=True):
                if (a.shape, a.dtype) != (jnp.shape(b), jnp.result_type(b)):
                    param = spec.program.roles.state[i]
                    raise AutoflatError(
                        STRUCTURE_CHANGED.format(
                            name=spec.step.__name__,
                            where=spec.step._analysis.where,
                            param=param,
                            diff=_structure.describe_difference(
                                param, old.structure, old.arrays, new.structure, new.arrays
                            ),
                            num_steps=spec.num_steps,
                        )
                    )
        return new_carry, ys

    return jax.lax.scan(checked, init, xs, length=length, unroll=spec.unroll)


def _weak(a: Any) -> bool:
    return bool(getattr(getattr(a, "aval", None), "weak_type", False))


def _bad_length(spec: CallSpec, reason: str) -> None:
    scanned = ", ".join(spec.program.roles.of("scanned")) or "(none)"
    raise AutoflatError(
        BAD_SCAN_LENGTH.format(
            name=spec.step.__name__,
            where=spec.step._analysis.where,
            num_steps=spec.num_steps,
            reason=reason,
            scanned=scanned,
            last=spec.num_steps - 1,
        )
    )


HELPERS = {"unflatten": _unflatten, "flatten": _flatten, "scan": _scan}


# --- the decorated step --------------------------------------------------------------------

_all_steps: weakref.WeakSet[Step] = weakref.WeakSet()


def _copy_leaves(arrays: list[Any]) -> list[Any]:
    """Fresh buffers with the same values and placement (so donation never touches the
    caller's own arrays). Weak types are dropped: a step's outputs are strongly typed, so a
    weakly typed start (`jnp.full((3,), 1.0)`) would otherwise compile the step twice."""
    return [jnp.array(a, dtype=a.dtype, copy=True) for a in arrays]


# Buffers that autoflat wrote into callers' objects (mutation-style state), by id, weakly:
# a later call of any step may donate them without a copy while they are still these arrays.
_written_by_us: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _all_ours(arrays: list[Any]) -> bool:
    get = _written_by_us.get
    if all(get(id(a)) is a for a in arrays):
        return True
    # Written by a step's Flax NNX fast path, which keeps them in its cache instead.
    for step in _all_steps:
        cache = step._nnx_cache
        if cache is not None and cache.holds(arrays):
            return True
    return False


_MISS = object()  # `Step._call_replay`: this call may not take the replay path
_set_consumed_by = vars(LazyHandle)["_af_consumed_by"].__set__

_FROZEN_SCALARS = frozenset({bool, int, float, complex, str, bytes, type(None)})


def _replay_safe(value: Any) -> bool:
    """Whether a static argument found again by identity is sure to select the same spec:
    an immutable scalar, a tuple of such, or an object hashed by identity."""
    t = type(value)
    if t in _FROZEN_SCALARS or t.__hash__ is object.__hash__ or isinstance(value, enum.Enum):
        return True
    return t is tuple and all(_replay_safe(v) for v in value)


def _result(program: Program, handles: list[Any], outputs: Any) -> Any:
    """What the step returns: its state (as handles) and outputs, in the user's order."""
    shape = program.roles.layout.kind
    if shape == "none":
        return None
    items = [handles[j] if kind == "state" else outputs[j] for kind, j in program.entries]
    if shape == "single":
        return items[0]
    return tuple(items)


class Step:
    """A step function transformed by `autoflat.step`. Call it like the original."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        num_steps: int,
        state: frozenset[str],
        broadcast: frozenset[str],
        static_argnames: frozenset[str],
        donate: bool,
        unroll: int | bool,
        lazy: bool = True,
        pack: PackMode = False,
    ) -> None:
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise AutoflatError(f"autoflat.step: num_steps must be an int >= 1, got {num_steps!r}.")
        self._wrapped = fn
        self._user_fn = unwrap_function(fn)
        self._analysis: Analysis = analyse(fn)
        params = self._analysis.param_names
        instance = None
        if (
            params
            and params[0] in ("self", "cls")
            and params[0] not in state | static_argnames | broadcast
        ):
            # A method: the instance is the same for every step (its arrays, if it is a pytree,
            # are broadcast; anything else is static).
            instance = params[0]
        self._options = Options(
            state=state, broadcast=broadcast, static=static_argnames, instance=instance
        )
        check_options(self._analysis, self._options)
        self._signature = inspect.signature(self._user_fn)
        self._params = self._analysis.param_names
        self._n_params = len(self._params)
        self.num_steps = num_steps
        self.donate = donate
        self.unroll = unroll
        self.lazy = lazy
        if pack not in (False, True, "auto"):
            raise AutoflatError(f'autoflat.step: pack must be False, True or "auto", got {pack!r}.')
        self.pack: PackMode = pack
        # With lazy=False: per state position, the last (object, handle) this step returned.
        self._last: dict[int, tuple[Any, LazyHandle]] = {}
        # Broadcast arguments: per position, (object, structure, arrays) of an immutable one.
        self._bcast_last: dict[int, tuple[Any, Structure, list[Any]]] = {}
        self.stats = Stats()
        self._origin = Origin(self._analysis.name, self._analysis.where, self.stats)
        self._programs: dict[Roles, Program] = {}
        self._by_mutable: dict[frozenset[str], Program] = {}
        self._specs: dict[Any, CallSpec] = {}
        # The last call's reusable parts, when the next call may skip the generic path (see
        # `Replay`); `_use_replay = False` switches the replay path off (for benchmarks).
        self._replay: Replay | None = None
        self._use_replay = True
        # Flax NNX objects passed again and again (mutation style): see `_nnx`.
        self._nnx_cache: NnxCache | None = None
        self._last_trace_key: Any = None
        self._last_change = ""
        self._warned = False
        self._pending_warning: str | None = None
        self._jit = jax.jit(self._entry, static_argnums=0, donate_argnums=(1,) if donate else ())
        # Roles from the source and options alone; fixed now so bad returns fail at decoration.
        self._base = self._program(assign_roles(self._analysis, self._options))
        self.__name__ = getattr(fn, "__name__", self._analysis.name)
        self.__qualname__ = getattr(fn, "__qualname__", self._analysis.name)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__module__ = getattr(fn, "__module__", None)  # type: ignore[assignment]
        self.__wrapped__ = fn
        _all_steps.add(self)

    # --- programs ---------------------------------------------------------------------------
    def _program(self, roles: Roles) -> Program:
        program = self._programs.get(roles)
        if program is None:
            index = len(self._programs)
            generated = generate(
                self._analysis,
                roles,
                self.num_steps,
                self._user_fn.__globals__,  # type: ignore[attr-defined]
                self._user_fn.__code__.co_freevars,  # type: ignore[attr-defined]
                index,
            )
            filename = _loading.filename_for(
                self._analysis.funcdef.name.value,
                index,
                self._analysis.filename,
                self._analysis.def_line,
            )
            fn = _loading.load(generated, self._user_fn, HELPERS, filename)
            program = self._programs[roles] = Program(roles, generated, fn, filename)
        return program

    def _program_for(self, args: tuple[Any, ...]) -> Program:
        base = self._base
        if not self._may_mutate:
            return base
        mutable = frozenset(self._params[i] for i in base.scanned_idx if is_mutable_module(args[i]))
        if not mutable:
            return base
        program = self._by_mutable.get(mutable)
        if program is None:
            roles = assign_roles(self._analysis, self._options, mutable)
            program = self._by_mutable[mutable] = self._program(roles)
        return program

    @property
    def _may_mutate(self) -> bool:
        return "flax.nnx" in sys.modules

    @property
    def programs(self) -> list[Program]:
        return list(self._programs.values())

    # --- the call path ----------------------------------------------------------------------
    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise AutoflatError(
                BAD_CALL.format(
                    name=self.__name__,
                    where=self._analysis.where,
                    reason=str(e),
                    signature=str(self._signature),
                )
            ) from None
        bound.apply_defaults()
        return tuple(bound.arguments[p] for p in self._params)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        replay = self._replay
        if replay is not None and not kwargs:
            result = self._call_replay(replay, args)
            if result is not _MISS:
                return result
        stats = self.stats
        stats.calls += 1
        if kwargs or len(args) != self._n_params:
            args = self._bind(args, kwargs)
        program = self._program_for(args)
        donate = self.donate

        structures = []
        leaves = []
        placements = []
        layouts: list[Layout | None] = []
        unpacked: dict[int, list[Any]] = {}
        donated: list[LazyHandle] = []
        last = self._last
        nnx_cache = self._nnx_cache
        nnx_hit = nnx_cache is not None and nnx_cache.lookup(program, args, LazyHandle)
        for k, i in enumerate(program.state_idx):
            a = args[i]
            if nnx_hit and k in nnx_cache.variables:  # type: ignore[union-attr]
                # The same Flax NNX object as last call, unchanged: no graph traversal, and
                # its arrays are the ones we wrote, so they are donated without a copy.
                arrs = nnx_cache.arrays[k]  # type: ignore[union-attr]
                placement = nnx_cache.placements[k]  # type: ignore[union-attr]
                layout = _transport.host_layout(arrs, placement, self.pack)
                if layout is not None:
                    arrs = _transport.pack_on_device(layout, arrs)
                    stats.copies += 1
                structures.append(nnx_cache.structures[k])  # type: ignore[union-attr]
                leaves.append(arrs)
                placements.append(placement)
                layouts.append(layout)
                stats.fast_path += 1
                continue
            if last:
                # lazy=False: the real object we returned last time stands for its handle.
                pair = last.get(k)
                if pair is not None and pair[0] is a and pair[1]._af_structure.immutable:
                    a = pair[1]
            if (
                type(a) is LazyHandle
                and not a._af_consumed_by
                and (a._af_obj is _UNBUILT or a._af_structure.immutable)
            ):
                structures.append(a._af_structure)
                leaves.append(a._af_arrays)
                placements.append(a._af_placement)
                layouts.append(a._af_layout)
                donated.append(a)
                stats.fast_path += 1
                continue
            s, arrs = flatten(LazyHandle._af_get(a) if type(a) is LazyHandle else a)
            stats.flattens += 1
            placement = placement_of(arrs)
            placements.append(placement)
            unpacked[k] = arrs
            layout = _transport.host_layout(arrs, placement, self.pack)
            if layout is not None:
                # Packing makes fresh buffers: they may be donated without a copy.
                arrs = _transport.pack_on_device(layout, arrs)
                stats.copies += 1
            elif donate and arrs and not _all_ours(arrs):
                arrs = _copy_leaves(arrs)
                stats.copies += 1
            elif not donate and any(getattr(a, "weak_type", False) for a in arrs):
                # Not copied, but a weakly typed leaf would still compile the step twice
                # (its output comes back strongly typed): only those leaves are converted.
                arrs = [_copy_leaves([a])[0] if getattr(a, "weak_type", False) else a for a in arrs]
            structures.append(s)
            leaves.append(arrs)
            layouts.append(layout)
        nnx_vars: dict[int, list[Any]] = {}
        if nnx_hit:
            nnx_vars = nnx_cache.variables  # type: ignore[union-attr]
        elif self._may_mutate:
            nnx_vars = _nnx_variables(self, program, args, unpacked)
        if len(donated) > 1 and len({id(h) for h in donated}) != len(donated):
            # The same handle twice: donating its buffers twice would fail. Copy the repeats.
            seen: set[int] = set()
            for k, i in enumerate(program.state_idx):
                a = args[i]
                if type(a) is LazyHandle and id(a) in seen:
                    leaves[k] = _copy_leaves(leaves[k])
                seen.add(id(a))

        bcast_structures = []
        bcast_leaves = []
        for k, i in enumerate(program.bcast_idx):
            a = args[i]
            if type(a) is LazyHandle and not a._af_consumed_by:
                s, arrs = LazyHandle._af_leaves(a)
            else:
                cached = self._bcast_last.get(k)
                if cached is not None and cached[0] is a:
                    # The same immutable object as last call (a frozen model): no flatten.
                    s, arrs = cached[1], cached[2]
                else:
                    s, arrs = flatten(a)
                    stats.flattens += 1
                    if s.immutable:
                        self._bcast_last[k] = (a, s, arrs)
            bcast_structures.append(s)
            bcast_leaves.append(arrs)

        for k, i in program.written_back_idx:
            if type(args[i]) is not LazyHandle:
                _check_writable(self, structures[k].treedef, program.roles.state, k)
        static = tuple(args[i] for i in program.static_idx)
        key = (program, *structures, *placements, *layouts, *bcast_structures, *static)
        try:
            spec = self._specs.get(key)
        except TypeError:
            self._unhashable(program, static)
        if spec is None:
            spec = self._new_spec(
                key, program, structures, placements, bcast_structures, static, layouts
            )

        replay = self._replay_for(program, spec, args, bcast_leaves)
        xs = tuple(args[i] for i in program.scanned_idx)
        try:
            state_out, outputs = self._jit(spec, tuple(leaves), xs, tuple(bcast_leaves))
        except Exception as e:
            self._rewrite_traceback(e, program)
            raise

        call = stats.calls
        if donate:
            for h in donated:
                object.__setattr__(h, "_af_consumed_by", call)

        handles = self._handles(program, state_out, spec)
        written: dict[int, list[Any]] = {}
        for k, i in program.written_back_idx:
            variables = nnx_vars.get(k)
            if variables is not None and state_out[k].structure is structures[k]:
                # Flax NNX, same structure: set the new values straight into the caller's
                # Variables (what nnx.update does, without traversing the graph again).
                new_arrays = LazyHandle._af_leaf_arrays(handles[k])
                if nnx_hit and variables:
                    # One Variable through Flax's checked setter (it refuses a write from
                    # inside a transform); the rest like it, directly.
                    set_raw(variables[0], new_arrays[0])
                    list(map(nnx_cache.set_unchecked, variables, new_arrays))  # type: ignore[union-attr]
                else:
                    for v, arr in zip(variables, new_arrays, strict=True):
                        set_raw(v, arr)
                written[k] = new_arrays
                if nnx_hit:
                    continue  # the cache records them as ours (see `_all_ours`)
            else:
                self._write_back(args[i], handles[k], program.roles.state[k])
            if type(args[i]) is not LazyHandle:
                # The caller's object now holds buffers this call produced: a later call (of
                # this step or another) may donate them without a copy while they are still
                # the ones we wrote.
                for arr in LazyHandle._af_leaf_arrays(handles[k]):
                    _written_by_us[id(arr)] = arr
        if nnx_hit or nnx_vars:
            self._remember_nnx(program, args, nnx_vars, written, structures, placements, nnx_hit)
        if not self.lazy:
            last.clear()
            for k, h in enumerate(handles):
                obj = LazyHandle._af_get(h)
                last[k] = (obj, h)
                handles[k] = obj
        # The next call may take the replay path, unless this one left the NNX cache to it.
        self._replay = replay if self._nnx_cache is None else None
        if self._pending_warning is not None:
            # Last, once the state is safe: the warning may be an error under the caller's
            # filters, and by now the donated handles are marked and write-backs are done.
            message, self._pending_warning = self._pending_warning, None
            warnings.warn(message, AutoflatRecompileWarning, stacklevel=2)
        return _result(program, handles, outputs)

    def _replay_for(
        self, program: Program, spec: CallSpec, args: tuple[Any, ...], bcast_leaves: list[Any]
    ) -> Replay | None:
        """The replay record this call would leave for the next one, or None if the next call
        may not take the replay path whatever it passes. Made before the launch (the device
        is idle then) and reused while the spec and the fixed objects stay the same."""
        if not (
            self._use_replay
            and self.lazy
            and not program.written_back_idx
            and all(_replay_safe(args[i]) for i in program.static_idx)
            and all(
                (cached := self._bcast_last.get(k)) is not None and cached[0] is args[i]
                for k, i in enumerate(program.bcast_idx)
            )
        ):
            # Broadcast arguments only if immutable (their leaves are cached), static ones only
            # if an identical object can never hash differently.
            return None
        last = self._replay
        if last is not None and last.spec is spec and all(args[i] is o for i, o in last.fixed):
            return last
        return Replay(spec, args, tuple(bcast_leaves))

    # --- the replay path --------------------------------------------------------------------
    def _call_replay(self, replay: Replay, args: tuple[Any, ...]) -> Any:
        """The call on the replay path, or `_MISS` (with nothing changed) if it may not take it.

        Every check is by identity, so a miss costs nothing but the checks: the generic path
        then handles the call as always."""
        __tracebackhide__ = True
        if len(args) != self._n_params or not self.lazy or not self._use_replay:
            return _MISS
        handles = []
        leaves = []
        for i, structure, placement, layout in replay.state:
            h = args[i]
            if (
                type(h) is not LazyHandle
                or h._af_structure is not structure
                or h._af_consumed_by
                or h._af_layout is not layout
                or h._af_placement is not placement
                or (h._af_obj is not _UNBUILT and not structure.immutable)
            ):
                return _MISS
            handles.append(h)
            leaves.append(h._af_arrays)
        for i, obj in replay.fixed:
            if args[i] is not obj:
                return _MISS
        n = replay.n_state
        if n > 1 and len({id(h) for h in handles}) != n:
            return _MISS  # the same handle twice: the generic path copies the repeat
        xs = replay.xs_of(args)
        if self._may_mutate and any(is_mutable_module(x) for x in xs):
            return _MISS  # another program (see `_program_for`)

        spec = replay.spec
        stats = self.stats
        stats.calls += 1
        stats.replays += 1
        stats.fast_path += n
        try:
            state_out, outputs = self._jit(spec, tuple(leaves), xs, replay.bcast_leaves)
        except Exception as e:
            self._rewrite_traceback(e, spec.program)
            raise
        if self.donate:
            call = stats.calls
            for h in handles:
                _set_consumed_by(h, call)
        program = spec.program
        result = _result(program, self._handles(program, state_out, spec), outputs)
        if self._pending_warning is not None:
            message, self._pending_warning = self._pending_warning, None
            warnings.warn(message, AutoflatRecompileWarning, stacklevel=3)
        return result

    # --- shared by both paths ---------------------------------------------------------------
    def _handles(
        self, program: Program, state_out: tuple[FlatState, ...], spec: CallSpec
    ) -> list[LazyHandle]:
        """New handles over a call's state outputs."""
        origin = self._origin
        names = program.roles.state
        structures = spec.structures
        placements = spec.placements
        handles = []
        for k, flat in enumerate(state_out):
            placement = placements[k]
            if placement is not None and flat.structure is not structures[k]:
                placement = placement_of(flat.arrays)
            handles.append(
                new_handle(flat.structure, flat.arrays, placement, origin, names[k], flat.layout)
            )
        return handles

    def _rewrite_traceback(self, e: BaseException, program: Program) -> None:
        _loading.rewrite_traceback(
            e,
            program.generated,
            program.filename,
            self._analysis.filename,
            self._analysis.funcdef.name.value,
            self.__qualname__,
        )

    def _remember_nnx(
        self,
        program: Program,
        args: tuple[Any, ...],
        nnx_vars: dict[int, list[Any]],
        written: dict[int, list[Any]],
        structures: list[Structure],
        placements: list[Placement | None],
        hit: bool,
    ) -> None:
        """After a call: keep (or refresh) the Flax NNX fast-path cache, or drop it."""
        cache = self._nnx_cache
        if hit and cache is not None:
            if written.keys() == cache.variables.keys():
                for k, arrays in written.items():
                    cache.written(k, arrays)
                return
            self._nnx_cache = None
            return
        # Cached only when every state argument was either a lazy handle or an NNX object
        # whose Variables line up with its leaves and were all written back in place.
        objects = {}
        for k, i in enumerate(program.state_idx):
            a = args[i]
            if type(a) is LazyHandle:
                continue
            if k not in written:
                self._nnx_cache = None
                return
            objects[k] = a
        if not objects:
            self._nnx_cache = None
            return
        from flax import nnx

        step_ref = weakref.ref(self)

        def lost() -> None:
            step = step_ref()
            if step is not None and step._nnx_cache is new:
                step._nnx_cache = None

        new = NnxCache(
            program,
            program.state_idx,
            objects,
            {k: nnx_vars[k] for k in objects},
            {k: written[k] for k in objects},
            {k: structures[k] for k in objects},
            {k: placements[k] for k in objects},
            lambda x: isinstance(x, nnx.Variable) or _structure.is_array(x),
            lost,
        )
        self._nnx_cache = new

    def _unhashable(self, program: Program, static: tuple[Any, ...]) -> None:
        for p, v in zip(program.roles.of("static"), static, strict=True):
            try:
                hash(v)
            except TypeError:
                raise AutoflatError(
                    UNHASHABLE_STATIC.format(
                        name=self.__name__,
                        where=self._analysis.where,
                        param=p,
                        type=type(v).__name__,
                    )
                ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _new_spec(
        self,
        key: Any,
        program: Program,
        structures: list[Structure],
        placements: list[Placement | None],
        bcast_structures: list[Structure],
        static: tuple[Any, ...],
        layouts: list[Layout | None] | None = None,
    ) -> CallSpec:
        spec = CallSpec(
            program,
            tuple(structures),
            tuple(placements),
            tuple(bcast_structures),
            dict(zip(program.roles.of("static"), static, strict=True)),
            self.num_steps,
            self.unroll,
            self,
            tuple(layouts) if layouts is not None else (None,) * len(structures),
        )
        self._specs[key] = spec
        return spec

    def _write_back(self, target: Any, new: LazyHandle, param: str) -> None:
        """Mutation-style state: make the caller's object show the new value."""
        if type(target) is LazyHandle:
            for slot in (
                "_af_structure",
                "_af_arrays",
                "_af_placement",
                "_af_layout",
                "_af_unpacked",
            ):
                object.__setattr__(target, slot, object.__getattribute__(new, slot))
            object.__setattr__(target, "_af_obj", _UNBUILT)
            object.__setattr__(target, "_af_consumed_by", 0)
            return
        if is_mutable_module(target):
            # Flax NNX: set the new values into the caller's own Variables, as nnx.jit does.
            from flax import nnx

            nnx.update(target, nnx.state(LazyHandle._af_get(new)))
            return
        _assign_into(target, LazyHandle._af_get(new), param, "", self)

    # --- tracing ----------------------------------------------------------------------------
    def _entry(
        self,
        spec: CallSpec,
        state_leaves: tuple[list[Any], ...],
        xs: tuple[Any, ...],
        bcast_leaves: tuple[list[Any], ...],
    ) -> Any:
        self.stats.traces += 1
        self._note_trace(spec, state_leaves, xs, bcast_leaves)
        state = tuple(
            FlatState(s, a if layout is None else _transport.unpack(layout, a))
            for s, a, layout in zip(spec.structures, state_leaves, spec.layouts, strict=True)
        )
        bcast = tuple(
            FlatState(s, a) for s, a in zip(spec.bcast_structures, bcast_leaves, strict=True)
        )
        state_out, outputs = spec.program.fn(spec, state, xs, bcast)
        pinned = []
        for k, flat in enumerate(state_out):
            placement = spec.placements[k]
            if placement is not None and flat.structure is spec.structures[k]:
                flat = FlatState(
                    flat.structure,
                    [
                        a if s is None else jax.lax.with_sharding_constraint(a, s)
                        for a, s in zip(flat.arrays, placement.shardings, strict=True)
                    ],
                )
            if any(_weak(a) for a in flat.arrays):
                # A weakly typed state leaf (`debias = jnp.array(1.0)` in a step) would make
                # the next call's input differ from this one's and compile the step again.
                flat = FlatState(
                    flat.structure,
                    [
                        jax.lax.convert_element_type(a, a.dtype) if _weak(a) else a
                        for a in flat.arrays
                    ],
                )
            if self.pack:
                # Back into buffers of the same layout (a new one if the structure changed).
                same = flat.structure is spec.structures[k]
                multi = (
                    [s is not None for s in placement.shardings]
                    if placement is not None and same
                    else [False] * len(flat.arrays)
                )
                avals = [(tuple(jnp.shape(a)), jnp.result_type(a)) for a in flat.arrays]
                layout = _transport.layout_for(avals, multi, self.pack)
                if layout is not None:
                    flat = FlatState(flat.structure, _transport.pack(layout, flat.arrays), layout)
            pinned.append(flat)
        return tuple(pinned), outputs

    def _note_trace(self, spec: CallSpec, state_leaves: Any, xs: Any, bcast_leaves: Any) -> None:
        shapes = jax.tree_util.tree_map(
            lambda t: (t.shape, t.dtype, getattr(getattr(t, "aval", None), "weak_type", None)),
            (state_leaves, xs, bcast_leaves),
        )
        key = (spec, shapes)
        last = self._last_trace_key
        if last is not None:
            self._last_change = _describe_change(last, key)
        self._last_trace_key = key
        if self.stats.traces >= RECOMPILE_WARN_AFTER and not self._warned:
            self._warned = True
            # Warned from __call__ once the call returns, so it points at the caller's line.
            self._pending_warning = (
                f"autoflat: `{self.__qualname__}` ({self._analysis.where}) has been traced and "
                f"compiled {self.stats.traces} times; the last change was: {self._last_change}. "
                "Keep structures, static arguments and input shapes fixed between calls (pad "
                "the final batch, keep counters as arrays), or this step recompiles often."
            )

    # --- conveniences -----------------------------------------------------------------------
    def show(self, *, print_: bool = True) -> str:
        from ._api import show

        return show(self, print_=print_)

    def clear_cache(self) -> None:
        self._specs.clear()
        self._replay = None
        self._bcast_last.clear()
        self._nnx_cache = None
        self._last.clear()
        self._jit = jax.jit(
            self._entry, static_argnums=0, donate_argnums=(1,) if self.donate else ()
        )

    def __repr__(self) -> str:
        return f"<autoflat.step {self.__qualname__} num_steps={self.num_steps}>"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        import functools

        return functools.partial(self, obj)


def _describe_change(old: Any, new: Any) -> str:
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
            old, new_value = old_spec.static.get(n), new_spec.static[n]
            return f"the value of static argument `{n}` ({old!r} -> {new_value!r})"
    if old_spec.placements != new_spec.placements:
        return "the sharding of the state"
    if old_shapes != new_shapes:
        return "the shapes, dtypes or weak types of the inputs"
    return "nothing autoflat can see (the jit cache was cleared?)"


def _assign_into(target: Any, new: Any, param: str, path: str, step: Step) -> None:
    """Update `target` in place so that it equals `new` (same tree structure)."""
    if target is new:
        return
    if isinstance(target, dict):
        for k in list(target):
            if k not in new:
                del target[k]
        for k, v in new.items():
            old = target.get(k, None)
            if k in target and _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}[{k!r}]", step)
            else:
                target[k] = v
        return
    if isinstance(target, list):
        if len(target) != len(new):
            target[:] = list(new)
            return
        for i, v in enumerate(new):
            old = target[i]
            if _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}[{i}]", step)
            else:
                target[i] = v
        return
    if isinstance(target, tuple):
        for i, (old, v) in enumerate(zip(target, new, strict=True)):
            if old is v:
                continue
            if _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}[{i}]", step)
            else:
                _cannot(step, param, f"{path}[{i}]", type(target))
        return
    if _is_mutable_container(target):
        for k, v in vars(new).items():
            old = getattr(target, k, None)
            if _is_mutable_container(old):
                _assign_into(old, v, param, f"{path}.{k}", step)
            else:
                setattr(target, k, v)
        return
    _cannot(step, param, path or "(the whole value)", type(target))


def _nnx_variables(
    step: Step, program: Program, args: tuple[Any, ...], leaves: dict[int, list[Any]]
) -> dict[int, list[Any]]:
    """The nnx.Variables of each Flax NNX state argument, in leaf order.

    Refuses a Variable reachable twice (a shared submodule, tied weights, or one object passed
    as two arguments): NNX objects travel as pytrees, which would split it into two copies
    updated apart. Returns, per state position, the Variables when they line up one to one
    with that argument's array leaves, for a direct write-back after the call.
    """
    from flax import nnx

    def is_variable(x: Any) -> bool:
        return isinstance(x, nnx.Variable)

    seen: set[int] = set()
    out: dict[int, list[Any]] = {}
    for k, i in enumerate(program.state_idx):
        a = args[i]
        if type(a) is LazyHandle or k not in leaves or not is_mutable_module(a):
            continue  # handles are returned state, never written back
        variables = [v for v in jax.tree_util.tree_leaves(a, is_leaf=is_variable) if is_variable(v)]
        for v in variables:
            if id(v) in seen:
                _raise_shared(step, program, args, v)
            seen.add(id(v))
        arrays = leaves[k]
        if len(variables) == len(arrays) and all(
            np.shape(get_raw(v)) == np.shape(x) for v, x in zip(variables, arrays, strict=True)
        ):
            out[k] = variables
    return out


def _raise_shared(step: Step, program: Program, args: tuple[Any, ...], var: Any) -> None:
    from flax import nnx

    places = []
    for name, i in zip(program.roles.state, program.state_idx, strict=True):
        paths, _ = jax.tree_util.tree_flatten_with_path(
            args[i], is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        places += [f"{name}{jax.tree_util.keystr(p)}" for p, v in paths if v is var]
    raise AutoflatError(
        SHARED_VARIABLE.format(
            name=step.__qualname__, where=step._analysis.where, first=places[0], second=places[1]
        )
    )


def _check_writable(step: Step, treedef: Any, names: tuple[str, ...], k: int) -> None:
    """Before the call: can the caller's object be updated in place afterwards?"""
    if treedef.node_data() is None:
        raise AutoflatError(
            NOT_RETURNED.format(
                name=step.__qualname__, where=step._analysis.where, param=names[k], type="leaf"
            )
        )
    path = _unwritable_path(treedef, "")
    if path is not None:
        data = treedef.node_data()
        typ = data[0] if data is not None else type(None)
        _cannot(step, names[k], path[0] or "", path[1] if path[1] is not None else typ)


def _unwritable_path(treedef: Any, path: str) -> tuple[str, type] | None:
    data = treedef.node_data()
    if data is None:
        return (path, type(None)) if path == "" else None
    typ, aux = data
    if typ in (dict, list) or not _structure._type_immutable(typ) and typ is not type(None):
        return None
    # An immutable node: it cannot be changed in place, so every child must be.
    children = treedef.children()
    keys = list(aux) if typ is dict else list(range(len(children)))
    for key, child in zip(keys, children, strict=False):
        sub = f"{path}[{key!r}]"
        if child.node_data() is None:
            return (sub, typ)
        found = _unwritable_path(child, sub)
        if found is not None:
            return found
    return None


def _is_mutable_container(x: Any) -> bool:
    if isinstance(x, (dict, list)):
        return True
    if (
        x is None
        or isinstance(x, (tuple, str, bytes, int, float, complex))
        or _structure.is_array(x)
    ):
        return False
    if not hasattr(x, "__dict__") or inspect.isroutine(x) or isinstance(x, type):
        return False
    params = getattr(type(x), "__dataclass_params__", None)
    if params is not None and params.frozen:
        return False
    eqx = sys.modules.get("equinox")
    return not (eqx is not None and isinstance(x, eqx.Module))


def _cannot(step: Step, param: str, path: str, typ: type) -> None:
    raise AutoflatError(
        CANNOT_WRITE_BACK.format(
            name=step.__qualname__,
            where=step._analysis.where,
            param=param,
            path=f"{param}{path}",
            type=typ.__name__,
        )
    )


def clear_all() -> None:
    for step in list(_all_steps):
        step.clear_cache()
    _structure.clear()
    _transport.clear()
