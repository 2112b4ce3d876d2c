# Upstream: google-deepmind/optax, examples/mlp_mnist.ipynb
# (snapshot commit 2edbcbe2390da13983b92cbef94ac0460ecde1c5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: MLP (Flax NNX), compute_loss_and_accuracy, `train_step(model, optimizer,
# batch)` returning `loss, {"accuracy": accuracy}` (decorated `@nnx.jit` upstream: the test
# applies it), eval_step (keeps its `@nnx.jit`) and dataset_stats.
# Shrunk: hidden_sizes [1000, 1000] -> [12, 12]; 28x28 MNIST -> 6x6 synthetic images
# (flattened: 36 inputs), batch 128 -> 8.
# ruff: noqa: E111, E114, UP035
# fmt: off
"""optax MLP on MNIST with Flax NNX: in-place optimizer update plus returned loss and metrics."""

from typing import Sequence

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from corpus._harness import N_STEPS, Result, calls, collect

LEARNING_RATE = 0.002 # @param{type:"number"}
N_TARGETS = 10


class MLP(nnx.Module):
  """A simple multilayer perceptron model for image classification."""
  def __init__(self, num_inputs: int, num_classes: int, hidden_sizes:
               Sequence[int], *, rngs: nnx.Rngs):
    self.hidden_sizes = hidden_sizes
    self.layer1 = nnx.Linear(num_inputs, self.hidden_sizes[0], rngs=rngs)
    self.layer2 = nnx.Linear(self.hidden_sizes[0], self.hidden_sizes[1],
                             rngs=rngs)
    self.layer_out = nnx.Linear(self.hidden_sizes[1], num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.layer1(x))
    x = nnx.relu(self.layer2(x))
    x = self.layer_out(x)
    return x

def compute_loss_and_accuracy(model, batch):
    inputs, labels = batch
    logits = model(inputs)

    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=labels
    ).mean()

    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, accuracy

def train_step(model, optimizer, batch):
    """Performs a one step update."""
    grad_fn = nnx.value_and_grad(compute_loss_and_accuracy, has_aux=True)
    (loss, accuracy), grads = grad_fn(model, batch)

    # In-place update of the model parameters
    optimizer.update(model, grads)

    return loss, {"accuracy": accuracy}

@nnx.jit
def eval_step(model, batch):
    loss, accuracy = compute_loss_and_accuracy(model, batch)
    return loss, {"accuracy": accuracy}


def dataset_stats(model, data_loader):
    """Computes loss and accuracy over the dataset."""
    all_accuracy = []
    all_loss = []
    for batch in data_loader:
        loss, aux = eval_step(model, batch)
        all_loss.append(loss)
        all_accuracy.append(aux["accuracy"])
    return {"loss": np.mean(all_loss), "accuracy": np.mean(all_accuracy)}


# ---- corpus harness (not upstream) ----
IMG_SIZE = (6, 6, 1)


def _batches(seed, n):
    rng = np.random.RandomState(seed)
    return [
        (rng.rand(8, 36).astype(np.float32), rng.randint(0, N_TARGETS, 8).astype(np.int32))
        for _ in range(n)
    ]


TRAIN_BATCHES = _batches(0, N_STEPS)
TEST_BATCHES = _batches(1, 2)


def run(train_step, chunk=None):
    """Upstream's setup and loop (`train_loss, train_aux = train_step(model, optimizer,
    train_batch)`), then its `dataset_stats` on the test batches."""
    rngs = nnx.Rngs(0)
    flattened_img_size = int(np.prod(IMG_SIZE))
    model = MLP(num_inputs=flattened_img_size, num_classes=N_TARGETS,
                hidden_sizes=[12, 12], rngs=rngs)
    solver = optax.adam(LEARNING_RATE)
    optimizer = nnx.Optimizer(model, solver, wrt=nnx.Param)
    outputs = []
    for train_batch in calls(TRAIN_BATCHES, chunk):
        train_loss, train_aux = train_step(model, optimizer, train_batch)
        outputs.append((train_loss, train_aux))
    state = (nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(optimizer)))
    return Result(state, collect(outputs, chunk), dataset_stats(model, TEST_BATCHES))
