"""Flax NNX, mutation style: the Flax docs' train and eval steps, ten steps per call.

The steps are written exactly as the Flax docs write them for `@nnx.jit`: they update the
model, optimizer and metrics in place and return nothing. Only the decorator changes:

    @autoflat.step(num_steps=10)
    def train_step(model, optimizer, metrics, x, y):
        ...
        optimizer.update(model, grads)
        metrics.update(loss=loss, logits=logits, labels=y)

autoflat sees the NNX modules at run time and carries them as state through a `lax.scan`
of ten steps, then writes the new values back into the caller's own objects, as `nnx.jit`
does. The model (Linear, BatchNorm, Dropout with its own `nnx.Rngs` stream) trains on
scikit-learn's digits; after each epoch `model.eval()` switches batch norm and dropout to
inference and an eval step in the same style fills the metrics from the test set.

    python examples/nnx_metrics.py                 # 10 epochs (well under a minute on 2 CPUs)
    python examples/nnx_metrics.py --plot metrics.png
    python examples/nnx_metrics.py --smoke         # a few steps, for CI
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import autoflat

BATCH = 32
NUM_STEPS = 10


class MLP(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.bn = nnx.BatchNorm(dmid, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.dropout(self.bn(self.linear1(x))))
        return self.linear2(x)


def loss_fn(model, x, y):
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=y).mean()
    return loss, logits


@autoflat.step(num_steps=NUM_STEPS)
def train_step(model, optimizer, metrics, x, y):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, x, y)
    metrics.update(loss=loss, logits=logits, labels=y)  # in-place updates
    optimizer.update(model, grads)  # in-place updates


@autoflat.step(num_steps=NUM_STEPS)
def eval_step(model, metrics, x, y):
    loss, logits = loss_fn(model, x, y)
    metrics.update(loss=loss, logits=logits, labels=y)  # in-place updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--plot", metavar="PATH", help="write the metric curves to a PNG")
    parser.add_argument("--smoke", action="store_true", help="a few steps only (CI)")
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    print(f"autoflat {autoflat.__version__}, jax {jax.__version__} on {jax.default_backend()}")
    print(f"digits: {len(x_train)} train / {len(x_test)} test images of 8x8 pixels")

    model = MLP(64, 128, 10, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3, weight_decay=1e-4), wrt=nnx.Param)
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(),
        loss=nnx.metrics.Average("loss"),
    )

    # the test set as NUM_STEPS batches: one eval call
    test_batch = len(x_test) // NUM_STEPS
    n_test = test_batch * NUM_STEPS
    test_xs = jnp.asarray(x_test[:n_test].reshape(NUM_STEPS, test_batch, -1))
    test_ys = jnp.asarray(y_test[:n_test].reshape(NUM_STEPS, test_batch))

    epochs = 1 if args.smoke else args.epochs
    steps_per_epoch = 2 * NUM_STEPS if args.smoke else len(x_train) // BATCH
    rng = np.random.default_rng(0)
    history: dict[str, list[float]] = {}
    with tqdm(total=epochs * steps_per_epoch, unit="step", desc="training") as bar:
        for epoch in range(1, epochs + 1):
            model.train()  # batch statistics, dropout on
            idx = rng.permutation(len(x_train))[: steps_per_epoch * BATCH]
            batches = [(x_train[i], y_train[i]) for i in idx.reshape(steps_per_epoch, BATCH)]
            chunks = autoflat.chunks(batches, NUM_STEPS)  # (NUM_STEPS, BATCH, ...) on device
            for xs, ys in chunks:
                train_step(model, optimizer, metrics, xs, ys)
                bar.update(chunks.last_steps)
            line = [f"epoch {epoch:2d}"]
            for split in ("train", "test"):
                if split == "test":
                    model.eval()  # running statistics, dropout off
                    eval_step(model, metrics, test_xs, test_ys)
                for metric, value in metrics.compute().items():
                    history.setdefault(f"{split}_{metric}", []).append(float(value))
                metrics.reset()
                line.append(
                    f"{split} loss {history[f'{split}_loss'][-1]:.4f} "
                    f"accuracy {history[f'{split}_accuracy'][-1]:6.2%}"
                )
            tqdm.write(" | ".join(line))

    print(f"optimizer steps: {int(optimizer.step[...])} (the caller's own optimizer object)")
    for name, step in (("train_step", train_step), ("eval_step", eval_step)):
        s = autoflat.stats(step)
        print(f"autoflat {name}: {s.calls} calls, {s.traces} compiles, {s.copies} copies")
    print("The code autoflat runs for train_step (first lines of autoflat.show):")
    generated = autoflat.show(train_step).splitlines()
    print("\n".join("    " + line for line in generated[:8]) + "\n    ...")
    print(f"final test accuracy: {history['test_accuracy'][-1]:.1%}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        epochs_axis = np.arange(1, epochs + 1)
        for split in ("train", "test"):
            ax1.plot(epochs_axis, history[f"{split}_loss"], "o-", label=split)
            ax2.plot(epochs_axis, history[f"{split}_accuracy"], "o-", label=split)
        ax1.set(xlabel="epoch", ylabel="loss", yscale="log")
        ax2.set(xlabel="epoch", ylabel="accuracy")
        ax1.legend()
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        print(f"metric curves written to {args.plot}")


if __name__ == "__main__":
    main()
