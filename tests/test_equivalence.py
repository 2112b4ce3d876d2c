"""autoflat with num_steps=k equals k sequential calls of `jax.jit(update)`: plain pytrees
(dict, tuple, NamedTuple, registered dataclass, nested) with optax adam and chain."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import chunk, tree_allclose

import autoflat
from autoflat._api import default_pack


class Layer(NamedTuple):
    w: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DataclassParams:
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array


def _arrays(key, d_in=4, d_hidden=8, d_out=2):
    k1, k2 = jax.random.split(key)
    return (
        jax.random.normal(k1, (d_in, d_hidden)) * 0.5,
        jnp.zeros(d_hidden),
        jax.random.normal(k2, (d_hidden, d_out)) * 0.5,
        jnp.zeros(d_out),
    )


def make_params(kind: str, key):
    w1, b1, w2, b2 = _arrays(key)
    if kind == "dict":
        return {"a_w1": w1, "b_b1": b1, "c_w2": w2, "d_b2": b2}
    if kind == "tuple":
        return (w1, b1, w2, b2)
    if kind == "namedtuple":
        return (Layer(w1, b1), Layer(w2, b2))
    if kind == "dataclass":
        return DataclassParams(w1, b1, w2, b2)
    if kind == "nested":
        return {"l1": (w1, b1), "l2": Layer(w2, b2), "extra": [None]}
    raise ValueError(kind)


def mlp_loss(params, batch):
    w1, b1, w2, b2 = jax.tree.leaves(params)
    x, y = batch
    h = jnp.tanh(x @ w1 + b1)
    return jnp.mean((h @ w2 + b2 - y) ** 2)


def make_batches(key, n, batch=8):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, batch, 4)), jax.random.normal(ky, (n, batch, 2))


TXS = {
    "adam": optax.adam(1e-2),
    "chain": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3)),
}


def make_update(tx):
    def update(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return update


@functools.cache
def _update(tx_name):
    """One update function per optimizer: the reference loops of the tests share its
    `jax.jit` trace and compile for each structure."""
    return make_update(TXS[tx_name])


def reference(update, params, opt_state, batches, n):
    ref = jax.jit(update)
    losses = []
    for i in range(n):
        params, opt_state, loss = ref(params, opt_state, jax.tree.map(lambda x: x[i], batches))
        losses.append(loss)
    return params, opt_state, jnp.stack(losses)


def run_autoflat(step, params, opt_state, batches, n, k):
    losses = []
    if k == 1:
        for i in range(n):
            params, opt_state, loss = step(params, opt_state, jax.tree.map(lambda x: x[i], batches))
            assert loss.shape == ()
            losses.append(loss[None])
    else:
        for start in range(0, n, k):
            stop = min(start + k, n)
            params, opt_state, loss = step(params, opt_state, chunk(batches, start, stop))
            assert loss.shape == (stop - start,)
            losses.append(loss)
    return params, opt_state, jnp.concatenate(losses)


@pytest.mark.parametrize("kind", ["dict", "tuple", "namedtuple", "dataclass", "nested"])
@pytest.mark.parametrize("k,n", [(1, 3), (3, 6), (10, 10), (10, 23)])
@pytest.mark.parametrize("tx_name", ["adam", "chain"])
def test_matches_sequential_jit(kind, k, n, tx_name):
    tx = TXS[tx_name]
    update = _update(tx_name)
    params = make_params(kind, jax.random.key(0))
    opt_state = tx.init(params)
    batches = make_batches(jax.random.key(1), n)

    ref_params, ref_opt, ref_losses = reference(update, params, opt_state, batches, n)
    step = autoflat.step(update, num_steps=k)
    p, o, losses = run_autoflat(step, params, opt_state, batches, n, k)
    stats = autoflat.stats(step)

    tree_allclose(p, ref_params)
    tree_allclose(o, ref_opt)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    calls = -(-n // k)
    assert stats.calls == calls
    assert stats.flattens == 2  # only the first call flattens (params, opt_state)
    assert stats.fast_path == 2 * (calls - 1)
    # one compile per distinct chunk length
    assert stats.traces == (2 if n % k else 1)
    assert stats.rebuilds == 0  # nothing was rebuilt on the host while training
    assert autoflat.stats(step).rebuilds == 2  # the comparison above rebuilt p and o once each


@pytest.mark.parametrize("donate", [True, False])
def test_donation_never_touches_callers_arrays(donate):
    tx = TXS["adam"]
    update = make_update(tx)
    params = make_params("dict", jax.random.key(0))
    params_copy = jax.tree.map(np.asarray, params)
    opt_state = tx.init(params)
    batches = make_batches(jax.random.key(1), 6)
    step = autoflat.step(update, num_steps=3, donate=donate)
    p1, o1, _ = step(params, opt_state, chunk(batches, 0, 3))
    p2, o2, _ = step(p1, o1, chunk(batches, 3, 6))
    # The caller's own arrays are intact whatever `donate` says.
    tree_allclose(params, params_copy, exact=True)
    for leaf in jax.tree.leaves(params):
        assert not leaf.is_deleted()
    if donate:
        with pytest.raises(autoflat.AutoflatError, match="consumed by call 2"):
            p1["a_w1"]
        with pytest.raises(autoflat.AutoflatError, match="donate=False"):
            step(p1, o1, chunk(batches, 3, 6))
    else:
        # Without donation, earlier handles stay usable and re-running gives the same result.
        p2b, _, _ = step(p1, o1, chunk(batches, 3, 6))
        tree_allclose(p2b, p2, exact=True)
    ref_p, ref_o, _ = reference(update, params, opt_state, batches, 6)
    tree_allclose(p2, ref_p)
    tree_allclose(o2, ref_o)


def test_deepcopy_before_donating_call_keeps_a_copy():
    import copy

    tx = TXS["adam"]
    step = autoflat.step(make_update(tx), num_steps=2)
    params = make_params("dict", jax.random.key(0))
    batches = make_batches(jax.random.key(1), 4)
    p1, o1, _ = step(params, tx.init(params), chunk(batches, 0, 2))
    kept = copy.deepcopy(p1)
    step(p1, o1, chunk(batches, 2, 4))
    assert isinstance(kept, dict) and not autoflat.is_handle(kept)
    assert np.isfinite(np.asarray(kept["a_w1"])).all()


def test_per_step_prng_keys_both_kinds():
    tx = TXS["adam"]

    def update(params, opt_state, batch, key):
        x, y = batch
        keep = jax.random.bernoulli(key, 0.8, x.shape)
        x = jnp.where(keep, x / 0.8, jnp.zeros_like(x))
        loss, grads = jax.value_and_grad(mlp_loss)(params, (x, y))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    params = make_params("tuple", jax.random.key(0))
    opt_state = tx.init(params)
    batches = make_batches(jax.random.key(1), 6)
    for keys in (
        jax.random.split(jax.random.key(2), 6),
        jax.random.split(jax.random.PRNGKey(2), 6),
    ):
        ref = jax.jit(update)
        rp, ro = params, opt_state
        ref_losses = []
        for i in range(6):
            rp, ro, loss = ref(rp, ro, jax.tree.map(lambda x: x[i], batches), keys[i])
            ref_losses.append(loss)
        step = autoflat.step(update, num_steps=3)
        p, o, l1 = step(params, opt_state, chunk(batches, 0, 3), keys[:3])
        p, o, l2 = step(p, o, chunk(batches, 3, 6), keys[3:])
        tree_allclose(p, rp)
        np.testing.assert_allclose(jnp.concatenate([l1, l2]), jnp.stack(ref_losses), rtol=1e-5)


def test_static_argument_selects_compiled_version():
    tx = optax.sgd(1.0)

    def update(params, opt_state, batch, scale):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    params = make_params("dict", jax.random.key(0))
    opt_state = tx.init(params)
    batches = make_batches(jax.random.key(1), 4)
    step = autoflat.step(update, num_steps=2, static_argnames="scale")
    ref = jax.jit(update, static_argnames="scale")
    p, o, _ = step(params, opt_state, chunk(batches, 0, 2), 0.1)
    p, o, _ = step(p, o, chunk(batches, 2, 4), scale=0.01)
    p, o, _ = step(p, o, chunk(batches, 0, 2), 0.1)
    rp, ro = params, opt_state
    for i, s in [(0, 0.1), (1, 0.1), (2, 0.01), (3, 0.01), (0, 0.1), (1, 0.1)]:
        rp, ro, _ = ref(rp, ro, jax.tree.map(lambda x: x[i], batches), s)
    tree_allclose(p, rp)
    assert autoflat.stats(step).traces == 2
    with pytest.raises(autoflat.AutoflatError, match="static argument `scale`.*list"):
        step(p, o, chunk(batches, 0, 2), [0.1])


def test_broadcast_argument_same_for_every_step():
    tx = TXS["adam"]

    def update(params, opt_state, batch, teacher, temperature):
        x, _ = batch
        target = jnp.tanh(x @ teacher[0]) @ teacher[2] / temperature
        loss, grads = jax.value_and_grad(mlp_loss)(params, (x, target))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    params = make_params("tuple", jax.random.key(0))
    teacher = make_params("tuple", jax.random.key(5))
    opt_state = tx.init(params)
    batches = make_batches(jax.random.key(1), 4)
    step = autoflat.step(update, num_steps=4, broadcast=("teacher", "temperature"))
    p, o, losses = step(params, opt_state, batches, teacher, jnp.float32(2.0))
    ref = jax.jit(update)
    rp, ro = params, opt_state
    ref_losses = []
    for i in range(4):
        rp, ro, loss = ref(rp, ro, jax.tree.map(lambda x: x[i], batches), teacher, jnp.float32(2.0))
        ref_losses.append(loss)
    tree_allclose(p, rp)
    np.testing.assert_allclose(losses, jnp.stack(ref_losses), rtol=1e-5)
    assert "teacher: broadcast (broadcast=)" in autoflat.show(step)


def test_exception_mid_training_loses_nothing():
    tx = TXS["adam"]
    update = make_update(tx)
    params = make_params("nested", jax.random.key(0))
    opt_state = tx.init(params)
    batches = make_batches(jax.random.key(1), 9)
    step = autoflat.step(update, num_steps=3)
    p, o, _ = step(params, opt_state, chunk(batches, 0, 3))
    bad = (jnp.ones((3, 8, 5)), jnp.ones((3, 8, 2)))  # wrong feature size
    with pytest.raises(TypeError):
        step(p, o, bad)
    # The handles from before the failing call, and the caller's originals, still work.
    p, o, _ = step(p, o, chunk(batches, 3, 6))
    p, o, _ = step(p, o, chunk(batches, 6, 9))
    ref_p, ref_o, _ = reference(update, params, opt_state, batches, 9)
    tree_allclose(p, ref_p)
    tree_allclose(o, ref_o)
    p_again, _, _ = step(params, opt_state, chunk(batches, 0, 3))
    tree_allclose(params, make_params("nested", jax.random.key(0)), exact=True)
    assert p_again is not None


def test_num_steps_one_is_drop_in_for_jit():
    tx = TXS["adam"]
    update = make_update(tx)
    params = make_params("dict", jax.random.key(0))
    opt_state = tx.init(params)
    batch = jax.tree.map(lambda x: x[0], make_batches(jax.random.key(1), 1))
    step = autoflat.step(update)
    p, o, loss = step(params, opt_state, batch)
    rp, ro, rloss = jax.jit(update)(params, opt_state, batch)
    # (with every leaf packed, `nox -s tests_pack`, whole-buffer updates: to the last bits)
    exact = default_pack() is not True
    tree_allclose(p, rp, exact=exact, rtol=1e-6)
    tree_allclose(o, ro, exact=exact, rtol=1e-6)
    assert loss.shape == () and float(loss) == float(rloss)
