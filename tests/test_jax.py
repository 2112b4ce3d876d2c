"""The JAX internals autoflat relies on (`autoflat._jax`), each on the installed JAX.

A JAX release that renames a parameter, moves a type or changes what a jaxpr holds fails
here, not as a silent difference in a user's step. These run on JAX 0.4 too (no optional
library, no sharding beyond one device).
"""

from __future__ import annotations

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoflat import _jax


def _eqn(jaxpr, name):
    """The first equation of `name` (jit and pjit are one name to look for)."""
    names = {"jit", "pjit"} if name == "jit" else {name}
    return next(e for e in _jax.equations(jaxpr) if _jax.name(e) in names)


def _run(jaxpr, consts, args):
    """A jaxpr evaluated equation by equation with `_jax.bind`."""
    env = {}
    for v, x in zip(_jax.const_inputs(jaxpr), consts, strict=True):
        env[v] = x
    for v, x in zip(_jax.inputs(jaxpr), args, strict=True):
        env[v] = x
    for eqn in _jax.equations(jaxpr):
        outs = _jax.bind(eqn, [_jax.value_of(env, v) for v in _jax.inputs(eqn)])
        for v, x in zip(_jax.outputs(eqn), outs, strict=True):
            env[v] = x
    return [_jax.literal_array(v) if _jax.is_literal(v) else env[v] for v in _jax.outputs(jaxpr)]


def nested(x):
    y = jax.jit(lambda a: jnp.sin(a) * 2.0)(x)
    c, ys = jax.lax.scan(lambda c, _: (jnp.cos(c), c + 1.0), y, length=3)
    return c + ys.sum() + 1.0


# -- tracebacks, tracers, weak types ----------------------------------------------------------


def test_hide_frames_registers_the_path_with_jax(tmp_path):
    from jax._src import traceback_util

    assert _jax.hide_frames(str(tmp_path))
    assert str(tmp_path) in traceback_util._exclude_paths
    import autoflat

    assert os.path.dirname(autoflat.__file__) in traceback_util._exclude_paths


def test_is_tracer():
    seen = []
    jax.jit(lambda x: seen.append(_jax.is_tracer(x)) or x)(jnp.float32(1))
    jax.make_jaxpr(lambda x: seen.append(_jax.is_tracer(x)) or x)(1.0)
    assert seen == [True, True]
    assert not _jax.is_tracer(jnp.float32(1))
    assert not _jax.is_tracer(np.float32(1))
    assert not _jax.is_tracer(1.0)


def test_weak_type():
    assert _jax.weak_type(jnp.asarray(1.0)) is True
    assert _jax.weak_type(jnp.float32(1)) is False
    assert _jax.weak_type(jnp.zeros(3)) is False
    assert _jax.weak_type(np.float32(1)) is None  # no abstract value
    seen = []
    jax.jit(lambda x, y: seen.append((_jax.weak_type(x), _jax.weak_type(y))))(1.0, jnp.ones(2))
    assert seen == [(True, False)]


# -- jaxprs -----------------------------------------------------------------------------------


def test_the_walk_reads_inputs_outputs_constants_and_literals():
    const = np.arange(3.0, dtype=np.float32)
    closed = jax.make_jaxpr(lambda x: (x, 1.0, x * jnp.asarray(const) + 2.0))(jnp.ones(3))
    jaxpr, consts = _jax.opened(closed)
    assert _jax.equations(closed) == _jax.equations(jaxpr)
    assert len(_jax.inputs(jaxpr)) == 1
    assert len(_jax.outputs(jaxpr)) == 3
    assert len(_jax.const_inputs(jaxpr)) == len(consts)
    assert [_jax.is_literal(v) for v in _jax.outputs(jaxpr)] == [False, True, False]
    literal = _jax.outputs(jaxpr)[1]
    assert _jax.value_of({}, literal) == 1.0
    assert _jax.literal_array(literal).dtype == jnp.float32
    add = _eqn(jaxpr, "add")
    assert any(_jax.is_literal(v) for v in _jax.inputs(add))
    assert _jax.out_aval(add).shape == (3,)
    assert _jax.var_aval(_jax.inputs(jaxpr)[0]).shape == (3,)
    assert _jax.primitive(add).name == "add"
    assert _jax.params(add) == {}
    # An open jaxpr: itself, with no consts; from JAX 0.12 a jaxpr holds its consts (the
    # closed and open types are one), and gives them.
    again, again_consts = _jax.opened(jaxpr)
    assert again is jaxpr
    assert len(again_consts) in (0, len(consts))


def test_the_walk_sees_a_jit_s_inner_jaxpr_and_a_scan_s_body():
    closed = jax.make_jaxpr(nested)(1.0)
    names = list(_jax.primitive_names(closed))
    assert {"sin", "cos", "scan"} <= set(names)
    assert {"jit", "pjit"} & set(names)
    call = _eqn(closed, "jit")
    inner = _jax.called_jaxpr(call)
    assert [_jax.name(e) for e in _jax.equations(inner)] == ["sin", "mul"]
    assert _jax.holds_jaxprs(call)
    scan = _eqn(closed, "scan")
    body = _jax.called_jaxpr(scan)  # its inputs and outputs line up with the scan's
    assert [_jax.name(e) for e in _jax.equations(body)] == ["cos", "add"]
    assert _jax.holds_jaxprs(scan)
    assert not _jax.holds_jaxprs(_eqn(closed, "add"))


