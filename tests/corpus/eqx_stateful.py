# Upstream: patrick-kidger/equinox, docs/examples/stateful.ipynb
# (snapshot commit 9336d820b2ef66b360fc6cb3611b3da5cefbb14d).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: Model (BatchNorm, SpectralNorm, Linear), compute_loss, `make_step(model,
# state, opt_state, xs, ys)` with `eqx.nn.State` and `eqx.filter_grad(has_aux=True)`
# (decorated `@eqx.filter_jit` upstream: the test applies it), the setup
# (`eqx.nn.make_with_state(Model)(mkey)`, `optim.init(eqx.filter(model,
# eqx.is_inexact_array))`) and the inference code (`eqx.nn.inference_mode`, `eqx.Partial`,
# evaluate). Upstream trains full-batch: the same xs, ys every step.
# Shrunk: nothing (upstream's sizes are already tiny: 3 -> 32 -> 32 -> 3, 10 examples).
# fmt: off
"""Equinox stateful: BatchNorm + SpectralNorm state (`eqx.nn.State`), full-batch inputs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax  # https://github.com/deepmind/optax

from corpus._harness import N_STEPS, Result, real


# This model is just a weird mish-mash of stateful and non-stateful layers for
# demonstration purposes, it isn't doing any clever.
class Model(eqx.Module):
    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2, key3, key4 = jr.split(key, 4)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(in_features=3, out_features=32, key=key1),
            weight_name="weight",
            key=key2,
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch")
        self.linear1 = eqx.nn.Linear(in_features=32, out_features=32, key=key3)
        self.linear2 = eqx.nn.Linear(in_features=32, out_features=3, key=key4)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x = jax.nn.relu(x)
        x, state = self.norm2(x, state)
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x, state


def compute_loss(model, state, xs, ys):
    batch_model = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )
    pred_ys, state = batch_model(xs, state)
    loss = jnp.mean((pred_ys - ys) ** 2)
    return loss, state


def make_step(model, state, opt_state, xs, ys):
    grads, state = eqx.filter_grad(compute_loss, has_aux=True)(model, state, xs, ys)
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return model, state, opt_state


dataset_size = 10
learning_rate = 3e-4
seed = 5678

optim = optax.adam(learning_rate)


@eqx.filter_jit
def evaluate(model, xs):
    # discard state
    out, _ = jax.vmap(model)(xs)
    return out


# ---- corpus harness (not upstream) ----
def run(make_step, chunk=None):
    """Upstream's setup and loop (`model, state, opt_state = make_step(model, state,
    opt_state, xs, ys)`, full-batch: the same xs, ys every step, also with `chunk`), then its
    inference code."""
    key = jr.PRNGKey(seed)
    mkey, xkey, xkey2 = jr.split(key, 3)

    model, state = eqx.nn.make_with_state(Model)(mkey)

    xs = jr.normal(xkey, (dataset_size, 3))
    ys = jnp.sin(xs) + 1
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    for _ in range(N_STEPS // (chunk or 1)):
        # Full-batch gradient descent in this simple example.
        model, state, opt_state = make_step(model, state, opt_state, xs, ys)

    model, state = real((model, state))  # eqx.Partial and inference_mode rebuild them
    inference_model = eqx.nn.inference_mode(model)
    inference_model = eqx.Partial(inference_model, state=state)
    test_dataset_size = 5
    test_xs = jr.normal(xkey2, (test_dataset_size, 3))
    pred_test_ys = evaluate(inference_model, test_xs)
    final = (eqx.filter(model, eqx.is_array), state, opt_state)
    return Result(final, None, pred_test_ys)
