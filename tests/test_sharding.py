"""Sharded state and batches on 8 host devices: results match, state keeps its shardings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import chunk, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoflat

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)",
)

tx = optax.adam(1e-2)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def update(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def _setup(mode):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))  # automatic axes
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k1, (4, 16)) * 0.5,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 2)) * 0.5,
    }
    if mode == "replicated":
        specs = {"w1": P(), "b1": P(), "w2": P()}
    else:  # the hidden dimension sharded over the mesh (model parallel)
        specs = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None)}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    opt_state = tx.init(params)
    n = 6
    xs = jax.random.normal(k3, (n, 16, 4))
    ys = jax.random.normal(k4, (n, 16, 2))
    batch_sharding = NamedSharding(mesh, P(None, "data"))  # steps unsharded, batch sharded
    xs, ys = jax.device_put(xs, batch_sharding), jax.device_put(ys, batch_sharding)
    return params, opt_state, xs, ys


# (1, "sharded") and (3, "replicated") repeat what the other two check: in the slow suite
@pytest.mark.parametrize(
    ("k", "mode"),
    [
        (1, "replicated"),
        pytest.param(1, "sharded", marks=pytest.mark.slow),
        pytest.param(3, "replicated", marks=pytest.mark.slow),
        (3, "sharded"),
    ],
)
def test_sharded_state_and_batch(mode, k):
    params, opt_state, xs, ys = _setup(mode)
    in_shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))

    ref = jax.jit(update)
    rp, ro = params, opt_state
    ref_losses = []
    for i in range(6):
        rp, ro, loss = ref(rp, ro, xs[i], ys[i])
        ref_losses.append(loss)

    step = autoflat.step(update, num_steps=k)
    p, o = params, opt_state
    losses = []
    for start in range(0, 6, k):
        if k == 1:
            p, o, loss = step(p, o, xs[start], ys[start])
            losses.append(loss[None])
        else:
            p, o, loss = step(p, o, chunk(xs, start, start + k), chunk(ys, start, start + k))
            losses.append(loss)
    tree_allclose(p, rp, rtol=1e-5)
    tree_allclose(o, ro, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-5)

    outs = jax.tree.leaves(autoflat.unwrap((p, o)))
    refs = jax.tree.leaves((rp, ro))
    for a, out, ref_out in zip(jax.tree.leaves(in_shardings), outs, refs, strict=True):
        if len(a.device_set) > 1:
            assert out.sharding.is_equivalent_to(a, out.ndim), (a, out.sharding)  # kept
        else:
            # an uncommitted single-device leaf (optax's step count) is placed as jit places it
            assert out.sharding.is_equivalent_to(ref_out.sharding, out.ndim)
    if mode == "sharded":
        assert autoflat.unwrap(p)["w1"].sharding.spec == P(None, "data")
    assert autoflat.stats(step).flattens == 2  # sharded handles take the fast path too


# in the mesh context at k=3, outside it at k=1; the other two in the slow suite
@pytest.mark.parametrize(
    ("in_context", "k"),
    [
        pytest.param(True, 1, marks=pytest.mark.slow),
        (True, 3),
        (False, 1),
        pytest.param(False, 3, marks=pytest.mark.slow),
    ],
)
def test_a_mesh_with_explicit_axes(k, in_context):
    """Sharding in types (`jax.make_mesh(..., axis_types=Explicit)`): the step sees each
    array's sharding in its type and may assert it (`with_sharding_constraint` is an assert
    there). The first call's evaluation dropped it (the assert failed), and state leaving a
    call was pinned with `with_sharding_constraint`, which such a mesh refuses outside
    `jax.set_mesh`. Results and the state's types match `jax.jit`'s, in the mesh context or
    not."""
    import contextlib

    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is None or not hasattr(jax, "set_mesh"):
        pytest.skip("this JAX has no explicit mesh axes")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def train_step(params, opt_state, x):
        def loss(p):
            h = x @ p["w"]
            if in_context:  # (outside it, jax.jit refuses the assert too)
                h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", "model")))
            return jnp.mean(jnp.tanh(h) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    w = jax.random.normal(jax.random.key(0), (8, 4)) * 0.5
    params = {"w": jax.device_put(w, NamedSharding(mesh, P(None, "model")))}
    xs = jax.random.normal(jax.random.key(1), (2 * k, 16, 8))
    xs = jax.device_put(xs, NamedSharding(mesh, P(None, "data", None)))
    context = jax.set_mesh(mesh) if in_context else contextlib.nullcontext()
    with context:
        ref = jax.jit(train_step)
        rp, rs, ref_losses = params, tx.init(params), []
        for i in range(2 * k):
            rp, rs, value = ref(rp, rs, xs[i])
            ref_losses.append(value)
        step = autoflat.step(train_step, num_steps=k)
        p, s, losses = params, tx.init(params), []
        for start in range(0, 2 * k, k):
            p, s, value = step(p, s, xs[start : start + k] if k > 1 else xs[start])
            losses.append(jnp.atleast_1d(value))
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-5)
    tree_allclose(p, rp)
    assert jax.typeof(p["w"]) == jax.typeof(rp["w"])  # float32[8,4@model]
    assert p["w"].sharding == rp["w"].sharding


def test_a_mesh_mixing_explicit_and_automatic_axes():
    """Parameters sharded over the automatic axis of a mesh whose other axis is explicit:
    that sharding is not in their type, and `reshard` refuses an automatic axis; pinned with
    `with_sharding_constraint` as before (a ValueError since explicit axes were supported)."""
    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is None or not hasattr(jax, "set_mesh"):
        pytest.skip("this JAX has no explicit mesh axes")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    w = jax.random.normal(jax.random.key(0), (8, 4)) * 0.5
    params = {"w": jax.device_put(w, NamedSharding(mesh, P(None, "model")))}
    xs = jax.random.normal(jax.random.key(1), (2, 16, 8))
    xs = jax.device_put(xs, NamedSharding(mesh, P(None, "data", None)))

    def train_step(params, opt_state, x):
        value, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with jax.set_mesh(mesh):
        rp, rs, _ = jax.jit(train_step)(params, tx.init(params), xs[0])
        rp, rs, _ = jax.jit(train_step)(rp, rs, xs[1])
        p, s, _ = autoflat.step(train_step, num_steps=2)(params, tx.init(params), xs)
    tree_allclose(p, rp)
    assert p["w"].sharding == rp["w"].sharding


# Upstream: patrick-kidger/equinox, docs/examples/parallelism.ipynb: `compute_loss` and
# `train_step` verbatim (upstream decorates the step `@eqx.filter_jit(donate="all")`); the
# mesh on 8 devices, the model and data shrunk.
_mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
data_sharding = NamedSharding(_mesh, P("batch"))
model_sharding = NamedSharding(_mesh, P())
optim = optax.adam(3e-4)


def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return jnp.mean((y - pred_y) ** 2)


def train_step(model, opt_state, x, y):
    import equinox as eqx

    model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
    x, y = eqx.filter_shard((x, y), data_sharding)
    grads = eqx.filter_grad(compute_loss)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return eqx.filter_shard((model, opt_state), model_sharding)


@pytest.mark.parametrize("k", [1, 4])
def test_equinox_parallelism_example_returns_its_state_through_filter_shard(k):
    """`return eqx.filter_shard((model, opt_state), ...)`: a sharding constraint passes the
    updated values through, so the returned tuple's items are the return positions, as for
    `return (model, opt_state)`; equal to upstream's `eqx.filter_jit` loop. (The model holds
    `jax.nn.relu`, which crossed `jax.jit` as an output where the tuple was one output.)"""
    import equinox as eqx

    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    xs = jax.random.normal(jax.random.key(1), (8, 16, 4))
    ys = jnp.sin(xs)
    want = (model, opt_state)
    for x, y in zip(xs, ys, strict=True):
        want = eqx.filter_jit(train_step)(*want, x, y)
    step = autoflat.step(train_step, num_steps=k)
    got = (model, opt_state)
    for start in range(0, 8, k):
        x, y = (xs[start], ys[start]) if k == 1 else (xs[start : start + k], ys[start : start + k])
        got = step(*got, x, y)
    assert "state (matched by value to return position 0)" in autoflat.show(step)
    tree_allclose(eqx.filter(autoflat.unwrap(got), eqx.is_array), eqx.filter(want, eqx.is_array))
