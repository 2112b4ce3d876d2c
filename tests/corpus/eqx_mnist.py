# Upstream: patrick-kidger/equinox, docs/examples/mnist.ipynb
# (snapshot commit 9336d820b2ef66b360fc6cb3611b3da5cefbb14d).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: CNN (a list of layers and plain functions), loss, cross_entropy,
# `loss = eqx.filter_jit(loss)`, compute_accuracy, evaluate, and `make_step(model, opt_state,
# x, y)` with `eqx.filter_value_and_grad` and `optax.adamw`, which upstream defines inside
# `train` (its closure value `optim` is a module global here) and decorates with
# `@eqx.filter_jit` (the test applies it).
# Shrunk: Conv2d(1, 3, 4) unchanged; 28x28 MNIST -> 12x12 synthetic images, so
# Linear(1728, 512)/Linear(512, 64) -> Linear(192, 16)/Linear(16, 8) (the type annotations'
# "1 28 28" with them); batch 64 -> 6; torch DataLoaders -> lists of NumPy batches.
# ruff: noqa: F722, F821, UP037
# fmt: off
"""Equinox MNIST: `eqx.filter_value_and_grad` + optax on a module holding plain functions."""

from __future__ import annotations  # evaluate's annotation names torch, not installed

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax  # https://github.com/deepmind/optax
from jaxtyping import Array, Float, Int, PyTree  # https://github.com/google/jaxtyping

from corpus._harness import N_STEPS, Result, calls, collect, real

# Hyperparameters

BATCH_SIZE = 6
LEARNING_RATE = 3e-4
SEED = 5678


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        # Standard CNN setup: convolutional layer, followed by flattening,
        # with a small MLP on top.
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(192, 16, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(16, 8, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(8, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x: Float[Array, "1 12 12"]) -> Float[Array, "10"]:
        for layer in self.layers:
            x = layer(x)
        return x


def loss(
    model: CNN, x: Float[Array, "batch 1 12 12"], y: Int[Array, " batch"]
) -> Float[Array, ""]:
    # Our input has the shape (BATCH_SIZE, 1, 28, 28), but our model operations on
    # a single input input image of shape (1, 28, 28).
    #
    # Therefore, we have to use jax.vmap, which in this case maps our model over the
    # leading (batch) axis.
    pred_y = jax.vmap(model)(x)
    return cross_entropy(y, pred_y)


def cross_entropy(
    y: Int[Array, " batch"], pred_y: Float[Array, "batch 10"]
) -> Float[Array, ""]:
    # y are the true targets, and should be integers 0-9.
    # pred_y are the log-softmax'd predictions.
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


loss = eqx.filter_jit(loss)  # JIT our loss function from earlier!


@eqx.filter_jit
def compute_accuracy(
    model: CNN, x: Float[Array, "batch 1 12 12"], y: Int[Array, " batch"]
) -> Float[Array, ""]:
    """This function takes as input the current model
    and computes the average accuracy on a batch.
    """
    pred_y = jax.vmap(model)(x)
    pred_y = jnp.argmax(pred_y, axis=1)
    return jnp.mean(y == pred_y)


def evaluate(model: CNN, testloader: torch.utils.data.DataLoader):
    """This function evaluates the model on the test dataset,
    computing both the average loss and the average accuracy.
    """
    avg_loss = 0
    avg_acc = 0
    for x, y in testloader:
        x = x.numpy()
        y = y.numpy()
        # Note that all the JAX operations happen inside `loss` and `compute_accuracy`,
        # and both have JIT wrappers, so this is fast.
        avg_loss += loss(model, x, y)
        avg_acc += compute_accuracy(model, x, y)
    return avg_loss / len(testloader), avg_acc / len(testloader)


optim = optax.adamw(LEARNING_RATE)


def make_step(
    model: CNN,
    opt_state: PyTree,
    x: Float[Array, "batch 1 12 12"],
    y: Int[Array, " batch"],
):
    loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
    updates, opt_state = optim.update(
        grads, opt_state, eqx.filter(model, eqx.is_array)
    )
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss_value


# ---- corpus harness (not upstream) ----
class _Tensor:
    """What upstream's torch DataLoader yields: something with `.numpy()`."""

    def __init__(self, array):
        self.array = array

    def numpy(self):
        return self.array


def _batches(seed, n):
    rng = np.random.RandomState(seed)
    return [
        (rng.randn(BATCH_SIZE, 1, 12, 12).astype(np.float32),
         rng.randint(0, 10, BATCH_SIZE).astype(np.int64))
        for _ in range(n)
    ]


TRAIN_BATCHES = _batches(0, N_STEPS)
testloader = [(_Tensor(x), _Tensor(y)) for x, y in _batches(1, 2)]


def run(make_step, chunk=None):
    """Upstream's `train`: `opt_state = optim.init(eqx.filter(model, eqx.is_array))`, the loop
    `model, opt_state, train_loss = make_step(model, opt_state, x, y)`, then `evaluate`."""
    key = jax.random.PRNGKey(SEED)
    key, subkey = jax.random.split(key, 2)
    model = CNN(subkey)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    losses = []
    for x, y in calls(TRAIN_BATCHES, chunk):
        model, opt_state, train_loss = make_step(model, opt_state, x, y)
        losses.append(train_loss)
    post = evaluate(model, testloader)
    model = real(model)  # eqx.filter pairs it with a tree of its own type
    return Result((eqx.filter(model, eqx.is_array), opt_state), collect(losses, chunk), post)
