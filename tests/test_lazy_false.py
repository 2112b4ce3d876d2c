"""`lazy=False`: the objects a step returned go back in without being taken in from scratch.

An object the step built and gets back unchanged stands for its handle (`Step._last`): of
immutable structure (an Equinox module, optax's tuples) by identity; a mutable one (a dict)
while its tree and leaves are still those it was built from, checked with one `tree_flatten`
and no per-leaf work (no structure interned, no placement read, no buffers recorded). Never
stale: a dict changed in place is taken in as it is now. Results equal a `jax.jit` loop.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from test_other_trees import _dict_step, tx  # the same dict step and Adam

import autoflat
from autoflat._handles import writeback
from autoflat._runtime import call as call_module

X = jax.random.normal(jax.random.key(1), (4, 2))


def _eqx_step(model, opt_state, x):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def _start(kind):
    if kind == "eqx":
        model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
        return _eqx_step, model, tx.init(eqx.filter(model, eqx.is_array))
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    return _dict_step, params, tx.init(params)


def _xs(k):
    return jnp.stack([X + i for i in range(k)]) if k > 1 else X


def _reference(fn, state, calls, k):
    """`calls` calls of k steps, as k sequential calls of `jax.jit(fn)` each (through
    `eqx.filter_jit`, which is `jax.jit` with the non-array leaves static)."""
    jit = eqx.filter_jit(fn)
    xs = _xs(k)
    for _ in range(calls):
        for i in range(k):
            *state, _ = jit(*state, xs[i] if k > 1 else xs)
    return tuple(state)


class _Counting:
    """Counts the calls of the take-in functions that do work per leaf."""

    NAMES = ("flatten", "intern", "placement_of", "_with_arrays")

    def __init__(self, monkeypatch):
        self.calls = {}
        for name in self.NAMES:
            self._wrap(monkeypatch, call_module, name)
        for name in ("all_ours", "record_written"):
            self._wrap(monkeypatch, writeback, name)

    def _wrap(self, monkeypatch, module, name):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("kind", ["eqx", "dict"])
@pytest.mark.parametrize("k", [1, 3])
def test_objects_passed_back_unchanged_are_not_taken_in_again(kind, k, monkeypatch):
    """Warm calls fed the objects the step returned: no copy, no structure interned, no
    placement read, no buffers checked or recorded one by one; an immutable object is not
    flattened at all, a dict once (to see that it is unchanged). Results equal `jax.jit`."""
    fn, state, opt_state = _start(kind)
    step = autoflat.step(fn, num_steps=k, lazy=False)
    xs = _xs(k)
    s, o, _ = step(state, opt_state, xs)
    before = autoflat.stats(step)
    counting = _Counting(monkeypatch)
    for _ in range(3):
        s, o, _ = step(s, o, xs)
    after = autoflat.stats(step)
    assert counting.calls == {}
    assert after.copies == before.copies
    assert not autoflat.is_handle(s) and not autoflat.is_handle(o)
    if kind == "eqx":
        assert after.flattens == before.flattens
        assert after.fast_path == before.fast_path + 6
    else:
        assert after.flattens == before.flattens + 6  # the check, one per state per call
        assert after.fast_path == before.fast_path
    tree_allclose((s, o), _reference(fn, (state, opt_state), 4, k))


@pytest.mark.parametrize("pack", [False, True])
def test_a_dict_changed_in_place_is_taken_as_it_is_now(pack):
    """Never stale: a value replaced in the returned dict, a key added and one removed, a
    Python number set into the optimizer's state: each call sees the dict as it is then,
    exactly as a `jax.jit` loop given the same changes does."""
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)

    def fit(params, opt_state, x):
        grads = jax.grad(lambda p: sum(jnp.sum(v * x) for v in jax.tree.leaves(p)))(params)
        updates, opt_state = injected.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state

    changes = [
        lambda p, o: p.__setitem__("w", p["w"] * 10.0),
        lambda p, o: o.hyperparams.__setitem__("learning_rate", jnp.asarray(0.5, jnp.float32)),
        lambda p, o: None,
        lambda p, o: p.__setitem__("v", jnp.ones(2)),
        lambda p, o: None,
        lambda p, o: (
            p.pop("v"),
            o.hyperparams.__setitem__("learning_rate", jnp.asarray(0.2, jnp.float32)),
        ),
    ]
    x = jnp.arange(2.0)

    def run(call):
        params = {"w": jnp.ones(2)}
        opt_state = injected.init(params)
        history = []
        for change in changes:
            params, opt_state = call(params, opt_state, x)
            history.append(jax.tree.map(np.asarray, (params, opt_state)))
            change(params, opt_state)
        return history

    step = autoflat.step(fit, lazy=False, pack=pack)
    got = run(step)
    want = run(jax.jit(fit))
    for g, w in zip(got, want, strict=True):
        tree_allclose(g, w)


@pytest.mark.parametrize("kind", ["dict", "eqx"])
@pytest.mark.parametrize("pack", ["auto", False])
def test_a_kept_array_is_copied_and_stays_valid(kind, pack):
    """An array of the returned object that the caller also holds is not donated: the
    object's arrays are copied once, and the kept array is still readable after the call.
    (An Equinox module, of immutable structure, goes in without a flatten: its arrays held
    elsewhere are found all the same.)"""
    fn, state, opt_state = _start(kind)
    step = autoflat.step(fn, lazy=False, pack=pack)
    s, o, _ = step(state, opt_state, X)
    s, o, _ = step(s, o, X)
    before = autoflat.stats(step)
    kept = s["w"] if kind == "dict" else s.layers[0].weight
    value = np.asarray(kept)
    s, o, _ = step(s, o, X)
    after = autoflat.stats(step)
    assert after.copies == before.copies + 1
    np.testing.assert_array_equal(kept, value)
    s, o, _ = step(s, o, X)
    assert autoflat.stats(step).copies == after.copies  # held nowhere else again
    tree_allclose((s, o), _reference(fn, (state, opt_state), 4, 1))


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_a_returned_object_also_passed_as_broadcast_is_not_donated(kind):
    """`step(params, teacher=params)` with the object the step returned: the state takes a
    copy (its buffers are read as the broadcast argument in the same call), and the object
    stays valid, as under `jax.jit`."""

    def pull(params, teacher, x):
        params = jax.tree.map(lambda p, t: p - 0.1 * (p - t) * x + 0.01, params, teacher)
        return params

    start = (jnp.ones(3), jnp.zeros(2))
    if kind == "dict":
        start = {"a": start[0], "b": start[1]}
    step = autoflat.step(pull, lazy=False, broadcast="teacher")
    p = step(start, start, 1.0)
    q = step(p, p, 1.0)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(p))
    jit = jax.jit(pull)
    want_p = jit(start, start, 1.0)
    tree_allclose(p, want_p)
    tree_allclose(q, jit(want_p, want_p, 1.0))
    tree_allclose(step(q, start, 1.0), jit(jit(want_p, want_p, 1.0), start, 1.0))


@pytest.mark.parametrize("kind", ["eqx", "dict"])
def test_state_survives_a_failed_call(kind):
    """A call that fails (a batch of the wrong shape) leaves the returned objects usable:
    the next call takes them as before, with the results of a `jax.jit` loop."""
    fn, state, opt_state = _start(kind)
    step = autoflat.step(fn, lazy=False)
    s, o, _ = step(state, opt_state, X)
    s, o, _ = step(s, o, X)
    with pytest.raises(TypeError):
        step(s, o, jnp.ones((4, 5)))
    # (The error's traceback may still reach the dict's arrays: the next call may copy them.)
    s, o, _ = step(s, o, X)
    before = autoflat.stats(step)
    s, o, _ = step(s, o, X)
    assert autoflat.stats(step).copies == before.copies
    tree_allclose((s, o), _reference(fn, (state, opt_state), 4, 1))


def test_packed_lazy_false_dict_keeps_the_callers_arrays():
    """With `pack=True` the program takes packed buffers, which the returned dict does not
    hold: passed back unchanged, it goes in as those buffers with no copy, and the dict
    passed in stays readable."""
    fn, state, opt_state = _start("dict")
    step = autoflat.step(fn, lazy=False, pack=True)
    s, o, _ = step(state, opt_state, X)
    before = autoflat.stats(step)
    old = s
    s, o, _ = step(s, o, X)
    assert autoflat.stats(step).copies == before.copies
    np.asarray(old["w"])
    tree_allclose((s, o), _reference(fn, (state, opt_state), 2, 1), rtol=1e-5)
