# Upstream: jax-ml/jax, examples/mnist_classifier_fromscratch.py
# (snapshot commit cec06d116c05f0d52adfceee3d3b730fdbcb0ce5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: init_random_params, predict, loss, accuracy, and
# `update(params, batch)` returning `[(w - step_size * dw, b - step_size * db) for ...]`,
# which upstream defines under `if __name__ == "__main__":` (its closure value `step_size` is a
# module global here) and decorates with `@jit` (the test applies it).
# Shrunk: layer_sizes [784, 1024, 1024, 10] -> [16, 32, 32, 10]; synthetic data, batch 128 -> 8.
# ruff: noqa: E111, E114, B008, B905
# fmt: off
"""JAX MNIST from scratch: a list of (w, b) tuples rebuilt by a comprehension."""

import jax.numpy as jnp
import numpy as np
import numpy.random as npr
from jax import grad
from jax.scipy.special import logsumexp

from corpus._harness import N_STEPS, Result, calls


def init_random_params(scale, layer_sizes, rng=npr.RandomState(0)):
  return [(scale * rng.randn(m, n), scale * rng.randn(n))
          for m, n, in zip(layer_sizes[:-1], layer_sizes[1:])]

def predict(params, inputs):
  activations = inputs
  for w, b in params[:-1]:
    outputs = jnp.dot(activations, w) + b
    activations = jnp.tanh(outputs)

  final_w, final_b = params[-1]
  logits = jnp.dot(activations, final_w) + final_b
  return logits - logsumexp(logits, axis=1, keepdims=True)

def loss(params, batch):
  inputs, targets = batch
  preds = predict(params, inputs)
  return -jnp.mean(jnp.sum(preds * targets, axis=1))

def accuracy(params, batch):
  inputs, targets = batch
  target_class = jnp.argmax(targets, axis=1)
  predicted_class = jnp.argmax(predict(params, inputs), axis=1)
  return jnp.mean(predicted_class == target_class)


layer_sizes = [16, 32, 32, 10]
param_scale = 0.1
step_size = 0.001

def update(params, batch):
  grads = grad(loss)(params, batch)
  return [(w - step_size * dw, b - step_size * db)
          for (w, b), (dw, db) in zip(params, grads)]


# ---- corpus harness (not upstream) ----
BATCH = 8


def _data(seed, n):
    rng = np.random.RandomState(seed)
    images = rng.randn(n, layer_sizes[0]).astype(np.float32)
    labels = np.eye(10, dtype=np.float32)[rng.randint(0, 10, n)]
    return images, labels


train_images, train_labels = _data(0, N_STEPS * BATCH)
test_images, test_labels = _data(1, 32)
BATCHES = [
    (train_images[i * BATCH : (i + 1) * BATCH], train_labels[i * BATCH : (i + 1) * BATCH])
    for i in range(N_STEPS)
]


def run(update, chunk=None):
    """Upstream's loop: `params = update(params, next(batches))`, from
    `init_random_params(param_scale, layer_sizes)`: NumPy float64 arrays, as upstream has
    (a fresh RandomState(0) each run, so both runs start from the same values)."""
    params = init_random_params(param_scale, layer_sizes, rng=npr.RandomState(0))
    for batch in calls(BATCHES, chunk):
        params = update(params, batch)
    train_acc = accuracy(params, (train_images, train_labels))
    test_acc = accuracy(params, (test_images, test_labels))
    return Result(params, None, (train_acc, test_acc))
