# Upstream: google/flax, examples/nnx_toy_examples/02_lifted_transforms.py
# (snapshot commit 18f8f311c275d57f46d95e41b15aa97b454754c0).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: Linear, Count, MLP, `train_step(model, optimizer, batch)` (nnx.grad, the
# optimizer updates the model in place, nothing returned; decorated `@nnx.jit` upstream: the
# test applies it) and `test_step` (keeps its `@nnx.jit`). Upstream calls the step through
# `nnx.cached_partial(train_step, model, optimizer)`; the reference run does too.
# Shrunk: dhidden 32 -> 8; 100 points -> 40, batch 32 -> 5 (fixed draws instead of
# `np.random.choice` at each step).
# ruff: noqa: E111, E114
# fmt: off
"""Flax NNX with `nnx.Optimizer`: a step that mutates the model and optimizer, returns nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from corpus._harness import N_STEPS, Result, calls

X = np.linspace(0, 1, 40)[:, None]
Y = 0.8 * X**2 + 0.1 + np.random.RandomState(0).normal(0, 0.1, size=X.shape)


class Linear(nnx.Module):
  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
    self.b = nnx.Param(jnp.zeros((dout,)))

  def __call__(self, x):
    return x @ self.w.value + self.b.value


class Count(nnx.Variable):
  pass


class MLP(nnx.Module):
  def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
    self.count = Count(jnp.array(0))
    self.linear1 = Linear(din, dhidden, rngs=rngs)
    self.linear2 = Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    self.count.value += 1
    x = self.linear1(x)
    x = jax.nn.relu(x)
    x = self.linear2(x)
    return x


def train_step(model: MLP, optimizer: nnx.Optimizer, batch):
  x, y = batch

  def loss_fn(model: MLP):
    y_pred = model(x)
    return jnp.mean((y - y_pred) ** 2)

  grads: nnx.State = nnx.grad(loss_fn)(model)
  optimizer.update(model, grads)


@nnx.jit
def test_step(model: MLP, batch):
  x, y = batch
  y_pred = model(x)
  loss = jnp.mean((y - y_pred) ** 2)
  return {'loss': loss}


# ---- corpus harness (not upstream) ----
_IDX = np.random.RandomState(1).choice(len(X), size=(N_STEPS, 5))
BATCHES = [(X[idx], Y[idx]) for idx in _IDX]


def run(train_step, chunk=None, cached=True):
    """Upstream's setup and loop, then its `test_step` and call count. Upstream calls
    `nnx.cached_partial(train_step, model, optimizer)(batch)`, as `cached=True` does;
    `cached=False` calls `train_step(model, optimizer, batch)`."""
    model = MLP(din=1, dhidden=8, dout=1, rngs=nnx.Rngs(0))
    tx = optax.sgd(1e-3)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if cached:
        cached_train_step = nnx.cached_partial(train_step, model, optimizer)
    else:
        def cached_train_step(batch):
            return train_step(model, optimizer, batch)
    for batch in calls(BATCHES, chunk):
        cached_train_step(batch)
    logs = test_step(model, (X, Y))
    state = (nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(optimizer)))
    return Result(state, None, (logs, model.count.value, model(X)))
