# Upstream: patrick-kidger/equinox, docs/examples/deep_convolutional_gan.ipynb
# (snapshot commit 9336d820b2ef66b360fc6cb3611b3da5cefbb14d).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: Generator, Discriminator (both with BatchNorm state), compute_grads_
# discriminator, compute_grads_generator (under `@eqx.filter_value_and_grad(has_aux=True)`),
# `step_discriminator(discriminator, generator, real_batch, discriminator_optimizer,
# discriminator_opt_state, generator_state, discriminator_state, key)` and `step_generator(...)`
# (both decorated `@eqx.filter_jit` upstream: the test applies it), the setup, and the
# post-training code (`eqx.nn.inference_mode`, `eqx.Partial`, evaluate, the top-k of the
# discriminator's logits).
# Shrunk: the models' channel counts are `width * 8` ... `width` of their shape argument, which
# upstream passes as `image_size = (64, 64, 1)`: the models get `(64, 3, 1)` here (channels
# 512/256/128/64 -> 24/12/6/3; the architecture itself fixes 64x64 images, which stay);
# latent_size 100 -> 5, batch_size 32 -> 3; synthetic images instead of MNIST; 1000 noise
# vectors for the evaluation -> 6, top 32 -> top 3.
# Changed beyond sizes (setup, not a step): the optimizers are initialised on
# `eqx.filter(model, eqx.is_inexact_array)`, not `eqx.is_array` (see `run`).
# fmt: off
"""Equinox DCGAN: two models, two optimizers, two BatchNorm states and a key, two steps."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from corpus._harness import N_STEPS, Result, calls, collect, real

# Hyperparameters
lr = 0.0002
beta1 = 0.5
beta2 = 0.999
batch_size = 3
image_size = (64, 64, 1)
height, width, channels = image_size
latent_size = 5


class Generator(eqx.Module):
    layers: list[eqx.nn.ConvTranspose2d | eqx.nn.BatchNorm | Callable]

    def __init__(
        self,
        input_shape: int,
        output_shape: tuple[int, int, int],
        key: jr.PRNGKey,
    ):
        keys = jr.split(key, 5)

        height, width, channels = output_shape

        self.layers = [
            eqx.nn.ConvTranspose2d(
                in_channels=input_shape,
                out_channels=width * 8,
                kernel_size=4,
                stride=1,
                padding=0,
                use_bias=False,
                key=keys[0],
            ),
            eqx.nn.BatchNorm(input_size=width * 8, axis_name="batch"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(
                in_channels=width * 8,
                out_channels=width * 4,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[1],
            ),
            eqx.nn.BatchNorm(input_size=width * 4, axis_name="batch"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(
                in_channels=width * 4,
                out_channels=width * 2,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[2],
            ),
            eqx.nn.BatchNorm(input_size=width * 2, axis_name="batch"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(
                in_channels=width * 2,
                out_channels=width,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[3],
            ),
            eqx.nn.BatchNorm(input_size=width, axis_name="batch"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(
                in_channels=width,
                out_channels=channels,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[4],
            ),
            jax.nn.tanh,
        ]

    def __call__(self, x, state):
        for layer in self.layers:
            if isinstance(layer, eqx.nn.BatchNorm):
                x, state = layer(x, state)
            else:
                x = layer(x)

        return x, state


class Discriminator(eqx.Module):
    layers: list[eqx.nn.Conv2d | eqx.nn.PReLU | eqx.nn.BatchNorm | Callable]

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        key: jr.PRNGKey,
    ):
        keys = jr.split(key, 5)

        height, width, channels = input_shape

        self.layers = [
            eqx.nn.Conv2d(
                in_channels=channels,
                out_channels=width,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[0],
            ),
            eqx.nn.PReLU(0.2),
            eqx.nn.Conv2d(
                in_channels=width,
                out_channels=width * 2,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[1],
            ),
            eqx.nn.BatchNorm(width * 2, axis_name="batch"),
            eqx.nn.PReLU(0.2),
            eqx.nn.Conv2d(
                in_channels=width * 2,
                out_channels=width * 4,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[2],
            ),
            eqx.nn.BatchNorm(width * 4, axis_name="batch"),
            eqx.nn.PReLU(0.2),
            eqx.nn.Conv2d(
                in_channels=width * 4,
                out_channels=width * 8,
                kernel_size=4,
                stride=2,
                padding=1,
                use_bias=False,
                key=keys[3],
            ),
            eqx.nn.BatchNorm(width * 8, axis_name="batch"),
            eqx.nn.PReLU(0.2),
            eqx.nn.Conv2d(
                in_channels=width * 8,
                out_channels=1,
                kernel_size=4,
                stride=1,
                padding=0,
                use_bias=False,
                key=keys[4],
            ),
        ]

    def __call__(self, x, state):
        for layer in self.layers:
            if isinstance(layer, eqx.nn.BatchNorm):
                x, state = layer(x, state=state)
            else:
                x = layer(x)

        return x, state


@eqx.filter_value_and_grad(has_aux=True)
def compute_grads_discriminator(
    discriminator,
    generator,
    fake_labels,
    real_batch,
    real_labels,
    discriminator_state,
    generator_state,
    key,
):
    key, subkey = jr.split(key)
    noise = jr.normal(subkey, (batch_size, latent_size, 1, 1))

    fake_batch, generator_state = jax.vmap(
        generator, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(noise, generator_state)

    pred_y, discriminator_state = jax.vmap(
        discriminator, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(fake_batch, discriminator_state)
    loss1 = optax.sigmoid_binary_cross_entropy(pred_y, fake_labels).mean()

    pred_y, discriminator_state = jax.vmap(
        discriminator, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(real_batch, discriminator_state)
    loss2 = optax.sigmoid_binary_cross_entropy(pred_y, real_labels).mean()

    loss = (loss1 + loss2) / 2

    return loss, (discriminator_state, generator_state, key)


@eqx.filter_value_and_grad(has_aux=True)
def compute_grads_generator(
    generator, discriminator, real_labels, discriminator_state, generator_state, key
):
    key, subkey = jr.split(key)
    noise = jr.normal(subkey, (batch_size, latent_size, 1, 1))

    fake_batch, generator_state = jax.vmap(
        generator, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(noise, generator_state)

    pred_y, discriminator_state = jax.vmap(
        discriminator, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(fake_batch, discriminator_state)
    loss = optax.sigmoid_binary_cross_entropy(pred_y, real_labels).mean()

    return loss, (discriminator_state, generator_state, key)


def step_discriminator(
    discriminator: Discriminator,
    generator: Generator,
    real_batch: jnp.ndarray,
    discriminator_optimizer: optax.GradientTransformation,
    discriminator_opt_state: optax.OptState,
    generator_state: eqx.nn.State,
    discriminator_state: eqx.nn.State,
    key: jr.PRNGKey,
):
    fake_labels = jnp.zeros(batch_size)
    real_labels = jnp.ones(batch_size)

    (
        (
            loss,
            (discriminator_state, generator_state, key),
        ),
        grads,
    ) = compute_grads_discriminator(
        discriminator,
        generator,
        fake_labels,
        real_batch,
        real_labels,
        discriminator_state,
        generator_state,
        key,
    )

    updates, opt_state = discriminator_optimizer.update(grads, discriminator_opt_state)
    discriminator = eqx.apply_updates(discriminator, updates)

    return loss, discriminator, opt_state, generator_state, discriminator_state, key


def step_generator(
    generator: Generator,
    discriminator: Discriminator,
    generator_optimizer: optax.GradientTransformation,
    generator_opt_state: optax.OptState,
    discriminator_state: eqx.nn.State,
    generator_state: eqx.nn.State,
    key: jr.PRNGKey,
):
    real_labels = jnp.ones(batch_size)

    (
        (
            loss,
            (discriminator_state, generator_state, key),
        ),
        grads,
    ) = compute_grads_generator(
        generator, discriminator, real_labels, discriminator_state, generator_state, key
    )

    updates, opt_state = generator_optimizer.update(grads, generator_opt_state)
    generator = eqx.apply_updates(generator, updates)

    return loss, generator, opt_state, discriminator_state, generator_state, key


@eqx.filter_jit
def evaluate(model, xx):
    out, _ = jax.vmap(model)(xx)
    return out


# ---- corpus harness (not upstream) ----
model_shape = (height, 3, channels)  # what the models get as their shape: see the header
_rng = np.random.RandomState(0)
IMAGES = [
    np.tanh(_rng.randn(batch_size, channels, height, height)).astype(np.float32)
    for _ in range(N_STEPS)
]


def run(steps, chunk=None, group=1):
    """Upstream's setup and `train` loop: each iteration one `step_discriminator` call, then
    one `step_generator` call, threading both models, both optimizer states, both BatchNorm
    states and the key; then its post-training code.

    Upstream alternates two step functions every step, so `k` steps of one per call changes
    the schedule: with `group=k` both runs (upstream's jit and autoflat) make `k`
    discriminator steps, then `k` generator steps (autoflat: one call of each, batches
    stacked)."""
    step_discriminator, step_generator = steps
    key = jr.PRNGKey(2003)

    key, gen_key, disc_key = jr.split(key, 3)

    generator = Generator(input_shape=latent_size, output_shape=model_shape, key=gen_key)
    discriminator = Discriminator(input_shape=model_shape, key=disc_key)

    generator_state = eqx.nn.State(generator)
    discriminator_state = eqx.nn.State(discriminator)

    generator_optimizer = optax.adam(lr, b1=beta1, b2=beta2)
    discriminator_optimizer = optax.adam(lr, b1=beta1, b2=beta2)

    # Upstream initialises with `eqx.filter(..., eqx.is_array)`, which fails under upstream's
    # own jit with optax 0.2.8 and Equinox 0.13 (a BatchNorm state-index leaf gets optimizer
    # state, and no gradient); `eqx.is_inexact_array`, as equinox's stateful example has it.
    generator_opt_state = generator_optimizer.init(eqx.filter(generator, eqx.is_inexact_array))
    discriminator_opt_state = discriminator_optimizer.init(
        eqx.filter(discriminator, eqx.is_inexact_array)
    )
    generator_losses = []
    discriminator_losses = []
    per_call = [IMAGES[i : i + group] for i in range(0, N_STEPS, group)]
    for group_images in per_call:
        d_inputs = list(calls(group_images, chunk)) if chunk else group_images
        for images in d_inputs:
            (
                discriminator_loss,
                discriminator,
                discriminator_opt_state,
                generator_state,
                discriminator_state,
                key,
            ) = step_discriminator(
                discriminator,
                generator,
                images,
                discriminator_optimizer,
                discriminator_opt_state,
                generator_state,
                discriminator_state,
                key,
            )
            discriminator_losses.append(discriminator_loss)
        for _ in d_inputs:
            (
                generator_loss,
                generator,
                generator_opt_state,
                discriminator_state,
                generator_state,
                key,
            ) = step_generator(
                generator,
                discriminator,
                generator_optimizer,
                generator_opt_state,
                discriminator_state,
                generator_state,
                key,
            )
            generator_losses.append(generator_loss)

    generator, discriminator, generator_state, discriminator_state, key = real(
        (generator, discriminator, generator_state, discriminator_state, key))
    key, subkey = jr.split(key)
    noise = jr.normal(subkey, (6, latent_size, 1, 1))
    inference_gen = eqx.nn.inference_mode(generator)
    inference_gen = eqx.Partial(inference_gen, state=generator_state)
    generated_images = evaluate(inference_gen, noise)
    inference_discriminator = eqx.nn.inference_mode(discriminator)
    inference_discriminator = eqx.Partial(
        inference_discriminator, state=discriminator_state
    )
    logits = evaluate(inference_discriminator, generated_images)
    top = jax.lax.top_k(jax.nn.sigmoid(logits).squeeze(), 3)[1]
    final = (eqx.filter(generator, eqx.is_array), eqx.filter(discriminator, eqx.is_array),
             generator_state, discriminator_state, generator_opt_state,
             discriminator_opt_state, key)
    losses = (collect(discriminator_losses, chunk), collect(generator_losses, chunk))
    # Leaves only: the models' BatchNorm state indices hold marker objects of their own run.
    return Result(jax.tree.leaves(final), losses, (generated_images, logits, top))
