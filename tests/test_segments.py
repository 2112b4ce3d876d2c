"""Packed leaves as views at one step a call (`autoflat._transport.segments`): elementwise operations on
aligned packed leaves run once on the whole buffer; everything else leaf by leaf.

Each step here is checked against a plain `jax.jit` loop over three calls, packed
(`pack=True`, every leaf) and with `pack="auto"`. XLA may simplify a whole-buffer computation
otherwise than a per-leaf one (`a / b / c`), so results are compared to a few ulps, not bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat
from autoflat._runtime import entry as _entry
from autoflat._transport import layout as _transport
from autoflat._transport import segments as _segments

N = 40  # leaves per list: over pack="auto"'s fewest (AUTO_MIN_LEAVES)


def leaves(seed, shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)]


SAME = [(8,)] * N
MIXED = [(8,), (2, 3), (4,), (2, 3), (8,)] * (N // 5)
HALVES = [(8,)] * (N // 2) + [(4,)] * (N // 2)


def sweep(xs, g):
    xs = [x * 0.99 + g for x in xs]
    return xs


def per_leaf_scalar(xs, g):
    # a scalar of each leaf's own (LAMB's trust ratio): one whole operation per leaf
    xs = [x * (jnp.sum(x * x) * 0.01 + g) for x in xs]
    return xs


def neighbours(xs, g):
    # leaf i with leaf i + 1 where their shapes agree: operands shifted by one segment
    n = len(xs)
    xs = [x + 0.5 * xs[(i + 1) % n] if xs[(i + 1) % n].shape == x.shape else x - g
          for i, x in enumerate(xs)]  # fmt: skip
    return xs


def shifted(xs, g):
    # leaf i with leaf i + 1 over runs of equal shapes: two runs, each shifted by one segment
    n = len(xs)
    xs = [x + xs[i + 1] * g if i + 1 < n and xs[i + 1].shape == x.shape else x
          for i, x in enumerate(xs)]  # fmt: skip
    return xs


def same_operation_twice(xs, g):
    # the same operation at the same leaf with two per-leaf operands: two whole operations
    a = [x + jnp.cumsum(x, axis=-1) for x in xs]
    b = [x + jnp.flip(x, axis=-1) for x in xs]
    xs = [p * 2.0 - q * g for p, q in zip(a, b, strict=True)]
    return xs


def reversed_pairs(xs, g):
    xs = [a * 2.0 - b * g for a, b in zip(xs, xs[::-1], strict=True)]
    return xs


def mixed_kinds(xs, g):
    out = []
    for i, x in enumerate(xs):
        if i % 4 == 0:
            y = jnp.where(x > 0, x, 0.1 * x)  # a mask
        elif i % 4 == 1:
            y = (x.astype(jnp.bfloat16) * 2).astype(jnp.float32) + g  # dtypes
        elif i % 4 == 2:
            y = jax.nn.relu(x) - jnp.tanh(x) * g  # a custom_jvp, then elementwise
        else:
            y = helper(x, g)  # a jitted helper
        out.append(y)
    xs = out
    return xs


@jax.jit
def helper(x, g):
    return jnp.sqrt(jnp.abs(x) + 1.0) / (g + 2.0)


def used_twice(xs, g):
    # leaves read by a reduction and by elementwise operations, returned unchanged, twice,
    # and in another order
    total = sum(jnp.sum(x) for x in xs)
    ys = [x * total * 0.001 for x in xs[: N // 2]]
    xs = ys + xs[N // 2 :][::-1]
    return xs


def long_chains(xs, g):
    # 2,000 elementwise operations on each of two leaves (an unrolled inner loop), one of them
    # then cut out by a matmul: computed in order, not by recursion (a recursive evaluation
    # fails past about 330 chained operations on one leaf, whatever the number of leaves)
    out = []
    for i, x in enumerate(xs[:2]):
        for _ in range(1000):
            x = x * 0.999 + g
        out.append(x @ jnp.ones((8, 8)) * 0.1 if i % 2 else x)
    xs = out + xs[2:]
    return xs


def some_leaves(xs, g):
    # half the leaves updated alike, the other half by a matmul
    xs = [x + g if i % 2 else x @ jnp.ones((x.shape[-1], x.shape[-1])) * 0.1
          for i, x in enumerate(xs)]  # fmt: skip
    return xs


def two_states(a, b, g):
    # leaves of two states, one in the other's order reversed
    a = [x + y * g for x, y in zip(a, b[::-1], strict=True)]
    b = [y * 0.5 for y in b]
    return a, b


def counters(xs, cs, g):
    # an int32 group beside a float32 one
    xs = [x + c.astype(jnp.float32) * g for x, c in zip(xs, cs, strict=True)]
    cs = [(c + 1) % 3 for c in cs]
    return xs, cs


CASES = [
    (sweep, SAME, 1),
    (sweep, MIXED, 1),
    (per_leaf_scalar, MIXED, 1),
    (neighbours, MIXED, 1),
    (shifted, HALVES, 1),
    (same_operation_twice, MIXED, 1),
    (long_chains, SAME, 1),
    (reversed_pairs, SAME, 1),
    (mixed_kinds, MIXED, 1),
    (used_twice, SAME, 1),
    (some_leaves, MIXED, 1),
    (two_states, SAME, 2),
]


def _state(shapes, n_states):
    return tuple(leaves(i, shapes) for i in range(n_states))


def _params():
    """Every case with each `pack` and k. `long_chains` (a trace of 4,000 operations, and
    what it checks, evaluation in order rather than by recursion, the same at any pack and
    k) runs packed at k=1 only; its other three in the slow suite."""
    names = [fn.__name__ for fn, _, _ in CASES]
    seen: dict[str, int] = {}
    for fn, shapes, n_states in CASES:
        name = fn.__name__
        if names.count(name) > 1:  # sweep0, sweep1: as pytest names repeated ids
            seen[name] = seen.get(name, -1) + 1
            name = f"{name}{seen[name]}"
        for pack in (True, "auto"):
            for k in (1, 3):
                slow = fn is long_chains and (pack, k) != (True, 1)
                yield pytest.param(
                    fn,
                    shapes,
                    n_states,
                    pack,
                    k,
                    id=f"{name}-{pack}-{k}",
                    marks=pytest.mark.slow if slow else (),
                )


@pytest.mark.parametrize(("fn", "shapes", "n_states", "pack", "k"), list(_params()))
def test_steps_over_packed_leaves_match_jax_jit(fn, shapes, n_states, pack, k):
    # at num_steps=3 the scan carries the packed buffers, its body evaluated with views
    step = autoflat.step(fn, pack=pack, num_steps=k)
    ref = jax.jit(fn)
    state, expected = _state(shapes, n_states), _state(shapes, n_states)
    for i in range(3):
        gs = jnp.arange(k, dtype=jnp.float32) * 0.1 + 0.3 * i
        out = step(*state, gs if k > 1 else gs[0])
        state = out if n_states > 1 else (out,)
        for g in gs:
            got = ref(*expected, g)
            expected = got if n_states > 1 else (got,)
    tree_allclose(state, expected, rtol=1e-6, atol=1e-6)
    assert getattr(state[0], "_af_layout", None) is not None  # it really travelled packed


def constant_flags(xs, flags, g):
    # state set to constants: the jaxpr returns literals, not computed arrays
    xs = [x * g for x in xs]
    flags = [jnp.array(True) for _ in flags]
    return xs, flags


def test_state_set_to_constants():
    step = autoflat.step(constant_flags, pack=True)
    flags = [jnp.array(False)] * N
    xs, out = step(leaves(0, SAME), flags, jnp.float32(2.0))
    ref_x, ref_flags = jax.jit(constant_flags)(leaves(0, SAME), flags, jnp.float32(2.0))
    tree_allclose((xs, out), (ref_x, ref_flags), exact=True)
    assert out._af_layout.groups  # the flags travelled packed


def test_int_counters_beside_floats_match_jax_jit():
    xs = leaves(0, SAME)
    cs = [jnp.int32(i) * jnp.ones((8,), jnp.int32) for i in range(N)]
    step = autoflat.step(counters, pack=True)
    ref_x, ref_c = list(xs), list(cs)
    x, c = [jnp.array(a) for a in xs], [jnp.array(a) for a in cs]
    for i in range(3):
        g = jnp.float32(i)
        x, c = step(x, c, g)
        ref_x, ref_c = jax.jit(counters)(ref_x, ref_c, g)
    tree_allclose((x, c), (ref_x, ref_c), rtol=1e-6, atol=1e-6)
    tree_allclose(c, ref_c, exact=True)


@pytest.mark.parametrize("k", [1, 4])
def test_an_update_of_every_leaf_alike_cuts_no_leaf_out(monkeypatch, k):
    # The sweep updates each leaf alone, alike: the program computes it once on the packed
    # buffer and cuts no leaf out of it (`_transport._take`), in a scan of k steps too; the
    # flat program per leaf is what runs with the views off.
    taken = []
    real = _transport._take
    monkeypatch.setattr(_transport, "_take", lambda *a: taken.append(a) or real(*a))
    gs = jnp.full((k,), 0.5, jnp.float32) if k > 1 else jnp.float32(0.5)
    out = autoflat.step(sweep, pack="auto", num_steps=k)(leaves(0, SAME), gs)
    expected = leaves(0, SAME)
    for _ in range(k):
        expected = jax.jit(sweep)(expected, jnp.float32(0.5))
    tree_allclose(out, expected, exact=True)
    if k == 1 or _segments.scans_with_views():
        assert taken == []
    else:  # JAX 0.12's scan runs as traced: its carry leaf by leaf
        assert len(taken) == N
        taken.clear()
    monkeypatch.setattr(_entry, "SEGMENTS", False)
    autoflat.step(sweep, pack="auto", num_steps=k)(leaves(0, SAME), gs)
    assert len(taken) == N


def sorted_leaves(xs, g):
    # a sort is not elementwise: each leaf is cut out of its buffer and sorted alone
    return [jnp.sort(x) + g for x in xs]


@pytest.mark.parametrize("k", [1, 4])
def test_stats_count_the_operations_run_leaf_by_leaf(k):
    # Counted at trace time: an update of every leaf alike runs none leaf by leaf, a sort of
    # each leaf one per leaf; nothing is counted with nothing packed, nor on later calls.
    gs = jnp.full((k,), 0.5, jnp.float32) if k > 1 else jnp.float32(0.5)
    views = k == 1 or _segments.scans_with_views()  # else JAX 0.12's scan runs as traced
    alike = autoflat.step(sweep, pack="auto", num_steps=k)
    alike(leaves(0, SAME), gs)
    assert autoflat.stats(alike).leaf_by_leaf == (0 if views else 1)
    per_leaf = autoflat.step(sorted_leaves, pack="auto", num_steps=k)
    out = per_leaf(leaves(0, SAME), gs)
    expected = leaves(0, SAME)
    for _ in range(k):
        expected = jax.jit(sorted_leaves)(expected, jnp.float32(0.5))
    tree_allclose(out, expected, exact=True)
    assert autoflat.stats(per_leaf).leaf_by_leaf == (N if views else 1)
    per_leaf(out, gs)
    assert autoflat.stats(per_leaf).leaf_by_leaf == (N if views else 1)
    flat = autoflat.step(sorted_leaves, pack=False, num_steps=k)
    flat(leaves(0, SAME), gs)
    assert autoflat.stats(flat).leaf_by_leaf == 0


def mlp_loss(params, x):
    h = x
    for layer in params:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean(h**2)


def _mlp():
    keys = jax.random.split(jax.random.key(3), N // 2)
    return [{"w": jax.random.normal(k, (4, 4)) * 0.5, "b": jnp.zeros(4) + 0.1} for k in keys]


def _labels(params):
    return [{"w": "adam", "b": "sgd"} for _ in params]


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-1)}, _labels
    ),
}


def make_update(tx):
    def update(params, opt_state, x):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return update


# Every optimizer at one step a call; at two (a scan over packed state) Adam and Adafactor,
# the others in the slow suite.
_OPTIMIZER_CASES = [
    pytest.param(
        name, k, marks=pytest.mark.slow if k == 2 and name not in ("adam", "adafactor") else ()
    )
    for name in OPTIMIZERS
    for k in (1, 2)
]


@pytest.mark.parametrize(("name", "k"), _OPTIMIZER_CASES)
def test_optimizers_over_packed_state_match_jax_jit(name, k):
    # Per-leaf work (LAMB's trust ratios, Adafactor's factored moments, multi_transform's
    # labels) stays per leaf; what every leaf does alike runs on the buffers.
    tx = OPTIMIZERS[name]()
    update = make_update(tx)
    step = autoflat.step(update, pack="auto", num_steps=k)
    params, ref_params = _mlp(), _mlp()
    opt_state, ref_opt = tx.init(params), tx.init(ref_params)
    ref = jax.jit(update)
    xs = jax.random.normal(jax.random.key(4), (3, k, 16, 4))
    for x in xs:
        params, opt_state, losses = step(params, opt_state, x if k > 1 else x[0])
        for i, x_i in enumerate(x):
            ref_params, ref_opt, ref_loss = ref(ref_params, ref_opt, x_i)
            np.testing.assert_allclose(losses[i] if k > 1 else losses, ref_loss, rtol=1e-6)
    tree_allclose((params, opt_state), (ref_params, ref_opt), rtol=1e-5, atol=1e-6)
    assert params._af_layout.groups  # packed
