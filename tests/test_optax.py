"""optax states of every common shape, under autoflat, equal sequential `jax.jit` loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import chunk, tree_allclose

import autoflat


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "dense": {"kernel": jax.random.normal(k1, (4, 8)) * 0.3, "bias": jnp.zeros(8)},
        "head": {"kernel": jax.random.normal(k2, (8, 2)) * 0.3, "bias": jnp.zeros(2)},
    }


def _loss(params, x, y):
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((h @ params["head"]["kernel"] + params["head"]["bias"] - y) ** 2)


def _decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key == "kernel", params)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_masked": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask),
    "chain_clip": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.scale_by_adam(), optax.scale(-1e-2)
    ),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2, weight_decay=1e-3
    ),
    "sgd_momentum_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_shapes(name):
    tx = OPTIMIZERS[name]()

    def update(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    n = 7
    xs = jax.random.normal(jax.random.key(1), (n, 8, 4))
    ys = jax.random.normal(jax.random.key(2), (n, 8, 2))
    params = _params()
    opt_state = tx.init(params)
    ref = jax.jit(update)
    rp, ro, ref_losses = params, opt_state, []
    for i in range(n):
        rp, ro, loss = ref(rp, ro, xs[i], ys[i])
        ref_losses.append(loss)

    step = autoflat.step(update, num_steps=3)
    p, o, losses = params, opt_state, []
    for start in range(0, n, 3):
        p, o, loss = step(p, o, chunk(xs, start, start + 3), chunk(ys, start, start + 3))
        losses.append(loss)
    assert autoflat.stats(step).flattens == 2
    tree_allclose(p, rp)
    tree_allclose(o, ro)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-5)
    if name == "inject_hyperparams":
        # hyperparameters are state: changing one between calls needs no recompile
        o = autoflat.unwrap(o)
        o.hyperparams["learning_rate"] = jnp.zeros_like(o.hyperparams["learning_rate"])
        p2, _, _ = step(p, o, chunk(xs, 0, 3), chunk(ys, 0, 3))
        tree_allclose(p2, p, exact=True)
        assert autoflat.stats(step).traces == 2  # the 3-step and 1-step chunks, nothing more


@pytest.mark.parametrize("k", [1, 4])
def test_a_python_number_set_into_the_state_between_calls(k):
    """optax.inject_hyperparams' documented `opt_state.hyperparams["b2"] = 0.95`: a Python
    number where the first call had an array goes in as an array again (no structure change in
    the scan), weakly typed, as `jax.jit` traces it: one compile more, as `jax.jit` makes."""
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b2=0.999)

    def update(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    xs = jax.random.normal(jax.random.key(1), (8, 8, 4))
    ys = jax.random.normal(jax.random.key(2), (8, 8, 2))
    ref = jax.jit(update)
    rp, ro = _params(), tx.init(_params())
    step = autoflat.step(update, num_steps=k)
    p, o = _params(), tx.init(_params())
    for start in range(0, 8, k):
        if start == 4:
            ro.hyperparams["b2"] = 0.95
            o = autoflat.unwrap(o)
            o.hyperparams["b2"] = 0.95
        for i in range(start, start + k):
            rp, ro, _ = ref(rp, ro, xs[i], ys[i])
        x, y = (
            (xs[start], ys[start])
            if k == 1
            else (chunk(xs, start, start + k), chunk(ys, start, start + k))
        )
        p, o, _ = step(p, o, x, y)
    tree_allclose(p, rp)
    tree_allclose(o, ro)
    assert float(o.hyperparams["b2"]) == pytest.approx(0.95)
    assert autoflat.stats(step).traces == ref._cache_size() == 2
