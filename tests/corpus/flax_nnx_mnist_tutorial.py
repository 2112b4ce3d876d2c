# Upstream: google/flax, docs_nnx/mnist_tutorial.md (the "MNIST tutorial" notebook;
# snapshot commit 18f8f311c275d57f46d95e41b15aa97b454754c0).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: CNN, loss_fn, `train_step(model, optimizer, metrics, rngs, batch)` (in-place
# updates of the model, an `nnx.Optimizer`, an `nnx.MultiMetric` and an `nnx.Rngs`; nothing
# returned), eval_step and pred_step, all decorated `@nnx.jit` upstream (the test applies it to
# train_step; eval_step and pred_step keep it), and the `nnx.view` train/eval models.
# Shrunk: Conv(1, 32)/Conv(32, 64)/Linear(3136, 256) -> Conv(1, 3)/Conv(3, 5)/Linear(20, 6)
# (BatchNorm sizes with them); 28x28 MNIST -> 8x8 synthetic images, batch 32 -> 6.
# ruff: noqa: E111, E114, UP045
# fmt: off
"""Flax NNX MNIST tutorial: Model, Optimizer, MultiMetric and Rngs mutated in place."""

from functools import partial

import numpy as np
import optax
from flax import nnx

from corpus._harness import N_STEPS, Result, calls


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 3, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(3, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(3, 5, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(5, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(20, 6, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(6, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x


learning_rate = 0.005
momentum = 0.9


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch['image'], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, logits

def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
  """Train for a single step."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
  optimizer.update(model, grads)  # In-place updates.

@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.


@nnx.jit
def pred_step(model: CNN, batch):
  logits = model(batch['image'], None)
  return logits.argmax(axis=1)


# ---- corpus harness (not upstream) ----
BATCH = 6


def _batches(seed, n):
    rng = np.random.RandomState(seed)
    return [
        {
            "image": rng.rand(BATCH, 8, 8, 1).astype(np.float32),
            "label": rng.randint(0, 10, BATCH).astype(np.int32),
        }
        for _ in range(n)
    ]


TRAIN_BATCHES = _batches(0, N_STEPS)
TEST_BATCHES = _batches(1, 2)


def run(train_step, chunk=None):
    """Upstream's setup and loop (`train_step(train_model, optimizer, metrics, rngs, batch)`),
    then its evaluation: the train metrics, `eval_step` over the test batches, `pred_step`."""
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
      model, optax.adamw(learning_rate, momentum), wrt=nnx.Param
    )
    metrics = nnx.MultiMetric(
      accuracy=nnx.metrics.Accuracy(),
      loss=nnx.metrics.Average('loss'),
    )
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    rngs = nnx.Rngs(0)
    for batch in calls(TRAIN_BATCHES, chunk):
        train_step(train_model, optimizer, metrics, rngs, batch)
    train_metrics = metrics.compute()
    state = {
        "model": nnx.to_pure_dict(nnx.state(model)),
        "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
        "rngs": nnx.to_pure_dict(nnx.state(rngs)),
    }
    metrics.reset()
    for test_batch in TEST_BATCHES:
        eval_step(eval_model, metrics, test_batch)
    pred = pred_step(eval_model, test_batch)
    test_metrics = metrics.compute()
    # conv2's bias feeds batch_norm2, which subtracts the batch mean: its true gradient is 0,
    # and what the backward pass computes is float noise (~1e-8, where other gradients are
    # ~1e-1) that adamw normalises into steps of full size and random sign. That bias, the
    # running mean it shifts, and the test loss through that mean, are only compared to a
    # bound (another XLA program, a `lax.scan` of 4 steps, has other noise).
    loose = (state["model"]["conv2"].pop("bias"), state["model"]["batch_norm2"].pop("mean"),
             test_metrics.pop("loss"))
    return Result(state, None, (train_metrics, test_metrics, pred), loose)
