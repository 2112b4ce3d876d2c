"""Multi-process training with autoflat: data parallel across processes, FSDP within each.

    python examples/multihost.py --local 2           # two processes on this machine
    python examples/multihost.py --local 2 --smoke   # a few steps, for CI
    srun python examples/multihost.py                # on SLURM: one process per task

Every process of a job runs this same script. `jax.distributed.initialize()` finds the
coordinator, the number of processes and this process's index (from SLURM, Open MPI, a
Kubernetes indexed Job or a Cloud TPU), and `jax.devices()` then lists the devices of every
process. `--local N` is the launcher for one machine: it starts N copies of this script on
127.0.0.1, each with two CPU devices and gloo collectives, and waits for them (killing the
rest if one fails).

The mesh has a `data` axis across processes and an `fsdp` axis across the devices of each
process. The parameters and Adam state are sharded over `fsdp` and replicated over `data`;
each step's batch of 64 digits is split over both. Each process reads only its own rows of
every batch, and `autoflat.chunks` stacks them into chunks of 4 steps and builds the global
arrays (`jax.make_array_from_process_local_data`). The step is the ordinary optax step under
`@autoflat.step(num_steps=4)`; autoflat keeps every state leaf's sharding from call to call.

Halfway, the state is saved with orbax (`autoflat.unwrap` gives it the real pytrees; every
process writes its own shards), restored into arrays of the same shardings, and training
continues from the restored state.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autoflat

BATCH = 64  # global: each of the processes reads BATCH // process_count rows per step
NUM_STEPS = 4
WIDTH = 128
DEVICES_PER_PROCESS = 2  # with --local: CPU devices per process


# --- the model and the step ------------------------------------------------------------------
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


# FSDP: every weight is split over the devices of a process (and replicated across processes)
PARAM_SPECS = {
    "w1": P(None, "fsdp"),
    "b1": P("fsdp"),
    "w2": P("fsdp", None),
    "b2": P(),
    "w3": P("fsdp", None),
    "b3": P(),
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


# --- one process of the job ------------------------------------------------------------------
def make_mesh() -> Mesh:
    """`data` across processes, `fsdp` across the devices of each process."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(jax.process_count(), jax.local_device_count())
    return Mesh(grid, ("data", "fsdp"))


def load_digits_split() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return tuple(train_test_split(x, y, test_size=0.2, random_state=0))


def local_batches(x, y, epoch: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """This process's rows of every step's global batch in one epoch. Every process draws
    the same permutation (the same seed) and keeps its own slice of each batch: what a
    per-process data loader (grain, tf.data with sharding) hands each process."""
    per_process = BATCH // jax.process_count()
    mine = slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)
    order = np.random.default_rng(epoch).permutation(len(x))[: steps * BATCH]
    return [(x[rows[mine]], y[rows[mine]]) for rows in order.reshape(steps, BATCH)]


def log(*args: object) -> None:
    """Print from process 0 only (every process computes the same global values)."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def train(args: argparse.Namespace) -> None:
    import orbax.checkpoint as ocp

    mesh = make_mesh()
    log(
        f"{jax.process_count()} processes x {jax.local_device_count()} devices; "
        f"mesh {dict(mesh.shape)}; autoflat {autoflat.__version__}, jax {jax.__version__}"
    )
    x_train, x_test, y_train, y_test = load_digits_split()
    steps_per_epoch = 10 if args.smoke else len(x_train) // BATCH
    epochs = 2 if args.smoke else args.epochs
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))  # one step's batch: split 4 ways

    # Every process runs the same initialization; jit places the result on the global mesh.
    shardings = {k: NamedSharding(mesh, spec) for k, spec in PARAM_SPECS.items()}
    params = jax.jit(init_params, out_shardings=shardings)(jax.random.key(0))
    opt_state = jax.jit(tx.init)(params)  # moments sharded as the parameters
    before = [(a.sharding, a.ndim) for a in jax.tree.leaves((params, opt_state))]

    checkpoint = Path(args.checkpoint_dir).absolute() / "halfway"
    for epoch in range(epochs):
        batches = local_batches(x_train, y_train, epoch, steps_per_epoch)
        losses = []
        for xs, ys in autoflat.chunks(batches, NUM_STEPS, sharding=batch_sharding):
            params, opt_state, loss = update(params, opt_state, xs, ys)
            losses.extend(np.asarray(loss).tolist())  # a replicated global array
        log(f"epoch {epoch + 1}: {len(losses)} steps, losses {np.round(losses[:4], 4)} ...")
        log(f"         final loss {losses[-1]:.4f}")
        if epoch + 1 == epochs // 2:
            # orbax takes the real objects (it pairs the tree with one mapped from it, which
            # holds the real types); every process writes the shards it holds.
            state = autoflat.unwrap({"params": params, "opt_state": opt_state})
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(checkpoint, state)
            # Restore into arrays of the same shapes, dtypes and shardings, and go on from it.
            like = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            with ocp.StandardCheckpointer() as checkpointer:
                restored = checkpointer.restore(checkpoint, like)
            same = all(
                bool(jnp.array_equal(a, b))
                for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True)
            )
            log(f"saved and restored after epoch {epoch + 1}: equal to the live state: {same}")
            params, opt_state = restored["params"], restored["opt_state"]

    # every leaf placed on several devices keeps its sharding (the step count that tx.init
    # makes on one device is placed where jax.jit places it)
    after = [a.sharding for a in jax.tree.leaves((params, opt_state))]
    kept = all(
        b.is_equivalent_to(a, ndim)
        for (a, ndim), b in zip(before, after, strict=True)
        if len(a.device_set) > 1
    )
    log(f"state shardings after training: {'unchanged' if kept else 'CHANGED'}")
    acc = float(accuracy(params, x_test, y_test))
    s = autoflat.stats(update)
    log(
        f"autoflat: {s.calls} calls, {s.fast_path} state arguments on the fast path, "
        f"{s.traces} compiles"
    )
    log(f"test accuracy: {acc:.1%}")
    assert kept


def initialize(args: argparse.Namespace) -> None:
    if args.coordinator is None:
        jax.distributed.initialize()  # SLURM, Open MPI, Kubernetes, Cloud TPU: auto-detected
        return
    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=120,
    )


# --- the launcher for one machine ------------------------------------------------------------
def launch_local(n: int, argv: list[str], checkpoint_dir: str | None) -> int:
    """Run `n` processes of this script on 127.0.0.1 and wait for all of them; if one fails,
    kill the others (they would wait for it in a collective) and return its exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
    )
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            f"--coordinator=127.0.0.1:{port}",
            f"--num-processes={n}",
            f"--checkpoint-dir={checkpoint_dir or tmp}",  # shared by all processes
        ]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, *argv, *common, f"--process-id={i}"], env=env
            )
            for i in range(n)
        ]
        try:
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
    failed = [p.returncode for p in procs if p.returncode != 0]
    return failed[0] if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="launch N processes here")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="two short epochs (CI)")
    parser.add_argument("--checkpoint-dir", help="shared by all processes (default: temporary)")
    # set by --local (elsewhere, jax.distributed.initialize() detects them)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.local:
        options = [f"--epochs={args.epochs}", *(["--smoke"] if args.smoke else [])]
        sys.exit(launch_local(args.local, options, args.checkpoint_dir))
    initialize(args)
    if args.checkpoint_dir is None:
        sys.exit("a multi-process run needs --checkpoint-dir on a file system every process sees")
    train(args)


if __name__ == "__main__":
    main()
