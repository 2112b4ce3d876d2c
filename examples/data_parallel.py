"""Data-parallel training on 8 devices with autoflat: replicated state, sharded batches.

The parameters and optimizer state are replicated over a one-axis mesh of 8 devices
(`NamedSharding(mesh, P())`) and each call's batches, of shape (num_steps, batch, ...), are
split along the batch axis (`P(None, "data")`): each device computes the gradient of its own
slice and XLA inserts the all-reduce, as with `jax.jit`. `autoflat.chunks(batches, 10,
sharding=NamedSharding(mesh, P("data")))` stacks the per-step batches and places them so, on
a background thread. The step is the ordinary one:

    @autoflat.step(num_steps=10)
    def update(params, opt_state, x, y):
        ...
        return params, opt_state, loss

autoflat pins the state's shardings, so the state comes back placed as it went in, call
after call. On a CPU the 8 devices are simulated (`--xla_force_host_platform_device_count=8`,
set below before JAX starts unless XLA_FLAGS already sets a device count).

    python examples/data_parallel.py                # 30 epochs of scikit-learn's digits
    python examples/data_parallel.py --plot loss.png
    python examples/data_parallel.py --smoke        # a few steps, for CI
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

import autoflat  # noqa: E402

BATCH = 64  # 8 examples per device
NUM_STEPS = 10
WIDTH = 128


def init_params(key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (64, WIDTH)) / 8.0,
        "b1": jnp.zeros(WIDTH),
        "w2": jax.random.normal(k2, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
        "b2": jnp.zeros(WIDTH),
        "w3": jax.random.normal(k3, (WIDTH, 10)) / np.sqrt(WIDTH),
        "b3": jnp.zeros(10),
    }


def forward(params: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = jax.nn.gelu(h @ params["w2"] + params["b2"])
    return h @ params["w3"] + params["b3"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean()


tx = optax.adamw(2e-3, weight_decay=1e-4)


@autoflat.step(num_steps=NUM_STEPS)
def update(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


@jax.jit
def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(forward(params, x), -1) == y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--plot", metavar="PATH", help="write the loss curve to a PNG")
    parser.add_argument("--smoke", action="store_true", help="a few steps only (CI)")
    args = parser.parse_args()
    if jax.device_count() < 8:
        sys.exit(f"needs 8 devices, found {jax.devices()} (XLA_FLAGS={os.environ['XLA_FLAGS']})")

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    replicated = NamedSharding(mesh, P())
    batch_sharded = NamedSharding(mesh, P("data"))  # one step's batch, split 8 ways
    print(f"autoflat {autoflat.__version__}, jax {jax.__version__}")
    print(f"mesh: {dict(mesh.shape)} over {mesh.devices.size} {jax.devices()[0].platform} devices")

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)

    params = jax.device_put(init_params(jax.random.key(0)), replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    before = jax.tree.leaves(jax.tree.map(lambda a: a.sharding, (params, opt_state)))

    epochs = 1 if args.smoke else args.epochs
    steps_per_epoch = 2 * NUM_STEPS if args.smoke else (len(x_train) // BATCH) // 10 * 10
    rng = np.random.default_rng(0)
    losses = []
    with tqdm(total=epochs * steps_per_epoch, unit="step", desc="training") as bar:
        for epoch in range(epochs):
            idx = rng.permutation(len(x_train))[: steps_per_epoch * BATCH]
            batches = [(x_train[i], y_train[i]) for i in idx.reshape(steps_per_epoch, BATCH)]
            # NUM_STEPS batches per chunk, placed with P(None, "data"): steps unsplit
            chunks = autoflat.chunks(batches, NUM_STEPS, sharding=batch_sharded)
            for xs, ys in chunks:
                if bar.n == 0:
                    shard = xs.addressable_shards[0].data.shape
                    tqdm.write(f"chunks: {xs.shape} sharded {xs.sharding.spec}, per device {shard}")
                params, opt_state, loss = update(params, opt_state, xs, ys)
                losses.extend(np.asarray(loss).tolist())
                bar.update(chunks.last_steps)
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.4f}")

    after = jax.tree.leaves(
        jax.tree.map(lambda a: a.sharding, autoflat.unwrap((params, opt_state)))
    )
    arrays = jax.tree.leaves(autoflat.unwrap((params, opt_state)))
    unchanged = all(
        b.is_equivalent_to(a, x.ndim) for a, b, x in zip(before, after, arrays, strict=True)
    )
    print(
        f"state shardings after training: {'unchanged' if unchanged else 'CHANGED'} "
        f"({len(arrays)} arrays, each {after[0].spec} replicated on "
        f"{len(after[0].device_set)} devices)"
    )
    assert unchanged
    s = autoflat.stats(update)
    print(
        f"autoflat: {s.calls} calls, {s.fast_path} state arguments on the fast path, "
        f"{s.flattens} host flattens, {s.traces} compiles"
    )
    acc = float(accuracy(autoflat.unwrap(params), jnp.asarray(x_test), jnp.asarray(y_test)))
    print(f"final training loss: {np.mean(losses[-NUM_STEPS:]):.4f}")
    print(f"test accuracy: {acc:.1%}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.8)
        ax.set(
            xlabel="step", ylabel="training loss", yscale="log", title="data parallel, 8 devices"
        )
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        print(f"loss curve written to {args.plot}")


if __name__ == "__main__":
    main()
