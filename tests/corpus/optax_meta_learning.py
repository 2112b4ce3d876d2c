# Upstream: google-deepmind/optax, examples/meta_learning.ipynb
# (snapshot commit 2edbcbe2390da13983b92cbef94ac0460ecde1c5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: generator, f, the optimizers (`optax.inject_hyperparams(optax.rmsprop)`
# inner, adam outer), loss, step, outer_loss (which writes
# `state.hyperparams['learning_rate']`), and `outer_step(eta, theta, meta_state, state,
# samples)` (decorated `@jax.jit` upstream: the test applies it); the setup (`eta =
# -np.log(1. / init_learning_rate - 1)`) and the learning rates it records.
# Shrunk: 2000 outer steps -> 8 (N = 7 samples per step unchanged).
# ruff: noqa: E111, E114, UP006, UP035
# fmt: off
"""optax meta-learning: scalar state, an inner optimizer's hyperparameter learned by grad."""

from typing import Iterator, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus._harness import N_STEPS, Result, calls


def generator() -> Iterator[Tuple[jax.Array, jax.Array]]:
  rng = jax.random.PRNGKey(0)

  while True:
    rng, k1, k2 = jax.random.split(rng, num=3)
    x = jax.random.uniform(k1, minval=0.0, maxval=10.0)
    y = 10.0 * x + jax.random.normal(k2)
    yield x, y


def f(theta: jax.typing.ArrayLike, x: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
  return x * theta

theta = jax.random.normal(jax.random.PRNGKey(42))

init_learning_rate = jnp.array(0.1)
meta_learning_rate = jnp.array(0.03)

opt = optax.inject_hyperparams(optax.rmsprop)(learning_rate=init_learning_rate)
meta_opt = optax.adam(learning_rate=meta_learning_rate)

def loss(theta, x, y):
  return optax.l2_loss(y, f(theta, x))


def step(theta, state, x, y):
  grad = jax.grad(loss)(theta, x, y)
  updates, state = opt.update(grad, state)
  theta = optax.apply_updates(theta, updates)
  return theta, state

def outer_loss(eta, theta, state, samples):
  state.hyperparams['learning_rate'] = jax.nn.sigmoid(eta)

  for x, y in samples[:-1]:
    theta, state = step(theta, state, x, y)

  x, y = samples[-1]

  return loss(theta, x, y), (theta, state)


def outer_step(eta, theta, meta_state, state, samples):
  grad, (theta, state) = jax.grad(
      outer_loss, has_aux=True)(eta, theta, state, samples)

  meta_updates, meta_state = meta_opt.update(grad, meta_state)
  eta = optax.apply_updates(eta, meta_updates)

  return eta, theta, meta_state, state


# ---- corpus harness (not upstream) ----
N = 7
_g = generator()
SAMPLES = [[next(_g) for i in range(N)] for _ in range(N_STEPS)]


def run(outer_step, chunk=None):
    """Upstream's setup and loop (`eta, theta, meta_state, state = outer_step(eta, theta,
    meta_state, state, samples)` with `samples = [next(g) for i in range(N)]`), recording
    `jax.nn.sigmoid(eta)` and `theta` after each call as upstream does."""
    t = theta
    state = opt.init(t)
    # inverse sigmoid, to match the value we initialized the inner optimizer with.
    eta = -np.log(1. / init_learning_rate - 1)
    meta_state = meta_opt.init(eta)
    learning_rates = []
    thetas = []
    for samples in calls(SAMPLES, chunk):
        eta, t, meta_state, state = outer_step(eta, t, meta_state, state, samples)
        learning_rates.append(jax.nn.sigmoid(eta))
        thetas.append(t)
    return Result((eta, t, meta_state, state), None, (learning_rates[-1], thetas[-1]))