def test_jaxprs_in_a_cond_s_branches_and_a_callback_inside():
    def f(x):
        def noisy(y):
            jax.debug.callback(lambda v: None, y)
            return y

        return jax.jit(lambda y: jax.lax.cond(y > 0, noisy, jnp.sin, y))(x)

    closed = jax.make_jaxpr(f)(1.0)
    cond = _eqn(_jax.called_jaxpr(_eqn(closed, "jit")), "cond")
    assert len(_jax.jaxprs_in(_jax.params(cond)["branches"])) == 2
    # each branch takes the cond's operands after its index, and gives its outputs
    branches = _jax.branches(cond)
    assert len(branches) == 2
    assert all(len(_jax.inputs(b)) == len(_jax.inputs(cond)) - 1 for b in branches)
    assert all(len(_jax.outputs(b)) == len(_jax.outputs(cond)) for b in branches)
    assert {_jax.name(e) for e in _jax.equations(branches[0])} == {"sin"}
    assert _jax.branches(_eqn(closed, "jit")) == []
    assert "debug_callback" in _jax.primitive_names(closed)
    assert _jax.jaxprs_in(3) == []


def test_a_while_loop_s_condition_and_body():
    closed = jax.make_jaxpr(
        lambda a, b: jax.lax.while_loop(
            lambda c: c[0] < b, lambda c: (c[0] + 1.0, c[1] * a), (0.0, a)
        )
    )(1.0, 3.0)
    loop = _eqn(closed, "while")
    cond, body, n_cond, n_body = _jax.while_loop(loop)
    assert (n_cond, n_body) == (1, 1)  # b for the condition, a for the body, then the carry
    assert len(_jax.inputs(loop)) == n_cond + n_body + 2
    assert len(_jax.inputs(body)) == n_body + 2 and len(_jax.outputs(body)) == 2
    assert len(_jax.inputs(cond)) == n_cond + 2 and len(_jax.outputs(cond)) == 1
    assert [_jax.name(e) for e in _jax.equations(body)] == ["add", "mul"]
    assert _jax.branches(loop) == []


def test_custom_derivatives_are_calls():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), t[0]))

    @jax.custom_vjp
    def g(x):
        return jnp.cos(x)

    g.defvjp(lambda x: (g(x), x), lambda x, ct: (ct,))
    closed = jax.make_jaxpr(lambda x: f(x) + g(x))(1.0)
    called = [_jax.called_jaxpr(e) for e in _jax.equations(closed)]
    inner = [[_jax.name(e) for e in _jax.equations(j)] for j in called if j is not None]
    assert inner == [["sin"], ["cos"]]


# -- running equations ------------------------------------------------------------------------


def test_bind_replays_every_equation():
    closed = jax.make_jaxpr(nested)(1.0)
    got = _run(*_jax.opened(closed), [jnp.float32(0.5)])
    np.testing.assert_allclose(got[0], nested(jnp.float32(0.5)), rtol=1e-6)


def _emitted(closed, x):
    """`closed` copied equation by equation into the trace of the caller with `_jax.emit`,
    on input `x`; None where an equation is refused."""
    jaxpr, consts = _jax.opened(closed)
    env = dict(zip(_jax.const_inputs(jaxpr), consts, strict=True))
    env[_jax.inputs(jaxpr)[0]] = x
    for eqn in _jax.equations(jaxpr):
        outs = _jax.emit(eqn, env)
        if outs is None:
            return None
        for v, y in zip(_jax.outputs(eqn), outs, strict=True):
            env[v] = y
    return [_jax.literal_array(v) if _jax.is_literal(v) else env[v] for v in _jax.outputs(jaxpr)]


def test_emit_copies_equations_into_the_current_trace_as_they_are():
    closed = jax.make_jaxpr(nested)(jnp.float32(1.0))
    if not _jax.can_emit():
        pytest.skip("this JAX has no jaxpr trace that takes equations as they are")
    copied = jax.make_jaxpr(lambda x: _emitted(closed, x))(jnp.float32(1.0))
    names = [_jax.name(e) for e in _jax.equations(closed)]
    assert [_jax.name(e) for e in _jax.equations(copied)] == names
    assert copied.out_avals == closed.out_avals
    got = jax.jit(lambda x: _emitted(closed, x))(jnp.float32(0.5))
    np.testing.assert_allclose(got[0], nested(jnp.float32(0.5)), rtol=1e-6)


def test_emit_refuses_values_it_cannot_copy_an_equation_onto():
    closed = jax.make_jaxpr(nested)(jnp.float32(1.0))
    assert _emitted(closed, jnp.float32(0.5)) is None  # no trace: run, not traced
    seen = []
    jax.make_jaxpr(lambda x: seen.append(_emitted(closed, x)))(jnp.float16(1.0))  # other dtype
    jax.make_jaxpr(lambda x: seen.append(_emitted(closed, x)))(1.0)  # weakly typed
    assert seen == [None, None]


