"""Mutation-style state (`_writeback`): new values written into the caller's objects, and
objects that cannot be updated in place refused before the call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoflat


def test_mutation_style_writes_back_into_callers_objects():
    def update(stats, x):
        stats["total"] = stats["total"] + jnp.sum(x)
        stats["history"][0] = stats["history"][0] + 1

    ref_stats = {"total": jnp.zeros(()), "history": [jnp.zeros((), jnp.int32)]}
    ref = jax.jit(lambda s, x: (update(s, x), s)[1])
    for i in range(6):
        ref_stats = ref(ref_stats, jnp.full((3,), float(i)))

    step = autoflat.step(update, num_steps=3)
    stats = {"total": jnp.zeros(()), "history": [jnp.zeros((), jnp.int32)]}
    history = stats["history"]
    xs = jnp.stack([jnp.full((3,), float(i)) for i in range(6)])
    assert step(stats, xs[:3]) is None
    assert step(stats, xs[3:]) is None
    assert stats["history"] is history  # updated in place, not replaced
    assert float(stats["total"]) == float(ref_stats["total"]) == 45.0
    assert int(history[0]) == 6
    assert "# stats: state (assigned into at line" in autoflat.show(step)


def test_mutation_into_immutable_parts_is_a_clear_error():
    def update(state, x):
        state[0]["w"] = state[0]["w"] + x

    step = autoflat.step(update)
    state = ({"w": jnp.zeros(())}, jnp.zeros(()))
    with pytest.raises(autoflat.AutoflatError, match=r"`state\[1\]` is immutable \(tuple\)"):
        step(state, jnp.float32(1.0))
    assert float(state[0]["w"]) == 0.0  # checked before running: nothing half-written


@pytest.mark.parametrize("k", [1, 4])
def test_python_numbers_in_a_dict_changed_in_place(k):
    """A Python int the step counts up in a dict it changes in place becomes an array (one
    trace, as for returned state); Python values it leaves alone stay as they are, and a dict
    of Python values only is written back too."""

    def update(params, counters, flags, x):
        counters["n"] = counters["n"] + 1
        flags["mode"] = "train"
        params = {"w": params["w"] - counters["scale"] * x}
        return params, jnp.sum(x)

    step = autoflat.step(update, num_steps=k)
    params = {"w": jnp.ones(3)}
    counters = {"n": 0, "scale": 0.5}
    flags = {"mode": "train", "off": False}
    for _ in range(3):
        x = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
        params, _ = step(params, counters, flags, x)
    assert isinstance(counters["n"], jax.Array) and int(counters["n"]) == 3 * k
    assert counters["scale"] == 0.5 and type(counters["scale"]) is float
    assert flags == {"mode": "train", "off": False}
    assert float(params["w"][0]) == pytest.approx(1.0 - 0.5 * 3 * k)
    assert autoflat.stats(step).traces == 1


def test_python_numbers_in_a_dict_that_gains_a_key():
    """A running-totals dict that the step also gives a new key (`setdefault`): the count
    it adds to stayed a Python int (matched by leaf index, the trees differed in length), and
    the step traced again on every call."""

    def update(w, totals, x):
        loss = jnp.sum((w * x - 1.0) ** 2)
        w = w - 0.01 * jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        totals["a_loss"] = totals["a_loss"] + loss
        totals["count"] += 1
        totals.setdefault("max", jnp.asarray(-jnp.inf))
        totals["max"] = jnp.maximum(totals["max"], loss)
        return w

    step = autoflat.step(update)
    w, totals = jnp.zeros(3), {"a_loss": jnp.zeros(()), "count": 0, "tag": 7}
    for _ in range(10):
        w = step(w, totals, jnp.ones(3))
    assert isinstance(totals["count"], jax.Array) and int(totals["count"]) == 10
    assert totals["tag"] == 7 and type(totals["tag"]) is int
    assert autoflat.stats(step).traces == 2  # the dict without, then with, its new key


@pytest.mark.parametrize("k", [1, 2])
def test_dict_subclasses_are_written_back(k):
    """A `defaultdict` of totals was refused as "immutable (defaultdict)" (no `__dict__`),
    where an `OrderedDict` worked."""
    import collections

    def update(w, totals, x):
        totals["loss"] += jnp.sum(w * x)
        w = w + x
        return w

    step = autoflat.step(update, num_steps=k)
    totals = collections.defaultdict(float, loss=jnp.zeros(()))
    xs = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    w = step(jnp.zeros(3), totals, xs)
    w = step(w, totals, xs)
    assert type(totals) is collections.defaultdict
    assert float(totals["loss"]) == pytest.approx(3.0 * sum(range(2 * k)))


def test_an_object_jax_takes_as_a_leaf_changed_in_place_says_so():
    class Meter:  # not a pytree: one leaf to JAX
        def __init__(self):
            self.total = jnp.zeros(())

    def update(w, meter, x):
        meter.total = meter.total + jnp.sum(w * x)
        return w + x

    meter = Meter()
    with pytest.raises(autoflat.StateError, match=r"JAX takes a Meter as one leaf") as info:
        autoflat.step(update)(jnp.zeros(3), meter, jnp.ones(3))
    assert "named in state=" not in str(info.value)
    assert float(meter.total) == 0.0


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("where", ["body", "closure", "del"])
def test_an_input_only_taken_from_is_the_steps_own_copy(where, k):
    """A step that takes entries out of its batch (`labels = batch.pop("labels")` at the top
    of the body or in a loss function closing over it, as Hugging Face's Flax examples do, or
    `del batch["mask"]`) changes its own copy under `jax.jit`. It is not state: the caller's
    batch keeps its keys (it lost them, written back, and the next call with it raised a
    KeyError), and at num_steps=4 it is a per-step input (it was a ShapeError asking which)."""
    import numpy as np
    import optax

    opt = optax.sgd(0.1)

    def update(params, opt_state, loss_fn):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def mse(p, batch, labels):
        return jnp.mean((batch["x"] @ p["w"] - labels) ** 2)

    if where == "body":

        def train_step(params, opt_state, batch):
            labels = batch.pop("labels")
            params, opt_state, loss = update(params, opt_state, lambda p: mse(p, batch, labels))
            return params, opt_state, loss

    elif where == "closure":

        def train_step(params, opt_state, batch):
            def loss_fn(p):
                labels = batch.pop("labels")
                return mse(p, batch, labels)

            params, opt_state, loss = update(params, opt_state, loss_fn)
            return params, opt_state, loss

    else:

        def train_step(params, opt_state, batch):
            labels = batch["labels"]
            del batch["labels"]
            params, opt_state, loss = update(params, opt_state, lambda p: mse(p, batch, labels))
            return params, opt_state, loss

    rng = np.random.default_rng(0)
    batches = [
        {"x": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32), "labels": jnp.ones(2) * i}
        for i in range(8)
    ]
    ref_step = jax.jit(train_step)
    params = {"w": jnp.zeros(3)}
    ref_params, ref_state, ref_losses = params, opt.init(params), []
    for batch in batches:
        ref_params, ref_state, loss = ref_step(ref_params, ref_state, batch)
        ref_losses.append(loss)
    assert all(sorted(b) == ["labels", "x"] for b in batches)

    step = autoflat.step(train_step, num_steps=k)
    chunks = (
        batches
        if k == 1
        else [jax.tree.map(lambda *xs: jnp.stack(xs), *batches[i : i + k]) for i in (0, 4)]
    )
    p, s, losses = params, opt.init(params), []
    for chunk in chunks:
        p, s, loss = step(p, s, chunk)
        losses.append(jnp.atleast_1d(loss))
    assert all(sorted(c) == ["labels", "x"] for c in chunks)
    np.testing.assert_allclose(p["w"], ref_params["w"], rtol=1e-6)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-6)
    spelling = {"body": "batch.pop(...)", "closure": "batch.pop(...)", "del": 'del batch["labels"]'}
    assert (
        f"# batch: scanned (per-step{' input' if k == 1 else ': leading axis 4'}"
        in autoflat.show(step)
    )
    assert f"`{spelling[where]}` at line" in autoflat.show(step)
    assert "changes the step's own copy, as under jax.jit, not your object" in autoflat.show(step)
    assert autoflat.stats(step).traces == 1


def test_an_input_taken_from_and_changed_is_still_state():
    """`d.pop(k)` beside a change that adds (`d.update(...)`, `d[k] = ...`) is mutation-style
    state as before: the caller's dict has the new contents, the key taken gone."""

    def update(totals, x):
        old = totals.pop("old")
        totals["sum"] = totals["sum"] + old + jnp.sum(x)
        return jnp.sum(x)

    step = autoflat.step(update)
    totals = {"sum": jnp.zeros(()), "old": jnp.ones(())}
    step(totals, jnp.ones(3))
    assert sorted(totals) == ["sum"]
    assert float(totals["sum"]) == 4.0
    assert "# totals: state (assigned into at line" in autoflat.show(step)
