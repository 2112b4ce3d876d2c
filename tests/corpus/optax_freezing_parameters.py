# Upstream: google-deepmind/optax, examples/freezing_parameters.ipynb (its first example,
# `optax.chain(optax.adam(0.1), freeze(mask))`; snapshot commit
# 2edbcbe2390da13983b92cbef94ac0460ecde1c5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: loss_fn, the params and mask, the optimizer, and `train_step(p, s)`
# returning `new_p, s, loss` (decorated `@jax.jit` upstream: the test applies it); the
# notebook's closing checks.
# Shrunk: 200 steps -> 8 (nothing else: two one-element parameters, no data).
# fmt: off
"""optax freezing: `transforms.freeze(mask)`; a step with no input but its state."""

import jax
import jax.numpy as jnp
import optax
from optax import transforms

from corpus._harness import N_STEPS, Result, collect

freeze = transforms.freeze
selective_transform = transforms.selective_transform

def loss_fn(p):
    return jnp.abs(p["param0"][0]) + jnp.abs(p["param1"][0])

mask = {"param0": False, "param1": True}

# Create optimizer with freeze utility
optimizer = optax.chain(optax.adam(0.1), freeze(mask))

# Define a single training step
def train_step(p, s):
    # Compute loss and gradients
    loss, grads = jax.value_and_grad(loss_fn)(p)
    # Update parameters using optimizer
    updates, s = optimizer.update(grads, s, p)
    new_p = optax.apply_updates(p, updates)
    return new_p, s, loss


# ---- corpus harness (not upstream) ----
def run(train_step, chunk=None):
    """Upstream's loop (`params, opt_state, loss = train_step(params, opt_state)`), its
    history, and its checks (param0 moved, param1 frozen)."""
    params = {
        "param0": jnp.array([10.0]),  # will be trained
        "param1": jnp.array([10.0]),  # will be frozen
    }
    opt_state = optimizer.init(params)
    loss_history = []
    param0_history = []
    param1_history = []
    for _ in range(N_STEPS // (chunk or 1)):
        params, opt_state, loss = train_step(params, opt_state)
        loss_history.append(loss)
        param0_history.append(params["param0"][0])
        param1_history.append(params["param1"][0])
    assert not jnp.isclose(params["param0"][0], 10.0)
    assert jnp.isclose(params["param1"][0], 10.0)
    return Result((params, opt_state), collect(loss_history, chunk),
                  (param0_history[-1], param1_history[-1]))
