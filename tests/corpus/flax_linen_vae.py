# Upstream: google/flax, examples/vae/train.py
# (snapshot commit 18f8f311c275d57f46d95e41b15aa97b454754c0).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: kl_divergence, binary_cross_entropy_with_logits, compute_metrics,
# `train_step(state, batch, z_rng, latents)` returning `state.apply_gradients(grads=grads)`,
# and eval_f; upstream's models.py is flax_linen_vae_models, imported as `models` as upstream
# does. Upstream runs train_step without any jit (eagerly); the test's reference applies
# `jax.jit(..., static_argnums=3)` (the same computation, without ~10 s of eager dispatch).
# Shrunk: Dense(500) -> Dense(12), 784 pixels -> 64 (8x8: the reshapes in eval_f with them),
# latents 20 -> 3, batch 128 -> 6; synthetic binarized images instead of binarized_mnist.
# ruff: noqa: E111, E114
# fmt: off
"""Flax Linen VAE: `TrainState.create`, a fresh key per step, a static Python int argument."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from jax import random

from corpus import flax_linen_vae_models as models
from corpus._harness import N_STEPS, Result, calls


@jax.vmap
def kl_divergence(mean, logvar):
  return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


@jax.vmap
def binary_cross_entropy_with_logits(logits, labels):
  logits = nn.log_sigmoid(logits)
  return -jnp.sum(
      labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits))
  )


def compute_metrics(recon_x, x, mean, logvar):
  bce_loss = binary_cross_entropy_with_logits(recon_x, x).mean()
  kld_loss = kl_divergence(mean, logvar).mean()
  return {'bce': bce_loss, 'kld': kld_loss, 'loss': bce_loss + kld_loss}


def train_step(state, batch, z_rng, latents):
  """Train step."""
  def loss_fn(params):
    recon_x, mean, logvar = models.model(latents).apply(
        {'params': params}, batch, z_rng
    )

    bce_loss = binary_cross_entropy_with_logits(recon_x, batch).mean()
    kld_loss = kl_divergence(mean, logvar).mean()
    loss = bce_loss + kld_loss
    return loss

  grads = jax.grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads)


def eval_f(params, images, z, z_rng, latents):
  """Evaluation function."""
  def eval_model(vae):
    recon_images, mean, logvar = vae(images, z_rng)
    comparison = jnp.concatenate([
        images[:8].reshape(-1, 8, 8, 1),
        recon_images[:8].reshape(-1, 8, 8, 1),
    ])

    generate_images = vae.generate(z)
    generate_images = generate_images.reshape(-1, 8, 8, 1)
    metrics = compute_metrics(recon_images, images, mean, logvar)
    return metrics, comparison, generate_images

  return nn.apply(eval_model, models.model(latents))({'params': params})


# ---- corpus harness (not upstream) ----
def get_config():
    """examples/vae/configs/default.py, sizes shrunk."""
    import types
    return types.SimpleNamespace(learning_rate=0.001, latents=3, batch_size=6, num_epochs=1)


config = get_config()
_rng = np.random.RandomState(0)
BATCHES = [(_rng.rand(config.batch_size, 64) > 0.5).astype(np.float32) for _ in range(N_STEPS)]
test_ds = (np.random.RandomState(1).rand(10, 64) > 0.5).astype(np.float32)


def run(train_step, chunk=None):
    """Upstream's `train_and_evaluate`: the init, `TrainState.create`, the loop (`rng, key =
    random.split(rng)`; `state = train_step(state, batch, key, config.latents)`; with `chunk`,
    the keys of `chunk` steps stacked), then `eval_f`."""
    rng = random.key(0)
    rng, key = random.split(rng)
    init_data = jnp.ones((config.batch_size, 64), jnp.float32)
    params = models.model(config.latents).init(key, init_data, rng)['params']
    state = train_state.TrainState.create(
        apply_fn=models.model(config.latents).apply,
        params=params,
        tx=optax.adam(config.learning_rate),
    )
    rng, z_key, eval_rng = random.split(rng, 3)
    z = random.normal(z_key, (64, config.latents))
    steps = []
    for batch in BATCHES:
        rng, key = random.split(rng)
        steps.append((batch, key))
    for batch, key in calls(steps, chunk):
        state = train_step(state, batch, key, config.latents)
    metrics, comparison, sample = eval_f(state.params, test_ds, z, eval_rng, config.latents)
    final = (state.step, state.params, state.opt_state)
    return Result(final, None, (metrics, comparison, sample))
