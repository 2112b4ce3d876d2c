# Upstream: google/flax, docs/guides/training_techniques/batch_norm.rst (the "With BatchNorm"
# side, without the guide's `#!` highlight marks; snapshot commit
# 18f8f311c275d57f46d95e41b15aa97b454754c0).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: MLP (Linen, `nn.BatchNorm(use_running_average=not train)`), the
# `TrainState(train_state.TrainState)` subclass with a `batch_stats` field, `TrainState.create`,
# `train_step(state, batch)` returning `state, metrics` (decorated `@jax.jit` upstream: the
# test applies it) and `eval_step` (keeps its `@jax.jit`).
# Shrunk: nothing in the model but its output, Dense(features=1) -> Dense(features=3) (with one
# output the guide's softmax cross-entropy is identically zero); inputs of 3 features as the
# guide's `jnp.ones((1, 3))`, batches of 6 synthetic examples with 3 classes.
# ruff: noqa: E111, E114
# fmt: off
"""Flax Linen `TrainState` with `batch_stats`: `mutable=['batch_stats']` and `state.replace`."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from corpus._harness import N_STEPS, Result, calls, collect


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(features=4)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Dense(features=3)(x)
    return x


class TrainState(train_state.TrainState):
  batch_stats: Any


def train_step(state: TrainState, batch):
  """Train for a single step."""
  def loss_fn(params):
    logits, updates = state.apply_fn(
      {'params': params, 'batch_stats': state.batch_stats},
      x=batch['image'], train=True, mutable=['batch_stats'])
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch['label']).mean()
    return loss, (logits, updates)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, (logits, updates)), grads = grad_fn(state.params)
  state = state.apply_gradients(grads=grads)
  state = state.replace(batch_stats=updates['batch_stats'])
  metrics = {
    'loss': loss,
      'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['label']),
  }
  return state, metrics


@jax.jit
def eval_step(state: TrainState, batch):
  """Evaluate for a single step."""
  logits = state.apply_fn(
    {'params': state.params, 'batch_stats': state.batch_stats},
    x=batch['image'], train=False)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']).mean()
  metrics = {
    'loss': loss,
      'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['label']),
  }
  return state, metrics


# ---- corpus harness (not upstream) ----
def _batch(rng):
    return {
        "image": rng.randn(6, 3).astype(np.float32),
        "label": rng.randint(0, 3, 6).astype(np.int32),
    }


_rng = np.random.RandomState(0)
BATCHES = [_batch(_rng) for _ in range(N_STEPS)]
TEST_BATCH = _batch(np.random.RandomState(1))


def run(train_step, chunk=None):
    """The guide's setup (`mlp.init(..., train=False)`, `TrainState.create(...,
    batch_stats=batch_stats, tx=optax.adam(1e-3))`), a loop of `state, metrics =
    train_step(state, batch)`, then its `eval_step`."""
    mlp = MLP()
    x = jnp.ones((1, 3))
    variables = mlp.init(jax.random.key(0), x, train=False)
    params = variables['params']
    batch_stats = variables['batch_stats']
    state = TrainState.create(
      apply_fn=mlp.apply,
      params=params,
      batch_stats=batch_stats,
      tx=optax.adam(1e-3),
    )
    outputs = []
    for batch in calls(BATCHES, chunk):
        state, metrics = train_step(state, batch)
        outputs.append(metrics)
    final = (state.step, state.params, state.batch_stats, state.opt_state)
    return Result(final, collect(outputs, chunk), eval_step(state, TEST_BATCH)[1])
