"""Checkpoint and resume autoflat training with orbax: the resumed run equals an unbroken one.

autoflat returns state as lazy handles. To save it, `autoflat.unwrap` gives the real pytrees
(here a dict of parameters and optax's AdamW state); orbax's `StandardCheckpointer` writes
them, and restores them into freshly built objects of the same structure. Training then
continues from the saved chunk, with the data in the same order, and the script checks that
the final parameters equal those of an uninterrupted run, bit for bit.

Orbax sees a handle as a pytree node of its own type, so pass it `autoflat.unwrap(...)`, not
the handles. Where orbax-checkpoint is not installed, the script says so and saves the same
unwrapped pytrees with `pickle` instead (handles also pickle as the objects they stand for).

    python examples/checkpointing.py                # 30 epochs, saved and resumed halfway
    python examples/checkpointing.py --plot loss.png
    python examples/checkpointing.py --smoke        # a few steps, for CI
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import autoflat

try:
    import orbax.checkpoint as ocp
except ImportError:  # pragma: no cover - orbax is optional
    ocp = None

BATCH = 32
NUM_STEPS = 10
WIDTH = 64


def init_params(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "hidden": {"w": jax.random.normal(k1, (64, WIDTH)) / 8.0, "b": jnp.zeros(WIDTH)},
        "out": {"w": jax.random.normal(k2, (WIDTH, 10)) / np.sqrt(WIDTH), "b": jnp.zeros(10)},
    }


def loss_fn(params, x, y):
    h = jax.nn.gelu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


tx = optax.adamw(3e-3, weight_decay=1e-4)


@autoflat.step(num_steps=NUM_STEPS)
def update(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def make_batches(n_steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The training data in a fixed order: `n_steps` per-step batches `(x, y)` of BATCH
    examples, reshuffled every epoch (an epoch: the whole chunks of NUM_STEPS batches that
    the data fills)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(0)
    per_epoch = len(x) // (BATCH * NUM_STEPS) * NUM_STEPS
    batches: list[tuple[np.ndarray, np.ndarray]] = []
    while len(batches) < n_steps:
        idx = rng.permutation(len(x))[: per_epoch * BATCH]
        batches += [(x[i], y[i]) for i in idx.reshape(per_epoch, BATCH)]
    return batches[:n_steps]


def fresh_state() -> tuple[dict, optax.OptState]:
    params = init_params(jax.random.key(0))
    return params, tx.init(params)


def train(params, opt_state, batches, bar, losses):
    """Train on per-step `batches`, NUM_STEPS steps per call."""
    chunks = autoflat.chunks(batches, NUM_STEPS)  # stacked, on device ahead of use
    for xs, ys in chunks:
        params, opt_state, loss = update(params, opt_state, xs, ys)
        losses.extend(np.asarray(loss).tolist())
        bar.update(chunks.last_steps)
    return params, opt_state


def save(path: Path, tree) -> None:
    if ocp is not None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path.absolute(), tree)
    else:
        path.write_bytes(pickle.dumps(jax.device_get(tree)))


def restore(path: Path, like):
    """The saved tree, restored with the structure, shapes and dtypes of `like`."""
    if ocp is not None:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path.absolute(), like)
    return jax.tree.map(jnp.asarray, pickle.loads(path.read_bytes()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--checkpoint-dir", help="where to save (default: a temporary folder)")
    parser.add_argument("--plot", metavar="PATH", help="write the loss curves to a PNG")
    parser.add_argument("--smoke", action="store_true", help="a few steps only (CI)")
    args = parser.parse_args()
    n_chunks = 4 if args.smoke else args.epochs * 5  # 5 chunks of 10 steps per epoch
    halfway = n_chunks // 2
    batches = make_batches(n_chunks * NUM_STEPS)
    how = "orbax StandardCheckpointer" if ocp is not None else "pickle (orbax not installed)"
    print(f"autoflat {autoflat.__version__}, jax {jax.__version__}; saving with {how}")
    print(f"{n_chunks} calls of {NUM_STEPS} steps; checkpoint after call {halfway}")

    with tqdm(total=2 * n_chunks * NUM_STEPS, unit="step", desc="training") as bar:
        # 1. uninterrupted
        unbroken_losses: list[float] = []
        params, opt_state = fresh_state()
        params, opt_state = train(params, opt_state, batches, bar, unbroken_losses)
        unbroken = autoflat.unwrap(params)

        # 2. interrupted: train half, save, throw the state away
        losses: list[float] = []
        params, opt_state = fresh_state()
        params, opt_state = train(params, opt_state, batches[: halfway * NUM_STEPS], bar, losses)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(args.checkpoint_dir or tmp) / f"chunk_{halfway}"
            handles = autoflat.is_handle(params) and autoflat.is_handle(opt_state)
            tree = {
                "params": autoflat.unwrap(params),  # the real dict and optax state
                "opt_state": autoflat.unwrap(opt_state),
                "chunk": halfway,
            }
            save(path, tree)
            tqdm.write(f"saved after call {halfway} to {path} (state held in handles: {handles})")
            del params, opt_state, tree

            # 3. resume: fresh objects, restored from the checkpoint
            params, opt_state = fresh_state()
            like = {"params": params, "opt_state": opt_state, "chunk": 0}
            restored = restore(path, like)
        params, opt_state = restored["params"], restored["opt_state"]
        start = int(restored["chunk"])
        tqdm.write(f"restored into fresh objects; resuming at call {start + 1}")
        params, opt_state = train(params, opt_state, batches[start * NUM_STEPS :], bar, losses)

    resumed = autoflat.unwrap(params)
    pairs = list(zip(jax.tree.leaves(resumed), jax.tree.leaves(unbroken), strict=True))
    bitwise = all(np.array_equal(a, b) for a, b in pairs)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    print(
        f"final loss: {np.mean(losses[-NUM_STEPS:]):.4f} (resumed), "
        f"{np.mean(unbroken_losses[-NUM_STEPS:]):.4f} (uninterrupted)"
    )
    print(
        f"resumed parameters equal the uninterrupted run's bit for bit: {bitwise} "
        f"({len(pairs)} arrays, max abs difference {diff})"
    )
    print(f"per-step losses equal bit for bit: {losses == unbroken_losses}")
    assert bitwise and losses == unbroken_losses
    s = autoflat.stats(update)
    print(f"autoflat: {s.calls} calls, {s.flattens} host flattens, {s.traces} compiles")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        steps = np.arange(1, len(losses) + 1)
        ax.plot(steps, unbroken_losses, lw=2.5, alpha=0.5, label="uninterrupted")
        ax.plot(steps, losses, lw=0.8, label="saved and resumed")
        ax.axvline(halfway * NUM_STEPS, color="gray", ls="--", lw=0.8)
        ax.set(xlabel="step", ylabel="training loss", yscale="log")
        ax.legend()
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        print(f"loss curves written to {args.plot}")


if __name__ == "__main__":
    main()
