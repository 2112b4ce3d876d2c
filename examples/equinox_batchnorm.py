"""An Equinox CNN with batch norm, `(model, state)` style, trained on digits with autoflat.

Equinox keeps batch-norm running statistics outside the model, in an `eqx.nn.State` that the
step takes and returns next to the model and optimizer state:

    @autoflat.step(num_steps=10)
    def update(model, state, opt_state, x, y):
        ...
        return model, state, opt_state, loss

autoflat sees `state` returned by name and carries it from step to step with the model and
optimizer state, ten steps per call. After training the model is switched to inference mode
(`eqx.nn.inference_mode`: batch norm then uses the running statistics in `state`) and
evaluated on the held-out digits.

    python examples/equinox_batchnorm.py                # 20 epochs (under a minute on 2 CPUs)
    python examples/equinox_batchnorm.py --plot loss.png
    python examples/equinox_batchnorm.py --smoke        # a few steps, for CI
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import autoflat

BATCH = 32
NUM_STEPS = 10


class CNN(eqx.Module):
    """Two 3x3 convolutions, each followed by batch norm and ReLU, then a linear classifier.
    Takes one 1x8x8 image (vmap it over a batch, with `axis_name="batch"` for the norms)."""

    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array, channels: int = 16):
        k1, k2, k3 = jax.random.split(key, 3)
        # no bias before a batch norm (the norm's own bias replaces it)
        self.conv1 = eqx.nn.Conv2d(1, channels, 3, padding=1, use_bias=False, key=k1)
        self.norm1 = eqx.nn.BatchNorm(channels, axis_name="batch", mode="batch")
        self.conv2 = eqx.nn.Conv2d(
            channels, 2 * channels, 3, stride=2, padding=1, use_bias=False, key=k2
        )
        self.norm2 = eqx.nn.BatchNorm(2 * channels, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(2 * channels * 4 * 4, 10, key=k3)

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        x, state = self.norm1(self.conv1(x), state)
        x, state = self.norm2(self.conv2(jax.nn.relu(x)), state)
        return self.head(jax.nn.relu(x).reshape(-1)), state


def batched(model: CNN):
    """The model over a batch: one `state` shared by the batch, norms over the batch axis."""
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))


def loss_fn(model, state, x, y):
    logits, state = batched(model)(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


tx = optax.adam(3e-3)


@autoflat.step(num_steps=NUM_STEPS)
def update(model, state, opt_state, x, y):
    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, state, opt_state, loss


@eqx.filter_jit
def accuracy(model, state, x, y):
    logits, _ = batched(model)(x, state)
    return jnp.mean(jnp.argmax(logits, -1) == y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--plot", metavar="PATH", help="write the loss curve to a PNG")
    parser.add_argument("--smoke", action="store_true", help="a few steps only (CI)")
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.images[:, None] / 16.0).astype(np.float32)  # (N, 1, 8, 8): one channel
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    print(f"autoflat {autoflat.__version__}, jax {jax.__version__}, equinox {eqx.__version__}")
    print(f"digits: {len(x_train)} train / {len(x_test)} test images of 1x8x8 pixels")

    model, state = eqx.nn.make_with_state(CNN)(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    print("The code autoflat runs (first lines of autoflat.show(update)):")
    generated = autoflat.show(update).splitlines()
    print("\n".join("    " + line for line in generated[:8]) + "\n    ...\n")

    epochs = 1 if args.smoke else args.epochs
    steps_per_epoch = 2 * NUM_STEPS if args.smoke else len(x_train) // BATCH
    rng = np.random.default_rng(0)
    losses = []
    with tqdm(total=epochs * steps_per_epoch, unit="step", desc="training") as bar:
        for epoch in range(epochs):
            order = rng.permutation(len(x_train))[: steps_per_epoch * BATCH]
            batches = [(x_train[i], y_train[i]) for i in order.reshape(steps_per_epoch, BATCH)]
            chunks = autoflat.chunks(batches, NUM_STEPS)  # (NUM_STEPS, BATCH, ...) on device
            for xs, ys in chunks:
                model, state, opt_state, loss = update(model, state, opt_state, xs, ys)
                losses.extend(np.asarray(loss).tolist())
                bar.update(chunks.last_steps)
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.4f}")

    s = autoflat.stats(update)
    print(
        f"autoflat: {s.calls} calls, {s.fast_path} state arguments on the fast path, "
        f"{s.flattens} host flattens, {s.traces} compiles"
    )
    # Inference mode: batch norm normalises with the running statistics held in `state`.
    inference_model = eqx.nn.inference_mode(autoflat.unwrap(model))
    state = autoflat.unwrap(state)
    print(f"running statistics in the state: {len(jax.tree.leaves(state))} arrays")
    acc = float(accuracy(inference_model, state, jnp.asarray(x_test), jnp.asarray(y_test)))
    print(f"final training loss: {np.mean(losses[-NUM_STEPS:]):.4f}")
    print(f"test accuracy (inference mode): {acc:.1%}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.8)
        ax.set(xlabel="step", ylabel="training loss", yscale="log", title="CNN + BatchNorm")
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        print(f"loss curve written to {args.plot}")


if __name__ == "__main__":
    main()
