# Upstream: google/flax, examples/nnx_toy_examples/10_fsdp_and_optimizer.py
# (snapshot commit 2863e252ccf71e7988e0c61702f4a82a41c5fa99).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: MeshRules, mesh_rules, MLP, SGDState, SGD (an optimizer holding the model's
# own Variables: `nnx.variables(model, nnx.Param)`), `create_model` (keeps its `@nnx.jit`) and
# `train_step(model, optimizer, x, y)` (decorated `@nnx.jit` upstream: the test applies it;
# it returns the loss and updates both objects in place).
# Left out: the 2x4 device mesh, `jax.set_mesh` and `named_sharding` (the sharding metadata
# stays on the Variables; this corpus runs on one device), the plots.
# Shrunk: 10,000 steps -> 8; batches of 32 -> 16, fixed draws instead of `np.random.choice`
# at each step.
# ruff: noqa: E111, E114
# fmt: off
"""Flax NNX with a hand-written SGD whose `params` are the model's own Variables (shared
between the two arguments): a step that mutates both and returns the loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from corpus._harness import N_STEPS, Result, calls, collect


@dataclasses.dataclass(unsafe_hash=True)
class MeshRules:
  embed: str | None = None
  mlp: str | None = None
  data: str | None = None

  def __call__(self, *keys: str) -> tuple[str, ...]:
    return tuple(getattr(self, key) for key in keys)


mesh_rules = MeshRules(
  embed=None,
  mlp='model',
  data='data',
)


class MLP(nnx.Module):
  def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
    self.w1 = nnx.Param(
      nnx.initializers.lecun_normal()(rngs.params(), (din, dmid)),
      sharding_metadata=mesh_rules('embed', 'mlp'),
    )
    self.b1 = nnx.Param(
      jnp.zeros((dmid,)),
      sharding_metadata=mesh_rules('mlp'),
    )
    self.w2 = nnx.Param(
      nnx.initializers.lecun_normal()(rngs.params(), (dmid, dout)),
      sharding_metadata=mesh_rules('embed', 'mlp'),
    )

  def __call__(self, x: jax.Array):
    return nnx.relu(x @ self.w1 + self.b1) @ self.w2


class SGDState(nnx.Variable):
  pass


class SGD(nnx.Pytree):
  def __init__(self, params: nnx.State, lr, decay=0.9):
    def init_optimizer_state(variable: nnx.Variable):
      return SGDState(
        jnp.zeros_like(variable.value), **variable.get_metadata()
      )

    self.lr = lr
    self.params = nnx.data(params)
    self.momentum: nnx.State = nnx.data(jax.tree.map(
      init_optimizer_state,
      self.params,
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    ))
    self.decay = decay

  def update(self, grads: nnx.State):
    def update_fn(
      params: nnx.Variable, momentum: SGDState, grad: nnx.Variable
    ):
      # v_t = β * v_{t-1} + (1 - β) * ∇J(θ_t)
      momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
      # θ_{t+1} = θ_t - α * v_t
      params[...] -= self.lr * momentum[...]

    jax.tree.map(
      update_fn,
      self.params,
      self.momentum,
      grads,
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


@nnx.jit
def create_model():
  model = MLP(1, 32, 1, rngs=nnx.Rngs(0))
  optimizer = SGD(nnx.variables(model, nnx.Param), 0.01, decay=0.9)
  return model, optimizer


def train_step(model: MLP, optimizer: SGD, x, y):
  def loss_fn(model):
    y_pred = model(x)
    loss = jnp.mean((y - y_pred) ** 2)
    return loss

  loss, grad = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(grad)
  return loss


X = np.linspace(-2, 2, 100)[:, None]
Y = 0.8 * X**2 + 0.1 + np.random.RandomState(0).normal(0, 0.1, size=X.shape)


# ---- corpus harness (not upstream) ----
_IDX = np.random.RandomState(1).choice(len(X), size=(N_STEPS, 16))
BATCHES = [(X[idx], Y[idx]) for idx in _IDX]


def run(train_step, chunk=None):
    """Upstream's setup and loop; the final model and optimizer state, the losses, and the
    model's predictions on X. Also checks that the optimizer still holds the model's own
    Variables after training (an update through one is seen by the other)."""
    model, optimizer = create_model()
    losses = [train_step(model, optimizer, x_batch, y_batch)
              for x_batch, y_batch in calls(BATCHES, chunk)]
    assert optimizer.params['w1'] is model.w1
    state = (nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(optimizer)))
    return Result(state, collect(losses, chunk), model(X))
