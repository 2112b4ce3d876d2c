# Upstream: google/flax, examples/vae/models.py
# (snapshot commit 18f8f311c275d57f46d95e41b15aa97b454754c0).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: Encoder, Decoder, VAE, reparameterize, model; imported by flax_linen_vae as
# `models`, as upstream's train.py imports it.
# Shrunk: Dense(500) -> Dense(12), 784 pixels -> 64 (8x8).
# ruff: noqa: E111, E114
# fmt: off
"""VAE model definitions."""

import jax.numpy as jnp
from flax import linen as nn
from jax import random


class Encoder(nn.Module):
  """VAE Encoder."""

  latents: int

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(12, name='fc1')(x)
    x = nn.relu(x)
    mean_x = nn.Dense(self.latents, name='fc2_mean')(x)
    logvar_x = nn.Dense(self.latents, name='fc2_logvar')(x)
    return mean_x, logvar_x


class Decoder(nn.Module):
  """VAE Decoder."""

  @nn.compact
  def __call__(self, z):
    z = nn.Dense(12, name='fc1')(z)
    z = nn.relu(z)
    z = nn.Dense(64, name='fc2')(z)
    return z


class VAE(nn.Module):
  """Full VAE model."""

  latents: int = 20

  def setup(self):
    self.encoder = Encoder(self.latents)
    self.decoder = Decoder()

  def __call__(self, x, z_rng):
    mean, logvar = self.encoder(x)
    z = reparameterize(z_rng, mean, logvar)
    recon_x = self.decoder(z)
    return recon_x, mean, logvar

  def generate(self, z):
    return nn.sigmoid(self.decoder(z))


def reparameterize(rng, mean, logvar):
  std = jnp.exp(0.5 * logvar)
  eps = random.normal(rng, logvar.shape)
  return mean + eps * std


def model(latents):
  return VAE(latents=latents)
