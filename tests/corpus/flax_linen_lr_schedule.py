# Upstream: google/flax, docs/guides/training_techniques/lr_schedule.rst (the "Learning rate
# schedule" side, without the guide's `#!` highlight marks; snapshot commit
# 18f8f311c275d57f46d95e41b15aa97b454754c0).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: CNN (Linen), compute_metrics, create_learning_rate_fn, create_train_state
# (`optax.sgd(learning_rate_fn, momentum)`, `TrainState.create`), and `train_step(state, batch,
# learning_rate_fn)` returning `new_state, metrics` with `metrics['learning_rate'] =
# learning_rate_fn(state.step)` (decorated `@functools.partial(jax.jit, static_argnums=2)`
# upstream: the test applies it).
# Shrunk: Conv 32/64 -> 3/5 features, Dense(256) -> Dense(6); 28x28 images -> 8x8 (the
# `jnp.ones([1, 28, 28, 1])` in create_train_state with them), the guide's random dummy data
# (float64 NumPy) with train_ds_size 128 -> 40 and batch_size 128 -> 5.
# ruff: noqa: E111, E114
# fmt: off
"""Flax Linen `TrainState` with an optax schedule: a function argument, `state.step` read."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from corpus._harness import N_STEPS, Result, calls, collect


class CNN(nn.Module):
  """A simple CNN model."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(features=3, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.Conv(features=5, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))  # flatten
    x = nn.Dense(features=6)(x)
    x = nn.relu(x)
    x = nn.Dense(features=10)(x)
    return x

def get_dummy_data(ds_size):
  image = np.random.rand(ds_size, 8, 8, 1)
  label = np.random.randint(low=0, high=10, size=(ds_size,))
  return {'image': image, 'label': label}

def compute_metrics(logits, labels):
  one_hot = jax.nn.one_hot(labels, 10)
  loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  metrics = {
      'loss': loss,
      'accuracy': accuracy,
  }
  return metrics


def create_learning_rate_fn(config, base_learning_rate, steps_per_epoch):
  """Creates learning rate schedule."""
  warmup_fn = optax.linear_schedule(
      init_value=0., end_value=base_learning_rate,
      transition_steps=config.warmup_epochs * steps_per_epoch)
  cosine_epochs = max(config.num_epochs - config.warmup_epochs, 1)
  cosine_fn = optax.cosine_decay_schedule(
      init_value=base_learning_rate,
      decay_steps=cosine_epochs * steps_per_epoch)
  schedule_fn = optax.join_schedules(
      schedules=[warmup_fn, cosine_fn],
      boundaries=[config.warmup_epochs * steps_per_epoch])
  return schedule_fn


def train_step(state, batch, learning_rate_fn):
  def loss_fn(params):
    logits = CNN().apply({'params': params}, batch['image'])
    one_hot = jax.nn.one_hot(batch['label'], 10)
    loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
    return loss, logits
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (_, logits), grads = grad_fn(state.params)
  new_state = state.apply_gradients(grads=grads)
  metrics = compute_metrics(logits, batch['label'])
  lr = learning_rate_fn(state.step)
  metrics['learning_rate'] = lr
  return new_state, metrics


def create_train_state(rng, config, learning_rate_fn):
  """Creates initial `TrainState`."""
  cnn = CNN()
  params = cnn.init(rng, jnp.ones([1, 8, 8, 1]))['params']
  tx = optax.sgd(learning_rate_fn, config.momentum)
  return train_state.TrainState.create(
      apply_fn=cnn.apply, params=params, tx=tx)


# ---- corpus harness (not upstream) ----
def get_config():
    """The guide's config (an ml_collections.ConfigDict upstream), data sizes shrunk."""
    return types.SimpleNamespace(
        learning_rate=0.001, momentum=0.9, batch_size=5, num_epochs=10, warmup_epochs=2,
        train_ds_size=40,
    )


config = get_config()
np.random.seed(0)
train_ds = get_dummy_data(config.train_ds_size)
test_ds = get_dummy_data(10)
steps_per_epoch = config.train_ds_size // config.batch_size
learning_rate_fn = create_learning_rate_fn(config, config.learning_rate, steps_per_epoch)
_perms = np.random.RandomState(1).permutation(config.train_ds_size)
_perms = _perms[:steps_per_epoch * config.batch_size].reshape((steps_per_epoch, config.batch_size))
BATCHES = [{k: v[perm, ...] for k, v in train_ds.items()} for perm in _perms]
assert len(BATCHES) == N_STEPS


def run(train_step, chunk=None, bound=False):
    """The guide's `train_epoch` loop (`state, metrics = train_step(state, batch,
    learning_rate_fn)`) over one epoch of 8 batches, then the epoch metrics' mean and the
    trained CNN's metrics on held-out dummy data. `bound`: the step is a partial binding
    `learning_rate_fn`, called as `train_step(state, batch)` (Flax's examples)."""
    state = create_train_state(jax.random.key(0), config, learning_rate_fn)
    batch_metrics = []
    for batch in calls(BATCHES, chunk):
        if bound:
            state, metrics = train_step(state, batch)
        else:
            state, metrics = train_step(state, batch, learning_rate_fn)
        batch_metrics.append(metrics)
    per_step = collect(batch_metrics, chunk)
    epoch_metrics = {k: np.mean(v) for k, v in per_step.items()}
    logits = CNN().apply({'params': state.params}, test_ds['image'])
    final = (state.step, state.params, state.opt_state)
    return Result(final, per_step, (epoch_metrics, compute_metrics(logits, test_ds['label'])))
