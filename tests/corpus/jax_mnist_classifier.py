# Upstream: jax-ml/jax, examples/mnist_classifier.py
# (snapshot commit cec06d116c05f0d52adfceee3d3b730fdbcb0ce5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: loss, accuracy, the stax model, and `update(i, opt_state, batch)` with
# `jax.example_libraries.optimizers.momentum`, which upstream defines under
# `if __name__ == "__main__":` (its closure values `opt_update`, `get_params` are module
# globals here) and decorates with `@jit` (the test applies it).
# Shrunk: Dense(1024) -> Dense(32); 28x28 MNIST images -> 16 synthetic features, batch 128 -> 8.
# ruff: noqa: E111, E114
# fmt: off
"""JAX `example_libraries` MNIST classifier: `opt_update(i, grad, opt_state)` state."""

import jax.numpy as jnp
import numpy as np
from jax import grad, random
from jax.example_libraries import optimizers, stax
from jax.example_libraries.stax import Dense, LogSoftmax, Relu

from corpus._harness import N_STEPS, Result, calls


def loss(params, batch):
  inputs, targets = batch
  preds = predict(params, inputs)
  return -jnp.mean(jnp.sum(preds * targets, axis=1))

def accuracy(params, batch):
  inputs, targets = batch
  target_class = jnp.argmax(targets, axis=1)
  predicted_class = jnp.argmax(predict(params, inputs), axis=1)
  return jnp.mean(predicted_class == target_class)

init_random_params, predict = stax.serial(
    Dense(32), Relu,
    Dense(32), Relu,
    Dense(10), LogSoftmax)

step_size = 0.001
momentum_mass = 0.9

opt_init, opt_update, get_params = optimizers.momentum(step_size, mass=momentum_mass)

def update(i, opt_state, batch):
  params = get_params(opt_state)
  return opt_update(i, grad(loss)(params, batch), opt_state)


# ---- corpus harness (not upstream) ----
FEATURES, BATCH = 16, 8


def _data(seed, n):
    rng = np.random.RandomState(seed)
    images = rng.randn(n, FEATURES).astype(np.float32)
    labels = np.eye(10, dtype=np.float32)[rng.randint(0, 10, n)]
    return images, labels


train_images, train_labels = _data(0, N_STEPS * BATCH)
test_images, test_labels = _data(1, 32)
BATCHES = [
    (train_images[i * BATCH : (i + 1) * BATCH], train_labels[i * BATCH : (i + 1) * BATCH])
    for i in range(N_STEPS)
]


def run(update, chunk=None):
    """Upstream's loop: `opt_state = update(next(itercount), opt_state, next(batches))`; with
    `chunk`, the counter values and batches of `chunk` steps are stacked."""
    rng = random.key(0)
    _, init_params = init_random_params(rng, (-1, FEATURES))
    opt_state = opt_init(init_params)
    for i, batch in calls(list(zip(range(N_STEPS), BATCHES, strict=True)), chunk):
        opt_state = update(i, opt_state, batch)
    params = get_params(opt_state)
    train_acc = accuracy(params, (train_images, train_labels))
    test_acc = accuracy(params, (test_images, test_labels))
    test_loss = loss(params, (test_images, test_labels))
    return Result(opt_state, None, (train_acc, test_acc, test_loss))
