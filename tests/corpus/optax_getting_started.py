# Upstream: google-deepmind/optax, docs/getting_started.ipynb ("Custom optimizers" part:
# snapshot commit 2edbcbe2390da13983b92cbef94ac0460ecde1c5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: the synthetic data (TRAINING_DATA from `np.unpackbits`, LABELS), net, loss,
# and `step(params, opt_state, batch, labels)`, which upstream defines inside `fit` (its
# closure value `optimizer` is a module global here) and decorates with `@jax.jit` (the test
# applies it); the optimizer of the notebook's second `fit`: `optax.chain(optax.clip(1.0),
# optax.adamw(learning_rate=schedule))` with a warmup-cosine schedule.
# Shrunk: NUM_TRAIN_STEPS 1000 -> 8 (sizes were already tiny).
# ruff: noqa: E111, E114
# fmt: off
"""optax getting started: a dict of params, a chained optimizer with a schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from corpus._harness import N_STEPS, Result, calls, collect

BATCH_SIZE = 5
NUM_TRAIN_STEPS = N_STEPS
RAW_TRAINING_DATA = np.random.RandomState(0).randint(255, size=(NUM_TRAIN_STEPS, BATCH_SIZE, 1))

TRAINING_DATA = np.unpackbits(RAW_TRAINING_DATA.astype(np.uint8), axis=-1)
LABELS = jax.nn.one_hot(RAW_TRAINING_DATA % 2, 2).astype(jnp.float32).reshape(NUM_TRAIN_STEPS, BATCH_SIZE, 2)

initial_params = {
    'hidden': jax.random.normal(shape=[8, 32], key=jax.random.PRNGKey(0)),
    'output': jax.random.normal(shape=[32, 2], key=jax.random.PRNGKey(1)),
}


def net(x: jnp.ndarray, params: optax.Params) -> jnp.ndarray:
  x = jnp.dot(x, params['hidden'])
  x = jax.nn.relu(x)
  x = jnp.dot(x, params['output'])
  return x


def loss(params: optax.Params, batch: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
  y_hat = net(batch, params)

  # optax also provides a number of common loss functions.
  loss_value = optax.sigmoid_binary_cross_entropy(y_hat, labels).sum(axis=-1)

  return loss_value.mean()


schedule = optax.warmup_cosine_decay_schedule(
  init_value=0.0,
  peak_value=1.0,
  warmup_steps=50,
  decay_steps=1_000,
  end_value=0.0,
)

optimizer = optax.chain(
  optax.clip(1.0),
  optax.adamw(learning_rate=schedule),
)


def step(params, opt_state, batch, labels):
  loss_value, grads = jax.value_and_grad(loss)(params, batch, labels)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, loss_value


# ---- corpus harness (not upstream) ----
def run(step, chunk=None):
    """Upstream's `fit`: `opt_state = optimizer.init(params)`, then `params, opt_state,
    loss_value = step(params, opt_state, batch, labels)` over zip(TRAINING_DATA, LABELS);
    then the loss on all the data."""
    params = initial_params
    opt_state = optimizer.init(params)
    losses = []
    for batch, labels in calls(list(zip(TRAINING_DATA, LABELS, strict=True)), chunk):
        params, opt_state, loss_value = step(params, opt_state, batch, labels)
        losses.append(loss_value)
    post = loss(params, TRAINING_DATA.reshape(-1, 8), LABELS.reshape(-1, 2))
    return Result((params, opt_state), collect(losses, chunk), post)
