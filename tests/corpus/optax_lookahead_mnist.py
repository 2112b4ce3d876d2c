# Upstream: google-deepmind/optax, examples/lookahead_mnist.ipynb
# (snapshot commit 2edbcbe2390da13983b92cbef94ac0460ecde1c5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: CNN (Flax NNX), predict and loss_accuracy (`nnx.update(model, params)`
# inside `@jax.jit`), dataset_stats, and `train_step(params, model, solver_state, batch)` with
# `optax.lookahead` over `optax.LookaheadParams` (decorated `@jax.jit` upstream: the test
# applies it; predict and loss_accuracy keep theirs).
# Shrunk: Conv 32/64 -> 3/5 features, Linear(7*7*64, 256) -> Linear(2*2*5, 6); 28x28 MNIST ->
# 8x8 synthetic images, batch 256 -> 6.
# ruff: noqa: E111, E114
# fmt: off
"""optax lookahead: LookaheadParams (fast, slow) and a Flax NNX module passed to `jax.jit`."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from corpus._harness import N_STEPS, Result, calls, collect

FAST_LEARNING_RATE = 0.002 # @param{type:"number"}
SLOW_LEARNING_RATE = 0.1 # @param{type:"number"}
SYNC_PERIOD = 5 # @param{type:"integer"}


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, in_features, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(in_features=in_features,
                          out_features=3,
                          kernel_size=(3, 3),
                          rngs=rngs)
    self.pool1 = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.conv2 = nnx.Conv(in_features=3,
                          out_features=5,
                          kernel_size=(3, 3),
                          rngs=rngs)
    self.pool2 = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.dense1 = nnx.Linear(in_features=2*2*5, out_features=6, rngs=rngs)
    self.dense2 = nnx.Linear(in_features=6, out_features=10, rngs=rngs)

  def __call__(self, x):
    x = self.conv1(x)
    x = nnx.relu(x)
    x = self.pool1(x)
    x = self.conv2(x)
    x = nnx.relu(x)
    x = self.pool2(x)
    x = x.reshape((x.shape[0], -1))  # flatten
    x = self.dense1(x)
    x = nnx.relu(x)
    x = self.dense2(x)
    return x

@jax.jit
def predict(params, model, inputs):
  nnx.update(model, params)
  return model(inputs)


@jax.jit
def loss_accuracy(params, model, data):
  """Computes loss and accuracy over a mini-batch.

  Args:
    params: parameters of the model.
    model: Instance of the nnx.Module.
    data: tuple of (inputs, labels).

  Returns:
    loss: float
    accuracy: float
  """
  inputs, labels = data
  logits = predict(params, model, inputs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=labels
  ).mean()
  accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
  return loss, {"accuracy": accuracy}


fast_solver = optax.adam(FAST_LEARNING_RATE)
solver = optax.lookahead(fast_solver, SYNC_PERIOD, SLOW_LEARNING_RATE)

def dataset_stats(params, model, data_loader):
  """Computes loss and accuracy over the dataset `data_loader`."""
  all_accuracy = []
  all_loss = []
  for batch in data_loader:
    batch_loss, batch_aux = loss_accuracy(params, model, batch)
    all_loss.append(batch_loss)
    all_accuracy.append(batch_aux["accuracy"])
  return {"loss": jnp.mean(jnp.array(all_loss)),
          "accuracy": jnp.mean(jnp.array(all_accuracy))}


def train_step(params, model, solver_state, batch):
  # Performs a one step update.
  (loss, aux), grad = jax.value_and_grad(loss_accuracy, has_aux=True)(
      params.fast, model, batch
  )
  updates, solver_state = solver.update(grad, solver_state, params)
  params = optax.apply_updates(params, updates)
  return params, solver_state, loss, aux


# ---- corpus harness (not upstream) ----
IMG_SIZE = (8, 8, 1)


def _batches(seed, n):
    rng = np.random.RandomState(seed)
    return [
        (rng.rand(6, *IMG_SIZE).astype(np.float32), rng.randint(0, 10, 6).astype(np.int32))
        for _ in range(n)
    ]


TRAIN_BATCHES = _batches(0, N_STEPS)
TEST_BATCHES = _batches(1, 2)


def run(train_step, chunk=None):
    """Upstream's setup and loop (`params, solver_state, train_loss, train_aux =
    train_step(params, net, solver_state, train_batch)`), then its `dataset_stats` on the slow
    parameters. `net` itself is returned too: upstream's `jax.jit` leaves the caller's module
    as it was."""
    net = CNN(IMG_SIZE[-1], nnx.Rngs(0))
    dummy_data = jnp.ones((1,) + IMG_SIZE, dtype=jnp.float32)
    _ = net(dummy_data)
    params = nnx.state(net, nnx.Param)
    params = optax.LookaheadParams.init_synced(params)
    solver_state = solver.init(params)
    outputs = []
    for train_batch in calls(TRAIN_BATCHES, chunk):
        params, solver_state, train_loss, train_aux = train_step(
            params, net, solver_state, train_batch
        )
        outputs.append((train_loss, train_aux))
    post = dataset_stats(params.slow, net, TEST_BATCHES)
    state = (params, solver_state, nnx.to_pure_dict(nnx.state(net)))
    return Result(state, collect(outputs, chunk), post)