def test_apply_binds_an_elementwise_primitive_with_its_parameters():
    closed = jax.make_jaxpr(lambda x: jax.lax.integer_pow(x, 3))(2.0)
    eqn = _eqn(closed, "integer_pow")
    key = _jax.elementwise_key(eqn)
    assert key == (("y", 3),)
    assert float(_jax.apply(_jax.primitive(eqn), [jnp.float32(2)], dict(key))) == 8.0


def test_elementwise_key_refuses_unhashable_or_placed_parameters():
    unhashable = types.SimpleNamespace(params={"a": [1]})
    placed = types.SimpleNamespace(params={"sharding": object()})
    assert _jax.elementwise_key(unhashable) is None
    assert _jax.elementwise_key(placed) is None
    closed = jax.make_jaxpr(lambda x: x.astype(jnp.int32))(1.0)
    assert _jax.elementwise_key(_eqn(closed, "convert_element_type")) is not None


def test_inlined_takes_a_plain_jit_only():
    closed = jax.make_jaxpr(nested)(1.0)
    inner = _jax.inlined(_eqn(closed, "jit"))
    assert inner is not None
    assert [_jax.name(e) for e in _jax.equations(inner[0])] == ["sin", "mul"]
    np.testing.assert_allclose(_run(*inner, [jnp.float32(1)])[0], np.sin(1.0) * 2, rtol=1e-6)
    assert _jax.inlined(_eqn(closed, "scan")) is None
    placed = jax.jit(jnp.sin, out_shardings=_jax.single_device_sharding(jax.devices()[0]))
    assert _jax.inlined(_eqn(jax.make_jaxpr(placed)(1.0), "jit")) is None


# -- scans ------------------------------------------------------------------------------------


def test_scan_params():
    def f(k, c, xs):
        return jax.lax.scan(lambda c, x: (c * k + x, c), c, xs, reverse=True, unroll=2)

    closed = jax.make_jaxpr(f)(2.0, 1.0, jnp.ones(5))
    scan = _jax.scan_params(_eqn(closed, "scan"))
    assert _jax.scans_readable() == (scan is not None)
    if jax.__version_info__ < (0, 11):
        assert scan is not None  # JAX 0.4 and 0.10: the parameters the views read
    if scan is None:
        return
    assert (scan.num_consts, scan.num_carry, scan.length) == (1, 1, 5)
    assert scan.reverse is True and scan.unroll == 2
    body, consts = _jax.opened(scan.body)
    assert len(_jax.inputs(body)) == 3 and len(_jax.outputs(body)) == 2
    assert _run(body, consts, [2.0, 1.0, 1.0]) == [3.0, 1.0]


# -- sharding in types, jit wrappers ----------------------------------------------------------


def test_explicit_axes():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    if _jax.EXPLICIT_AXIS is None:
        assert jax.__version_info__ < (0, 5)
        return
    assert _jax.EXPLICIT_AXIS not in _jax.axis_types(mesh).values()
    explicit = jax.sharding.Mesh(
        np.array(jax.devices()[:1]), ("x",), axis_types=(_jax.EXPLICIT_AXIS,)
    )
    assert _jax.axis_types(explicit) == {"x": _jax.EXPLICIT_AXIS}


def test_jit_wrappers():
    fn = jax.jit(lambda x, n: x * n, static_argnames="n")
    assert _jax.is_jax_jit(fn)
    assert not _jax.is_jax_jit(lambda x: x)
    info = _jax.jit_info(fn)
    if jax.__version_info__ >= (0, 5):
        assert tuple(info.static_argnames) == ("n",)
    assert _jax.jit_info(lambda x: x) is None


def test_transformed_functions():
    def f(x):
        return x * 2.0

    assert _jax.is_transformed(jax.grad(f)) and _jax.is_transformed(jax.vmap(f))
    assert not _jax.is_transformed(f) and not _jax.is_transformed(jax.jit(f))


def test_spec_extras():
    P = jax.sharding.PartitionSpec
    assert _jax.spec_extras(P("x", None)) == {}
    try:
        spec = P("x", unreduced={"y"})
    except TypeError:
        pytest.skip("this JAX's PartitionSpec has no unreduced axes")
    assert _jax.spec_extras(spec) == {"unreduced": spec.unreduced}


def test_single_device_shardings():
    device = jax.devices()[0]
    single = _jax.single_device_sharding(device)
    assert _jax.is_single_device(single)
    assert single.device_set == {device}
    assert _jax.is_single_device(jax.device_put(jnp.ones(3), device).sharding)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert not _jax.is_single_device(named)


def test_node_data():
    kind, data = _jax.node_data(jax.tree.structure({"b": 1, "a": 2}))
    assert kind is dict and tuple(data) == ("a", "b")
    assert _jax.node_data(jax.tree.structure(1)) is None  # a leaf
