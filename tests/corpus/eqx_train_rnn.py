# Upstream: patrick-kidger/equinox, docs/examples/train_rnn.ipynb
# (snapshot commit 9336d820b2ef66b360fc6cb3611b3da5cefbb14d).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: dataloader, get_data, RNN (a GRUCell run by `lax.scan` inside the model),
# compute_loss (under `@eqx.filter_value_and_grad`) and `make_step(model, x, y, opt_state)`
# returning `loss, model, opt_state`, which upstream defines inside `main` (its closure values
# `compute_loss` and `optim` are module globals here) and decorates with `@eqx.filter_jit` (the
# test applies it); the final accuracy.
# Shrunk: dataset_size 10000 -> 64, batch_size 32 -> 8, hidden_size 16 -> 6; sequence length
# 16 -> 8 (get_data's linspace).
# fmt: off
"""Equinox RNN: a `lax.scan` inside the model, the loss returned first."""

import math

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import optax  # https://github.com/deepmind/optax

from corpus._harness import N_STEPS, Result, calls, collect, real


def dataloader(arrays, batch_size):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = np.arange(dataset_size)
    while True:
        perm = np.random.permutation(indices)
        start = 0
        end = batch_size
        while end <= dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


def get_data(dataset_size, *, key):
    t = jnp.linspace(0, 2 * math.pi, 8)
    offset = jrandom.uniform(key, (dataset_size, 1), minval=0, maxval=2 * math.pi)
    x1 = jnp.sin(t + offset) / (1 + t)
    x2 = jnp.cos(t + offset) / (1 + t)
    y = jnp.ones((dataset_size, 1))

    half_dataset_size = dataset_size // 2
    x1 = x1.at[:half_dataset_size].multiply(-1)
    y = y.at[:half_dataset_size].set(0)
    x = jnp.stack([x1, x2], axis=-1)

    return x, y


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jrandom.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, input)
        # sigmoid because we're performing binary classification
        return jax.nn.sigmoid(self.linear(out) + self.bias)


dataset_size=64
batch_size=8
learning_rate=3e-3
hidden_size=6
depth=1
seed=5678

data_key, model_key = jrandom.split(jrandom.PRNGKey(seed), 2)


@eqx.filter_value_and_grad
def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    # Trains with respect to binary cross-entropy
    return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y))

# Important for efficiency whenever you use JAX: wrap everything into a single JIT
# region.
def make_step(model, x, y, opt_state):
    loss, grads = compute_loss(model, x, y)
    updates, opt_state = optim.update(
        grads, opt_state, eqx.filter(model, eqx.is_array)
    )
    model = eqx.apply_updates(model, updates)
    return loss, model, opt_state

optim = optax.adam(learning_rate)


# ---- corpus harness (not upstream) ----
xs, ys = get_data(dataset_size, key=data_key)
np.random.seed(0)
_iter_data = dataloader((xs, ys), batch_size)
BATCHES = [next(_iter_data) for _ in range(N_STEPS)]


def run(make_step, chunk=None):
    """Upstream's `main`: `opt_state = optim.init(eqx.filter(model, eqx.is_array))`, the loop
    `loss, model, opt_state = make_step(model, x, y, opt_state)`, then its final accuracy."""
    model = RNN(in_size=2, out_size=1, hidden_size=hidden_size, key=model_key)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    losses = []
    for x, y in calls(BATCHES, chunk):
        loss, model, opt_state = make_step(model, x, y, opt_state)
        losses.append(loss)
    model = real(model)
    pred_ys = jax.vmap(model)(xs)
    num_correct = jnp.sum((pred_ys > 0.5) == ys)
    final_accuracy = (num_correct / dataset_size).item()
    final = (eqx.filter(model, eqx.is_array), opt_state)
    return Result(final, collect(losses, chunk), (final_accuracy, pred_ys))
