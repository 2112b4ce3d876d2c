# Upstream: google/flax, examples/nnx_toy_examples/03_train_state.py
# (snapshot commit 18f8f311c275d57f46d95e41b15aa97b454754c0).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: Linear, Count, MLP, the `TrainState(train_state.TrainState)` subclass with
# `counts: nnx.State` and `graphdef: nnx.GraphDef` fields, `TrainState.create(...)` (its `step`
# starts as the Python int 0), `train_step(state, batch)` (decorated `@jax.jit` upstream: the
# test applies it) and `test_step` (keeps its `@jax.jit`).
# Shrunk: dhidden 32 -> 8; 100 points -> 40, batch 32 -> 5 (fixed draws instead of
# `np.random.choice` at each step).
# ruff: noqa: E111, E114
# fmt: off
"""Flax NNX graphdef and state inside a Linen `TrainState`, updated by `apply_gradients`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from corpus._harness import N_STEPS, Result, calls

X = np.linspace(0, 1, 40)[:, None]
Y = 0.8 * X**2 + 0.1 + np.random.RandomState(0).normal(0, 0.1, size=X.shape)


class Linear(nnx.Module):
  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
    self.b = nnx.Param(jnp.zeros((dout,)))

  def __call__(self, x):
    return x @ self.w.value + self.b.value


class Count(nnx.Variable[nnx.A]):
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

class TrainState(train_state.TrainState):
  counts: nnx.State
  graphdef: nnx.GraphDef


def train_step(state: TrainState, batch):
  x, y = batch

  def loss_fn(params):
    model = nnx.merge(state.graphdef, params, state.counts, copy=True)
    y_pred = model(x)
    loss = jnp.mean((y - y_pred) ** 2)
    counts = nnx.state(model, Count)
    return loss, counts

  grads, counts = jax.grad(loss_fn, has_aux=True)(state.params)
  # sdg update
  state = state.apply_gradients(grads=grads, counts=counts)

  return state


@jax.jit
def test_step(state: nnx.TrainState[MLP], batch):
  x, y = batch
  model = nnx.merge(state.graphdef, state.params, state.counts)
  y_pred = model(x)
  loss = jnp.mean((y - y_pred) ** 2)
  return {'loss': loss}


# ---- corpus harness (not upstream) ----
_IDX = np.random.RandomState(1).choice(len(X), size=(N_STEPS, 5))
BATCHES = [(X[idx], Y[idx]) for idx in _IDX]


def run(train_step, chunk=None):
    """Upstream's setup and loop (`state = train_step(state, batch)`), then its `test_step`
    and the merged model's call count and predictions."""
    model = MLP(din=1, dhidden=8, dout=1, rngs=nnx.Rngs(0))
    graphdef, params, counts = nnx.split(model, nnx.Param, Count)

    state = TrainState.create(
      apply_fn=None,
      graphdef=graphdef,
      params=params,
      tx=optax.sgd(0.1),
      counts=counts,
    )
    del params, counts
    for batch in calls(BATCHES, chunk):
        state = train_step(state, batch)
    logs = test_step(state, (X, Y))
    model = nnx.merge(state.graphdef, state.params, state.counts)
    final = (state.step, nnx.to_pure_dict(state.params), nnx.to_pure_dict(state.counts),
             state.opt_state)
    return Result(final, None, (logs, model.count.value, model(X)))
