"""The flagship example: train a residual MLP on scikit-learn's handwritten digits.

The update function is ordinary JAX + optax. `@autoflat.step(num_steps=10)` runs ten of them
per call, with the parameters and optimizer state crossing `jax.jit` as flat leaf lists, and
`autoflat.chunks` stacks the per-step batches ten at a time, on device ahead of use.
The script prints the generated code, trains with a progress bar, reports test accuracy, and
ends with the time per step of plain `jax.jit` against autoflat, measured in this run the
way the benchmarks measure it (`benchmarks/harness.py`): short blocks of each method in
turn, every method continuing from the state its last block returned, medians with spreads.

    python examples/train_digits.py            # full run (about a minute on 2 CPU cores)
    python examples/train_digits.py --smoke    # a few steps, for CI
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import autoflat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout: its benchmarks
from benchmarks import harness  # noqa: E402  (the benchmarks' timing harness)

BLOCKS = 8
WIDTH = 64
BATCH = 32
NUM_STEPS = 10


def init_params(key: jax.Array) -> dict:
    """A residual MLP: input layer, BLOCKS residual blocks with layer norm, output layer."""
    keys = jax.random.split(key, BLOCKS + 2)

    def dense(k, n_in, n_out):
        return {"w": jax.random.normal(k, (n_in, n_out)) / jnp.sqrt(n_in), "b": jnp.zeros(n_out)}

    return {
        "inp": dense(keys[0], 64, WIDTH),
        "blocks": [
            {**dense(k, WIDTH, WIDTH), "scale": jnp.ones(WIDTH), "shift": jnp.zeros(WIDTH)}
            for k in keys[1:-1]
        ],
        "out": dense(keys[-1], WIDTH, 10),
    }


def forward(params: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ params["inp"]["w"] + params["inp"]["b"])
    for block in params["blocks"]:
        z = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-5)
        z = z * block["scale"] + block["shift"]
        h = h + jax.nn.gelu(z @ block["w"] + block["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = forward(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


tx = optax.adamw(3e-3, weight_decay=1e-4)


def update(params, opt_state, x, y):
    """One training step, written as for `jax.jit`."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


train_step = autoflat.step(update, num_steps=NUM_STEPS)


@jax.jit
def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(forward(params, x), -1) == y)


def epoch_batches(
    rng: np.random.Generator, x: np.ndarray, y: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One epoch of per-step batches `(x, y)` of BATCH examples each, reshuffled (the last
    examples that do not fill a batch are left out)."""
    order = rng.permutation(len(x))
    steps = len(x) // BATCH
    return [(x[idx], y[idx]) for idx in order[: steps * BATCH].reshape(steps, BATCH)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="a few steps only (CI)")
    args = parser.parse_args()
    epochs = 1 if args.smoke else args.epochs

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    print(f"autoflat {autoflat.__version__}, jax {jax.__version__}, devices: {jax.devices()}")
    print(f"digits: {len(x_train)} train / {len(x_test)} test images of 8x8 pixels")

    params = init_params(jax.random.key(0))
    opt_state = tx.init(params)
    n_leaves = len(jax.tree.leaves((params, opt_state)))
    print(f"state: {n_leaves} arrays (parameters and AdamW moments)\n")
    print("The code autoflat runs (first lines of autoflat.show(train_step)):")
    generated = autoflat.show(train_step).splitlines()
    print("\n".join("    " + line for line in generated[:14]) + "\n    ...\n")

    rng = np.random.default_rng(0)
    steps_per_epoch = len(x_train) // BATCH
    with tqdm(total=epochs * steps_per_epoch, unit="step", desc="training") as bar:
        for epoch in range(epochs):
            # NUM_STEPS batches per call, stacked and copied to the device on a background
            # thread while the previous call runs; the epoch's last chunk may be shorter.
            chunks = autoflat.chunks(epoch_batches(rng, x_train, y_train), NUM_STEPS)
            for xs, ys in chunks:
                params, opt_state, losses = train_step(params, opt_state, xs, ys)
                bar.update(chunks.last_steps)
            bar.set_postfix(epoch=epoch + 1, loss=f"{float(losses[-1]):.4f}")
    acc = float(accuracy(params, jnp.asarray(x_test), jnp.asarray(y_test)))
    print(f"test accuracy: {acc:.1%}  (about 98% is expected after 30 epochs)")
    stats = autoflat.stats(train_step)
    print(
        f"autoflat: {stats.calls} calls, {stats.fast_path} state arguments on the fast path, "
        f"{stats.flattens} host flattens, {stats.traces} compiles, {stats.rebuilds} rebuilds\n"
    )

    # Where a call's time goes, on this machine (measured on copies: the state is untouched).
    batches = epoch_batches(rng, x_train, y_train)
    xs, ys = (np.stack(part) for part in zip(*batches[:NUM_STEPS], strict=True))
    print(autoflat.profile(train_step, params, opt_state, xs, ys, calls=3 if args.smoke else 20))
    print()

    # Time per step, measured here: the same update three ways, from the same start.
    start = init_params(jax.random.key(1))
    state = lambda: harness.fresh((start, tx.init(start)))  # noqa: E731
    plain = lambda: harness.Plan(lambda: jax.jit(update), state())  # noqa: E731
    methods = [
        harness.Method("jit", "plain jax.jit", plain),
        harness.autoflat_method("autoflat_1", update, state),
        harness.autoflat_method("autoflat_10", update, state),
    ]
    checks = [(jnp.asarray(x), jnp.asarray(y)) for x, y in batches[: harness.CHECK_STEPS]]
    repeats, block_s = (2, 0.02) if args.smoke else (7, 0.3)
    harness.check_and_time("time per step", methods, checks[0], checks, repeats, block_s)
    print("\n".join(harness.step_table(harness.method_rows(methods), [("jit", "jax.jit")])))
    print("(× jax.jit: time per step against plain jax.jit's; below 1 is faster)")


if __name__ == "__main__":
    main()
