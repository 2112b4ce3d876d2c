# Upstream: jax-ml/jax, examples/mnist_vae.py
# (snapshot commit cec06d116c05f0d52adfceee3d3b730fdbcb0ce5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: gaussian_kl, gaussian_sample, bernoulli_logpdf, elbo, image_sample,
# image_grid, the stax encoder/decoder, binarize_batch, `run_epoch(rng, opt_state, images)`
# (one call trains an epoch in a `lax.fori_loop`) and `evaluate`, which upstream defines under
# `if __name__ == "__main__":` (their closure values are module globals here) and decorates
# with `@jit` (the test applies it to run_epoch; evaluate keeps its `@jit`).
# Shrunk: Dense(512) -> Dense(16), latent size 10 -> 3 (image_sample's `10` with it);
# 28x28 binarized MNIST -> 8x8 synthetic images (784 -> 64, image_grid's (28, 28) -> (8, 8)),
# 60000 training images in batches of 32 -> 12 in batches of 4, sample grid 10x10 -> 2x2.
# ruff: noqa: E111, E114, E731
# fmt: off
"""JAX VAE: a whole epoch per call (`fori_loop`), a fresh key per epoch, the images broadcast."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import grad, jit, lax, random
from jax.example_libraries import optimizers, stax
from jax.example_libraries.stax import Dense, FanOut, Relu, Softplus

from corpus._harness import N_STEPS, Result, calls


def gaussian_kl(mu, sigmasq):
  """KL divergence from a diagonal Gaussian to the standard Gaussian."""
  return -0.5 * jnp.sum(1. + jnp.log(sigmasq) - mu**2. - sigmasq)

def gaussian_sample(rng, mu, sigmasq):
  """Sample a diagonal Gaussian."""
  return mu + jnp.sqrt(sigmasq) * random.normal(rng, mu.shape)

def bernoulli_logpdf(logits, x):
  """Bernoulli log pdf of data x given logits."""
  return -jnp.sum(jnp.logaddexp(0., jnp.where(x, -1., 1.) * logits))

def elbo(rng, params, images):
  """Monte Carlo estimate of the negative evidence lower bound."""
  enc_params, dec_params = params
  mu_z, sigmasq_z = encode(enc_params, images)
  logits_x = decode(dec_params, gaussian_sample(rng, mu_z, sigmasq_z))
  return bernoulli_logpdf(logits_x, images) - gaussian_kl(mu_z, sigmasq_z)

def image_sample(rng, params, nrow, ncol):
  """Sample images from the generative model."""
  _, dec_params = params
  code_rng, img_rng = random.split(rng)
  logits = decode(dec_params, random.normal(code_rng, (nrow * ncol, 3)))
  sampled_images = random.bernoulli(img_rng, jnp.logaddexp(0., logits))
  return image_grid(nrow, ncol, sampled_images, (8, 8))

def image_grid(nrow, ncol, imagevecs, imshape):
  """Reshape a stack of image vectors into an image grid for plotting."""
  images = iter(imagevecs.reshape((-1,) + imshape))
  return jnp.vstack([jnp.hstack([next(images).T for _ in range(ncol)][::-1])
                    for _ in range(nrow)]).T


encoder_init, encode = stax.serial(
    Dense(16), Relu,
    Dense(16), Relu,
    FanOut(2),
    stax.parallel(Dense(3), stax.serial(Dense(3), Softplus)),
)

decoder_init, decode = stax.serial(
    Dense(16), Relu,
    Dense(16), Relu,
    Dense(8 * 8),
)


step_size = 0.001
batch_size = 4
nrow, ncol = 2, 2  # sampled image grid size

test_rng = random.key(1)  # fixed prng key for evaluation

num_batches = 3

opt_init, opt_update, get_params = optimizers.momentum(step_size, mass=0.9)

def binarize_batch(rng, i, images):
  i = i % num_batches
  batch = lax.dynamic_slice_in_dim(images, i * batch_size, batch_size)
  return random.bernoulli(rng, batch)

def run_epoch(rng, opt_state, images):
  def body_fun(i, opt_state):
    elbo_rng, data_rng = random.split(random.fold_in(rng, i))
    batch = binarize_batch(data_rng, i, images)
    loss = lambda params: -elbo(elbo_rng, params, batch) / batch_size
    g = grad(loss)(get_params(opt_state))
    return opt_update(i, g, opt_state)
  return lax.fori_loop(0, num_batches, body_fun, opt_state)

@jit
def evaluate(opt_state, images):
  params = get_params(opt_state)
  elbo_rng, data_rng, image_rng = random.split(test_rng, 3)
  binarized_test = random.bernoulli(data_rng, images)
  test_elbo = elbo(elbo_rng, params, binarized_test) / images.shape[0]
  sampled_images = image_sample(image_rng, params, nrow, ncol)
  return test_elbo, sampled_images


# ---- corpus harness (not upstream) ----
train_images = jax.device_put(
    np.random.RandomState(0).rand(num_batches * batch_size, 64).astype(np.float32))
test_images = jax.device_put(np.random.RandomState(1).rand(8, 64).astype(np.float32))


def run(run_epoch, chunk=None):
    """Upstream's loop, one epoch per step: `opt_state = run_epoch(random.key(epoch),
    opt_state, train_images)`; with `chunk`, the epochs' keys are stacked and the images are
    the same for every epoch."""
    enc_init_rng, dec_init_rng = random.split(random.key(2))
    _, init_encoder_params = encoder_init(enc_init_rng, (batch_size, 8 * 8))
    _, init_decoder_params = decoder_init(dec_init_rng, (batch_size, 3))
    init_params = init_encoder_params, init_decoder_params
    opt_state = opt_init(init_params)
    for rng in calls([random.key(epoch) for epoch in range(N_STEPS)], chunk):
        opt_state = run_epoch(rng, opt_state, train_images)
    test_elbo, sampled_images = evaluate(opt_state, test_images)
    return Result(opt_state, None, (test_elbo, sampled_images))
