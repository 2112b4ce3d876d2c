"""A per-step input read so by its shapes, passed back what the step returned as a per-step
output the call before (`_runtime.fed_back`): refused with a `ShapeError`; everything else
that looks alike runs as before."""

from __future__ import annotations

import gc
import re
import weakref

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import tree_allclose

import autoflat

K = 4


def _running(params, opt_state, ret, x):
    """`ret` of K environments, updated elementwise and returned as an expression."""
    loss, g = jax.value_and_grad(lambda p: jnp.mean(((x @ p["w"]).sum(-1) - ret) ** 2))(params)
    updates, opt_state = optax.sgd(0.1).update(g, opt_state)
    return optax.apply_updates(params, updates), opt_state, 0.9 * ret + x.sum(-1), loss


def _start():
    params = {"w": jnp.full((3, 2), 0.1)}
    return params, optax.sgd(0.1).init(params), jnp.zeros(K)


def _xs(n: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (n, K, 3))


def test_passed_back_it_raises_before_taking_the_state():
    """The state handles passed in stay usable after the error: nothing was consumed."""
    xs = _xs(2 * K)
    step = autoflat.step(_running, num_steps=K)
    params, opt_state, ret, _ = step(*_start(), xs[:K])
    before = autoflat.stats(step)
    with pytest.raises(autoflat.ShapeError, match=re.escape('state={"ret": 2})')):
        step(params, opt_state, ret, xs[K:])
    after = autoflat.stats(step)
    assert (after.traces, after.fast_path, after.flattens) == (
        before.traces, before.fast_path, before.flattens
    )  # refused before taking anything
    assert jnp.isfinite(params["w"]).all()  # the handle, not consumed
    step(params, opt_state, jnp.zeros(K), xs[K:])  # fresh data: runs


def test_fresh_per_step_data_and_copies_run_and_per_step_says_so():
    """New per-step inputs every call run; `per_step=` says the rows passed back are inputs
    (then each step takes its row, equal to `jax.jit` of the step on each row)."""
    xs = _xs(2 * K)
    step = autoflat.step(_running, num_steps=K)
    state = _start()
    for start in (0, K):
        *_, ret, _ = step(*state[:2], jnp.arange(float(K)), xs[start : start + K])
    said = autoflat.step(_running, num_steps=K, per_step="ret")
    params, opt_state, ret = _start()
    got_params, got_opt, got_ret, _ = said(params, opt_state, jnp.zeros((K, K)), xs[:K])
    got_params, got_opt, got_ret, _ = said(got_params, got_opt, got_ret, xs[K:])
    want = (params, opt_state)
    rows = jnp.zeros((K, K))
    for chunk in (xs[:K], xs[K:]):
        new_rows = []
        for i in range(K):
            *want, r, _ = jax.jit(_running)(*want, rows[i], chunk[i])
            new_rows.append(r)
        rows = jnp.stack(new_rows)
    tree_allclose((got_params, got_ret), (want[0], rows), rtol=1e-5)


def test_one_step_a_call_passes_anything_back():
    """At num_steps=1 nothing is read by its leading axis: `ret` is passed as it is, as
    `jax.jit` passes it, and passing back what the step returned is the loop it is."""
    xs = _xs(3)
    step = autoflat.step(_running, num_steps=1)
    got = _start()
    want = _start()
    for x in xs:
        *got, _ = step(*got, x)
        *want, _ = jax.jit(_running)(*want, x)
    tree_allclose(tuple(got), tuple(want), rtol=1e-6)


def test_the_outputs_are_not_kept_alive():
    """The step holds its last per-step outputs weakly: deleted, they are freed."""
    step = autoflat.step(_running, num_steps=K)
    *_, ret, loss = step(*_start(), _xs(K))
    refs = [weakref.ref(ret), weakref.ref(loss)]
    del ret, loss
    gc.collect()
    assert [r() for r in refs] == [None, None]
