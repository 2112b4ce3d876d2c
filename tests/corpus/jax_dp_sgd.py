# Upstream: jax-ml/jax, examples/differentially_private_sgd.py
# (snapshot commit cec06d116c05f0d52adfceee3d3b730fdbcb0ce5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: the stax model, loss, accuracy, clipped_grad, private_grad, shape_as_image,
# and `private_update(rng, i, opt_state, batch)`, which upstream defines inside `main` (its
# closure values `get_params`, `opt_update` and the absl flag objects are module globals here,
# the flags as small stand-ins with a `.value`) and decorates with `@jit` (the test applies it).
# Shrunk: Conv(16, (8, 8))/Conv(32, (4, 4))/Dense(32) -> Conv(3, (3, 3))/Conv(3, (2, 2))/Dense(8)
# (smaller kernels: XLA compiles the per-example gradients for seconds); 28x28 MNIST -> 16x16
# synthetic images (shape_as_image's 28s -> 16s), batch 256 -> 5.
# ruff: noqa: E111, E114, B905
# fmt: off
"""JAX DP-SGD: a reused key folded with the step counter, per-example clipped gradients."""

import types

import jax.numpy as jnp
import numpy as np
from jax import grad, random, vmap
from jax.example_libraries import optimizers, stax
from jax.tree_util import tree_flatten, tree_unflatten

from corpus._harness import N_STEPS, Result, calls

init_random_params, predict = stax.serial(
    stax.Conv(3, (3, 3), padding='SAME', strides=(2, 2)),
    stax.Relu,
    stax.MaxPool((2, 2), (1, 1)),
    stax.Conv(3, (2, 2), padding='VALID', strides=(2, 2)),
    stax.Relu,
    stax.MaxPool((2, 2), (1, 1)),
    stax.Flatten,
    stax.Dense(8),
    stax.Relu,
    stax.Dense(10),
)


def loss(params, batch):
  inputs, targets = batch
  logits = predict(params, inputs)
  logits = stax.logsoftmax(logits)  # log normalize
  return -jnp.mean(jnp.sum(logits * targets, axis=1))  # cross entropy loss


def accuracy(params, batch):
  inputs, targets = batch
  target_class = jnp.argmax(targets, axis=1)
  predicted_class = jnp.argmax(predict(params, inputs), axis=1)
  return jnp.mean(predicted_class == target_class)


def clipped_grad(params, l2_norm_clip, single_example_batch):
  """Evaluate gradient for a single-example batch and clip its grad norm."""
  grads = grad(loss)(params, single_example_batch)
  nonempty_grads, tree_def = tree_flatten(grads)
  total_grad_norm = jnp.linalg.norm(
      jnp.array([jnp.linalg.norm(neg.ravel()) for neg in nonempty_grads]))
  divisor = jnp.maximum(total_grad_norm / l2_norm_clip, 1.)
  normalized_nonempty_grads = [g / divisor for g in nonempty_grads]
  return tree_unflatten(tree_def, normalized_nonempty_grads)


def private_grad(params, batch, rng, l2_norm_clip, noise_multiplier,
                 batch_size):
  """Return differentially private gradients for params, evaluated on batch."""
  clipped_grads = vmap(clipped_grad, (None, None, 0))(params, l2_norm_clip, batch)
  clipped_grads_flat, grads_treedef = tree_flatten(clipped_grads)
  aggregated_clipped_grads = [g.sum(0) for g in clipped_grads_flat]
  rngs = random.split(rng, len(aggregated_clipped_grads))
  noised_aggregated_clipped_grads = [
      g + l2_norm_clip * noise_multiplier * random.normal(r, g.shape)
      for r, g in zip(rngs, aggregated_clipped_grads)]
  normalized_noised_aggregated_clipped_grads = [
      g / batch_size for g in noised_aggregated_clipped_grads]
  return tree_unflatten(grads_treedef, normalized_noised_aggregated_clipped_grads)


def shape_as_image(images, labels, dummy_dim=False):
  target_shape = (-1, 1, 16, 16, 1) if dummy_dim else (-1, 16, 16, 1)
  return jnp.reshape(images, target_shape), labels


# Stand-ins for upstream's absl flags, at their defaults (the batch size shrunk).
def _flag(value):
    return types.SimpleNamespace(value=value)


_LEARNING_RATE = _flag(.15)
_NOISE_MULTIPLIER = _flag(1.1)
_L2_NORM_CLIP = _flag(1.0)
_BATCH_SIZE = _flag(5)
_SEED = _flag(0)

opt_init, opt_update, get_params = optimizers.sgd(_LEARNING_RATE.value)

def private_update(rng, i, opt_state, batch):
  params = get_params(opt_state)
  rng = random.fold_in(rng, i)  # get new key for new random numbers
  return opt_update(
      i,
      private_grad(params, batch, rng, _L2_NORM_CLIP.value,
                   _NOISE_MULTIPLIER.value, _BATCH_SIZE.value), opt_state)


# ---- corpus harness (not upstream) ----
def _data(seed, n):
    rng = np.random.RandomState(seed)
    images = rng.rand(n, 256).astype(np.float32)
    labels = np.eye(10, dtype=np.float32)[rng.randint(0, 10, n)]
    return images, labels


B = _BATCH_SIZE.value
train_images, train_labels = _data(0, N_STEPS * B)
test_images, test_labels = _data(1, 16)
BATCHES = [
    shape_as_image(train_images[i * B : (i + 1) * B], train_labels[i * B : (i + 1) * B],
                   dummy_dim=True)
    for i in range(N_STEPS)
]


def run(private_update, chunk=None):
    """Upstream's loop: `opt_state = private_update(key, next(itercount), opt_state,
    shape_as_image(*next(batches), dummy_dim=True))`, the same `key` every step; with `chunk`,
    the counter values and batches of `chunk` steps are stacked."""
    key = random.key(_SEED.value)
    _, init_params = init_random_params(key, (-1, 16, 16, 1))
    opt_state = opt_init(init_params)
    for i, batch in calls(list(zip(range(N_STEPS), BATCHES, strict=True)), chunk):
        opt_state = private_update(key, i, opt_state, batch)
    params = get_params(opt_state)
    test_acc = accuracy(params, shape_as_image(test_images, test_labels))
    test_loss = loss(params, shape_as_image(test_images, test_labels))
    return Result(opt_state, None, (test_acc, test_loss))
