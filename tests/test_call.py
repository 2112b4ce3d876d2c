"""The call path (`_call`): the fast path, copies and donation corner cases, state that is
not autoflat's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import accumulate, tree_allclose
from helpers import ones as _ones

import autoflat


def test_fast_path_does_no_host_flatten():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    for _ in range(5):
        s, out = acc(s, _ones(4))
    stats = autoflat.stats(acc)
    assert (stats.calls, stats.flattens, stats.fast_path, stats.copies) == (5, 1, 4, 1)
    assert int(s["n"]) == 20 and out.shape == (4,)


def test_same_handle_twice_and_handles_across_steps():
    @autoflat.step
    def add(a, b):
        a = a + b
        b = b * 1
        return a, b

    @autoflat.step(num_steps=2)
    def other(a, x):
        a = a + jnp.sum(x)
        return a

    a, b = add(jnp.float32(1.0), jnp.float32(2.0))
    a2, b2 = add(a, a)  # the same handle as two donated state arguments
    assert float(a2) == 6.0 and float(b2) == 3.0
    c = other(a2, jnp.ones((2, 2)))  # a handle from one step into another: fast path
    assert other.stats.fast_path == 1 and float(c) == 10.0


def test_numpy_state_and_zero_array_state():
    @autoflat.step(num_steps=2)
    def step(params, config, x):
        params = {"w": params["w"] + x * config["scale"]}
        config = {"scale": config["scale"], "name": config["name"]}
        return params, config

    p, c = step({"w": np.zeros(2, np.float32)}, {"scale": 2.0, "name": "run"}, jnp.ones((2, 2)))
    np.testing.assert_allclose(p["w"], [4.0, 4.0])
    assert c == {"scale": 2.0, "name": "run"}  # non-array leaves are static, as in filter_jit


@pytest.mark.parametrize("donate", [True, False])
def test_weakly_typed_start_compiles_as_jax_jit_does(donate):
    import optax

    tx = optax.adam(1e-2)

    def update(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((p["w"] * x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state

    params = {"w": jnp.full((3,), 1.0)}  # weakly typed
    step = autoflat.step(update, num_steps=2, donate=donate)
    p, o = step(params, tx.init(params), jnp.ones((2, 3)))
    for _ in range(2):
        p, o = step(p, o, jnp.ones((2, 3)))
    # The step sees weak types as under jax.jit, so it compiles as often as a jax.jit of the
    # same scan: here three times, as Adam's moments settle from weakly to strongly typed.
    scanned = jax.jit(
        lambda p, o, xs: jax.lax.scan(lambda c, x: (update(*c, x), None), (p, o), xs)[0]
    )
    ref = scanned(params, tx.init(params), jnp.ones((2, 3)))
    for _ in range(2):
        ref = scanned(*ref, jnp.ones((2, 3)))
    assert step.stats.traces == scanned._cache_size() == 3
    tree_allclose((p, o), ref)
    assert params["w"].weak_type  # the caller's own array is left as it was
