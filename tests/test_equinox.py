"""Equinox models (non-array fields, batch-norm state) under autoflat equal `eqx.filter_jit`
loops."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import chunk, tree_allclose

import autoflat

tx = optax.adam(3e-3)


def mlp_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def mlp_update(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(mlp_loss)(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear
    activation: object = eqx.field(static=True)
    channels: int = eqx.field(static=True)

    def __init__(self, key, channels=4):
        k1, k2, k3 = jax.random.split(key, 3)
        # no bias before batch norm: its true gradient is zero, and Adam would amplify
        # float noise in it into full-size steps of random sign
        self.conv1 = eqx.nn.Conv2d(1, channels, 3, padding=1, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(channels, axis_name="batch", mode="batch")
        self.conv2 = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(channels * 8 * 8, 10, key=k3)
        self.activation = jax.nn.relu
        self.channels = channels

    def __call__(self, x, state):
        x = self.conv1(x)
        x, state = self.norm(x, state)
        x = self.activation(x)
        x = self.activation(self.conv2(x))
        return self.head(x.reshape(-1)), state


def cnn_loss(model, state, x, y):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, state = batched(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def cnn_update(model, state, opt_state, x, y):
    (loss, state), grads = eqx.filter_value_and_grad(cnn_loss, has_aux=True)(model, state, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, state, opt_state, loss


def _reference(update, state_args, xs, n):
    ref = eqx.filter_jit(update)
    losses = []
    for i in range(n):
        *state_args, loss = ref(*state_args, *(x[i] for x in xs))
        losses.append(loss)
    return state_args, jnp.stack(losses)


def _run(step, state_args, xs, n, k):
    losses = []
    for start in range(0, n, k):
        stop = min(start + k, n)
        batch = [x[start] for x in xs] if k == 1 else [chunk(x, start, stop) for x in xs]
        *state_args, loss = step(*state_args, *batch)
        losses.append(jnp.atleast_1d(loss))
    return state_args, jnp.concatenate(losses)


@pytest.mark.parametrize("k,n", [(1, 3), (3, 6), (10, 10), (10, 13)])
def test_mlp_with_activation_fields(k, n):
    model = eqx.nn.MLP(3, 2, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    xs = (
        jax.random.normal(jax.random.key(1), (n, 8, 3)),
        jax.random.normal(jax.random.key(2), (n, 8, 2)),
    )
    (rm, ro), rl = _reference(mlp_update, [model, opt_state], xs, n)
    step = autoflat.step(mlp_update, num_steps=k)
    (m, o), losses = _run(step, [model, opt_state], xs, n, k)
    stats = autoflat.stats(step)
    assert stats.flattens == 2 and stats.rebuilds == 0
    tree_allclose(m, rm)
    tree_allclose(o, ro)
    np.testing.assert_allclose(losses, rl, rtol=1e-5, atol=1e-6)
    assert isinstance(m, eqx.nn.MLP) and m.activation is jax.nn.gelu


# (one step a call: the corpus's upstream `eqx_stateful`, BatchNorm state too; here slow)
@pytest.mark.parametrize("k,n", [pytest.param(1, 2, marks=pytest.mark.slow), (3, 7)])
def test_cnn_with_batchnorm_state(k, n):
    model, state = eqx.nn.make_with_state(CNN)(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    xs = (
        jax.random.normal(jax.random.key(1), (n, 4, 1, 8, 8)),
        jax.random.randint(jax.random.key(2), (n, 4), 0, 10),
    )
    (rm, rs, ro), rl = _reference(cnn_update, [model, state, opt_state], xs, n)
    step = autoflat.step(cnn_update, num_steps=k)
    src = autoflat.show(step)
    assert "# state: state (returned)" in src and "# x: scanned (per-step input)" in src
    (m, s, o), losses = _run(step, [model, state, opt_state], xs, n, k)
    tree_allclose(m, rm, rtol=1e-4, atol=1e-5)
    tree_allclose(s, rs, rtol=1e-4, atol=1e-5)
    tree_allclose(o, ro, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(losses, rl, rtol=1e-4, atol=1e-5)
    assert isinstance(s, eqx.nn.State)
    # the trained model still runs in inference mode outside autoflat
    inference = eqx.nn.inference_mode(autoflat.unwrap(m))
    logits, _ = inference(jnp.ones((1, 8, 8)), autoflat.unwrap(s))
    assert logits.shape == (10,)


class DropoutMLP(eqx.Module):
    layers: tuple
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = (eqx.nn.Linear(3, 16, key=k1), eqx.nn.Linear(16, 2, key=k2))
        self.dropout = eqx.nn.Dropout(0.3)

    def __call__(self, x, *, key):
        x = jax.nn.relu(self.layers[0](x))
        x = self.dropout(x, key=key)
        return self.layers[1](x)


def dropout_update(model, opt_state, x, y, key):
    def loss_fn(model):
        keys = jax.random.split(key, x.shape[0])
        pred = jax.vmap(lambda xi, ki: model(xi, key=ki))(x, keys)
        return jnp.mean((pred - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def test_dropout_with_per_step_keys():
    n = 6
    model = DropoutMLP(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    xs = (
        jax.random.normal(jax.random.key(1), (n, 8, 3)),
        jax.random.normal(jax.random.key(2), (n, 8, 2)),
        jax.random.split(jax.random.key(3), n),
    )
    (rm, ro), rl = _reference(dropout_update, [model, opt_state], xs, n)
    (m, o), losses = _run(autoflat.step(dropout_update, num_steps=3), [model, opt_state], xs, n, 3)
    tree_allclose(m, rm)
    tree_allclose(o, ro)
    np.testing.assert_allclose(losses, rl, rtol=1e-5)
    # inference mode turns dropout off: the trained model runs without a key
    frozen = eqx.nn.inference_mode(autoflat.unwrap(m))
    assert frozen(jnp.ones(3), key=None).shape == (2,)


def frozen_update(trainable, frozen, opt_state, x, y):
    def loss_fn(trainable):
        return mlp_loss(eqx.combine(trainable, frozen), x, y)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = eqx.apply_updates(trainable, updates)
    return trainable, opt_state, loss


def test_partition_and_combine_for_frozen_parts():
    n = 6
    model = eqx.nn.MLP(3, 2, 16, 2, key=jax.random.key(0))
    # train only the last layer: everything else is frozen (same for every step: broadcast)
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), spec, (True, True))
    trainable, frozen = eqx.partition(model, spec)
    opt_state = tx.init(trainable)
    xs = (
        jax.random.normal(jax.random.key(1), (n, 8, 3)),
        jax.random.normal(jax.random.key(2), (n, 8, 2)),
    )

    ref = eqx.filter_jit(frozen_update)
    rt, ro, rl = trainable, opt_state, []
    for i in range(n):
        rt, ro, loss = ref(rt, frozen, ro, xs[0][i], xs[1][i])
        rl.append(loss)
    step = autoflat.step(frozen_update, num_steps=3, broadcast="frozen")
    assert "# frozen: broadcast (broadcast=)" in autoflat.show(step)
    t, o = trainable, opt_state
    losses = []
    for start in (0, 3):
        t, o, loss = step(t, frozen, o, xs[0][start : start + 3], xs[1][start : start + 3])
        losses.append(loss)
    tree_allclose(t, rt)
    tree_allclose(o, ro)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(rl), rtol=1e-5)
    # the frozen part is the same immutable object every call: flattened once only
    assert autoflat.stats(step).flattens == 3  # trainable and opt_state once, frozen once
    # the frozen layers did not move
    final = eqx.combine(autoflat.unwrap(t), frozen)
    tree_allclose(final.layers[0], model.layers[0], exact=True)
