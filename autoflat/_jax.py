"""JAX internals in one place: every private or version-dependent piece of JAX autoflat uses.

The rest of the package reaches JAX's jaxprs, tracers, weak types and version differences
through the functions here only (tests/test_architecture.py checks it), and tests/test_jax.py
tests each of them on the installed JAX, so a release that changes one fails there, not as
a silent difference in a user's step.

What this module relies on:

- `jax._src.traceback_util.register_exclusion` (`hide_frames`): JAX leaves registered
  paths out of the tracebacks it shows. Skipped where it is missing.
- `jax.extend.core.ClosedJaxpr`, `Jaxpr`, `Literal`; `jax.core.Tracer` (`is_tracer`).
- A jaxpr's `eqns`, `invars`, `outvars`, `constvars`, a closed jaxpr's `jaxpr` and
  `consts`; an equation's `primitive`, `params`, `invars`, `outvars`, `effects` and
  `ctx.manager`; a literal's `val` and `aval` (`equations`, `inputs`, `outputs`,
  `const_inputs`, `opened`, `value_of`, `literal_array`).
- `jax._src.core.trace_ctx.trace`, `jax._src.interpreters.partial_eval`'s
  `DynamicJaxprTrace.emit_eqn` and `DynamicJaxprTracer(trace, aval, literal, source_info)`,
  `jax._src.source_info_util.current`, an equation's `source_info` and `ctx` (`emit`: an
  equation copied into the jaxpr being traced, as `partial_eval.inline_jaxpr_into_trace`
  copies a jit's; absent on JAX 0.4, where equations are bound again).
- `Primitive.get_bind_params` (`bind`): on JAX 0.4 it gives `(subfunctions, params)`, on
  later JAX the params alone. `Primitive.bind` with an equation's own params for elementwise
  primitives (`apply`), and `Primitive.multiple_results`.
- Parameter names: the jaxprs that call primitives hold (`jaxpr` of `jit`/`pjit` and
  `closed_call`, `call_jaxpr` of `custom_jvp_call`/`custom_vjp_call`, `fun_jaxpr`;
  `called_jaxpr`, `jaxprs_in`); a `jit`'s `in_shardings`/`out_shardings` (instances of a
  class named `UnspecifiedValue` when not given) and `compiler_options_kvs` (`inlined`); an
  elementwise primitive's `sharding` (`elementwise_key`); a scan's `num_consts`,
  `num_carry`, `jaxpr`, `length`, `reverse`, `unroll` (`scan_params`: JAX 0.4 and 0.10 have
  them, JAX 0.12 describes its operands otherwise and its scans run as traced).
- An abstract value's `weak_type` (`weak_type`), and `jax._src.lax.lax._convert_element_type`
  with `weak_type=True` (`weakly_typed`: no public function makes a weakly typed array).
- `jax.sharding.is_single_device_sharding` and `make_single_device_sharding`
  (`is_single_device`, `single_device_sharding`: JAX 0.12.1 deprecates the
  `SingleDeviceSharding` name, which older JAX without them still has).
- `jax.sharding.AxisType.Explicit` and `Mesh.axis_types` (`EXPLICIT_AXIS`, `axis_types`:
  JAX's sharding in types; absent on JAX 0.4).
- The code of JAX's traceback filter around what a transformation returns,
  `reraise_with_filtered_traceback` in `jax/_src/traceback_util.py` (`is_transformed`: the
  name a refused wrapper is given; only a message depends on it).
- A treedef's `node_data()` (`node_data`: the type and static data of its root node, which
  a message shows; missing from JAX's type stubs).
- A `jax.jit` function's type name `PjitFunction` and its `_jit_info` (`is_jax_jit`,
  `jit_info`: JAX 0.5 and later expose it), and `PartitionSpec`'s `unreduced` and
  `reduced` (`spec_extras`: newer JAX only).

Tested on JAX 0.4.35 (tests/test_jax.py in the environment of the `pax` nox session), JAX
0.10.x (Python 3.11: `nox -s tests`) and JAX 0.12.x (Python 3.12: `nox -s tests`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

_Tracer = jax.core.Tracer


# -- tracebacks -------------------------------------------------------------------------------


def hide_frames(path: str) -> bool:
    """Leave the frames of files under `path` out of the tracebacks JAX shows; False on a
    JAX without `traceback_util`."""
    try:
        from jax._src import traceback_util
    except ImportError:  # pragma: no cover - a JAX without it
        return False
    traceback_util.register_exclusion(path)
    return True


# -- values -----------------------------------------------------------------------------------


def is_tracer(x: Any) -> bool:
    """Whether `x` is a traced value (inside `jax.jit`, `make_jaxpr`, `eval_shape`, ...)."""
    return isinstance(x, _Tracer)


def weak_type(x: Any) -> bool | None:
    """Whether an array (or tracer) is weakly typed (`jnp.asarray(1.0)`, a Python number
    traced), None for a value without an abstract value (a NumPy array)."""
    aval = getattr(x, "aval", None)
    return None if aval is None else getattr(aval, "weak_type", None)


def weakly_typed(x: Any) -> Any:
    """`x` (an array or tracer) weakly typed, same dtype and values: what `jax.jit` gives the
    step for a weakly typed leaf that travelled packed (`_transport.unpack`)."""
    if weak_type(x):
        return x
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, x.dtype, weak_type=True)


# -- jaxprs and their equations ---------------------------------------------------------------


def _open(jaxpr: Any) -> Any:
    """The open jaxpr of a closed one, or the jaxpr itself."""
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def opened(closed: Any) -> tuple[Any, Sequence[Any]]:
    """(open jaxpr, consts) of a closed jaxpr; an open one has no consts."""
    if isinstance(closed, ClosedJaxpr):
        return closed.jaxpr, closed.consts
    return closed, ()


def equations(jaxpr: Any) -> Sequence[Any]:
    """The equations of a jaxpr (open or closed), in order."""
    return _open(jaxpr).eqns  # type: ignore[no-any-return]


def inputs(x: Any) -> Sequence[Any]:
    """The input variables of an open jaxpr or an equation (an equation's literals too)."""
    return x.invars  # type: ignore[no-any-return]


def outputs(x: Any) -> Sequence[Any]:
    """The output variables of an open jaxpr or an equation (a jaxpr's literals too)."""
    return x.outvars  # type: ignore[no-any-return]


def const_inputs(jaxpr: Any) -> Sequence[Any]:
    """The variables of an open jaxpr's constants."""
    return jaxpr.constvars  # type: ignore[no-any-return]


def primitive(eqn: Any) -> Any:
    """An equation's primitive."""
    return eqn.primitive


def name(eqn: Any) -> str:
    """An equation's primitive's name (`add`, `pjit`, `scan`)."""
    return eqn.primitive.name  # type: ignore[no-any-return]


def params(eqn: Any) -> dict[str, Any]:
    """An equation's parameters, by name."""
    return eqn.params  # type: ignore[no-any-return]


def var_aval(v: Any) -> Any:
    """The abstract value (shape, dtype) of an equation's operand or output variable."""
    return v.aval


def out_aval(eqn: Any) -> Any:
    """The abstract value (shape, dtype) of an equation's first output."""
    return eqn.outvars[0].aval


def is_literal(v: Any) -> bool:
    """Whether an equation's operand (or a jaxpr's output) is a literal, not a variable."""
    return isinstance(v, Literal)


def value_of(env: dict[Any, Any], v: Any) -> Any:
    """An operand's value: a literal's own, a variable's from `env`."""
    return v.val if isinstance(v, Literal) else env[v]


def literal_array(v: Any) -> Any:
    """A literal as the array it stands for (its value in its abstract value's dtype)."""
    return jax.numpy.asarray(v.val, v.aval.dtype)


def jaxprs_in(value: Any) -> list[Any]:
    """The (open) jaxprs an equation's parameter holds: one, or a tuple of them (a `cond`'s
    branches); none for any other value."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    found = []
    for x in items:
        if isinstance(x, (ClosedJaxpr, Jaxpr)):
            inner = getattr(x, "jaxpr", None)  # a closed jaxpr's, where it is a type of its own
            found.append(inner if hasattr(inner, "eqns") else x)
    return found


def holds_jaxprs(eqn: Any) -> bool:
    """Whether any parameter of an equation holds a jaxpr (a call, a scan, a cond, ...)."""
    return any(jaxprs_in(value) for value in eqn.params.values())


def branches(eqn: Any) -> list[Any]:
    """The (open) jaxprs of a `cond`'s branches, each called with the cond's inputs after
    the first (the branch index); none for any other equation."""
    if eqn.primitive.name != "cond":
        return []
    return jaxprs_in(eqn.params.get("branches"))


def while_loop(eqn: Any) -> tuple[Any, Any, int, int] | None:
    """A `while`'s (open) condition and body jaxprs and how many of its inputs are their
    constants: its inputs are the condition's constants, the body's, then the carry; the
    body takes its constants and the carry and gives the carry, the condition its constants
    and the carry. None for any other equation."""
    if eqn.primitive.name != "while":
        return None
    (cond,), (body,) = jaxprs_in(eqn.params["cond_jaxpr"]), jaxprs_in(eqn.params["body_jaxpr"])
    return cond, body, eqn.params["cond_nconsts"], eqn.params["body_nconsts"]


def called_jaxpr(eqn: Any) -> Any:
    """The (open) jaxpr an equation calls with its own inputs and outputs (`pjit`,
    `closed_call`, `custom_jvp_call`, `custom_vjp_call`, `remat`; a scan's body, whose
    inputs and outputs line up with the scan's), or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        found = jaxprs_in(eqn.params.get(key))
        if (
            len(found) == 1
            and len(found[0].invars) == len(eqn.invars)
            and len(found[0].outvars) == len(eqn.outvars)
        ):
            return found[0]
    return None


def primitive_names(jaxpr: Any) -> Iterator[str]:
    """The primitive names of a jaxpr's equations (open or closed), and of the equations of
    every jaxpr their parameters hold, depth first, lazily."""
    for eqn in _open(jaxpr).eqns:
        yield eqn.primitive.name
        for value in eqn.params.values():
            for inner in jaxprs_in(value):
                yield from primitive_names(inner)


# -- running equations ------------------------------------------------------------------------


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """An equation applied to `invals` as it was traced (its context, its bind parameters):
    its outputs, as a list."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # (JAX 0.4 gives (subfunctions, params), later JAX the params alone)
    subfuns, kwargs = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **kwargs)
    return outs if eqn.primitive.multiple_results else [outs]


def _emitter() -> Any:
    """(the current trace, if it is a jaxpr trace that takes equations as they are; the
    tracer class) on this JAX, or None."""
    try:
        from jax._src import core as _core
        from jax._src import source_info_util
        from jax._src.interpreters import partial_eval as pe
    except ImportError:  # pragma: no cover - a JAX without them
        return None
    trace_type = getattr(pe, "DynamicJaxprTrace", None)
    tracer_type = getattr(pe, "DynamicJaxprTracer", None)
    ctx = getattr(_core, "trace_ctx", None)
    if trace_type is None or tracer_type is None or ctx is None:
        return None  # pragma: no cover
    if not hasattr(trace_type, "emit_eqn"):
        return None  # pragma: no cover - JAX 0.4
    return ctx, trace_type, tracer_type, source_info_util


_EMITTER = _emitter()


def can_emit() -> bool:
    """Whether `emit` can copy equations on this JAX (not on JAX 0.4)."""
    return _EMITTER is not None


def emit(eqn: Any, env: dict[Any, Any]) -> list[Any] | None:
    """An equation of a traced jaxpr copied as it is into the jaxpr being traced now, on the
    values of its operands in `env`: its outputs, as `bind` gives them, without running its
    abstract evaluation again; None where it cannot be copied (operands of another trace or
    of other abstract values than the equation's, effects, no jaxpr trace)."""
    if _EMITTER is None or eqn.effects:
        return None
    ctx, trace_type, tracer_type, source_info_util = _EMITTER
    trace = ctx.trace
    if type(trace) is not trace_type:
        return None
    here = source_info_util.current()
    src = eqn.source_info.replace(name_stack=here.name_stack + eqn.source_info.name_stack)
    tracers = []
    for v in eqn.invars:
        if isinstance(v, Literal):
            tracers.append(tracer_type(trace, v.aval, v, src))
            continue
        x = env[v]
        if type(x) is not tracer_type or x._trace is not trace or x.aval != v.aval:
            return None
        tracers.append(x)
    out_avals = [v.aval for v in eqn.outvars]
    return trace.emit_eqn(  # type: ignore[no-any-return]
        tracers, out_avals, eqn.primitive, eqn.params, eqn.effects, src, eqn.ctx
    )


def apply(prim: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """An elementwise primitive applied to `args` with an equation's own parameters."""
    return prim.bind(*args, **kwargs)


def elementwise_key(eqn: Any) -> tuple[Any, ...] | None:
    """An elementwise equation's parameters as a hashable key, or None when they cannot be
    one or name a sharding (its result is placed: it runs leaf by leaf)."""
    try:
        key = tuple(sorted(eqn.params.items()))
        hash(key)
    except TypeError:
        return None
    if eqn.params.get("sharding") is not None:
        return None
    return key


def inlined(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """(open jaxpr, consts) of a nested `jax.jit` with nothing but its function (no effects,
    shardings, compiler options): evaluated in place. None for anything else."""
    if eqn.primitive.name not in ("jit", "pjit") or eqn.effects:
        return None
    p = eqn.params
    jaxpr = p.get("jaxpr")
    closed = isinstance(jaxpr, ClosedJaxpr) or (isinstance(jaxpr, Jaxpr) and not jaxpr.constvars)
    if not closed or p.get("compiler_options_kvs"):
        return None
    shardings = tuple(p.get("in_shardings", ())) + tuple(p.get("out_shardings", ()))
    if not all(type(s).__name__ == "UnspecifiedValue" for s in shardings):
        return None
    return opened(jaxpr)


# -- scans ------------------------------------------------------------------------------------


class Scan(NamedTuple):
    """What autoflat reads of a `lax.scan` equation."""

    num_consts: int
    num_carry: int
    body: Any  # the body, a closed jaxpr
    length: int
    reverse: bool
    unroll: Any


_SCAN_PARAMS = ("num_consts", "num_carry", "jaxpr", "length", "reverse", "unroll")


def scan_params(eqn: Any) -> Scan | None:
    """A scan equation's parameters, or None where this JAX's scan describes them otherwise
    (JAX 0.12's)."""
    p = eqn.params
    if not all(k in p for k in _SCAN_PARAMS) or not isinstance(p["jaxpr"], ClosedJaxpr):
        return None
    return Scan(p["num_consts"], p["num_carry"], p["jaxpr"], p["length"], p["reverse"], p["unroll"])


@functools.cache
def scans_readable() -> bool:
    """Whether this JAX's scans give `scan_params` (JAX 0.4 and 0.10, not 0.12)."""
    jaxpr = jax.make_jaxpr(lambda c: jax.lax.scan(lambda c, _: (c, c), c, length=1))(0.0)
    return scan_params(jaxpr.eqns[0]) is not None


# -- sharding in types, jit wrappers ----------------------------------------------------------

# JAX 0.12.1 deprecates the `SingleDeviceSharding` name for these two (resolved once).
_IS_SINGLE_DEVICE = getattr(jax.sharding, "is_single_device_sharding", None)
_MAKE_SINGLE_DEVICE = getattr(jax.sharding, "make_single_device_sharding", None)


def is_single_device(sharding: Any) -> bool:
    """Whether `sharding` places an array whole on one device (a `SingleDeviceSharding`)."""
    if _IS_SINGLE_DEVICE is not None:
        return bool(_IS_SINGLE_DEVICE(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


def single_device_sharding(device: Any) -> Any:
    """The sharding placing an array whole on `device`."""
    if _MAKE_SINGLE_DEVICE is not None:
        return _MAKE_SINGLE_DEVICE(device)
    return jax.sharding.SingleDeviceSharding(device)


# The axis type of a mesh axis whose sharding is part of an array's type; None on a JAX
# without sharding in types.
EXPLICIT_AXIS: Any = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)


def axis_types(mesh: Any) -> dict[str, Any]:
    """A mesh's axis types, by axis name (empty on a JAX without them)."""
    return dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))


def node_data(treedef: Any) -> tuple[Any, Any] | None:
    """(type, static data) of a treedef's root node; None for a leaf, or where JAX has no
    `node_data`."""
    method = getattr(treedef, "node_data", None)
    return None if method is None else method()


def is_jax_jit(fn: Any) -> bool:
    """Whether `fn` is a `jax.jit`-ed function."""
    return type(fn).__name__ == "PjitFunction" and hasattr(fn, "lower")


def is_transformed(fn: Any) -> bool:
    """Whether `fn` is what a JAX transformation returns (`jax.grad(f)`, `jax.vmap(f)`): JAX
    wraps those in its traceback filter, whose code is its own, not the transformation's."""
    code = getattr(fn, "__code__", None)
    return (
        code is not None
        and code.co_name == "reraise_with_filtered_traceback"
        and code.co_filename.replace("\\", "/").endswith("jax/_src/traceback_util.py")
    )


def jit_info(fn: Any) -> Any:
    """A `jax.jit`-ed function's options (`static_argnames`, `in_shardings`, ...), or None
    where JAX does not expose them (before 0.5)."""
    return getattr(fn, "_jit_info", None)


def spec_extras(spec: Any) -> dict[str, Any]:
    """A PartitionSpec's `unreduced` and `reduced` axes where set (newer JAX only; empty sets
    are the default), as keywords for `PartitionSpec`."""
    return {k: getattr(spec, k) for k in ("unreduced", "reduced") if getattr(spec, k, None)}
