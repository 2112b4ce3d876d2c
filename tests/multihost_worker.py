"""One process of the multi-process tests (`tests/test_multihost.py`), and their definitions.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/multihost_worker.py \\
        --process-id 0 --num-processes 2 --port 12345 --out DIR --cases dp,fsdp,nnx

Each process initializes JAX's distributed runtime on 127.0.0.1 with gloo CPU collectives and
runs the cases with autoflat on a mesh of every process's devices, feeding each process's own
part of every batch (`jax.make_array_from_process_local_data`). It writes every result,
gathered in full (so all processes write the same values), to `DIR/result-<process>.npz`, and
the checks that are not values (shardings kept, packing, checkpoint names) to
`DIR/result-<process>.json`. The test compares those with a `jax.jit` loop in one process on
a mesh of the same shape, computed from the definitions here (`reference`).

Cases (`CASES`):

- `dp`: data parallel, parameters and Adam state replicated on a `data` axis of all devices;
- `fsdp`: parameters and Adam state sharded over an `fsdp` axis of all devices (so every
  array spans both processes), batches split over the same axis;
- `nnx`: a Flax NNX mutation-style step (model and `nnx.Optimizer` updated in place) on a
  (`data`, `model`) mesh whose `model` axis spans the processes, Variables sharded over it;
- `resume`: the `fsdp` run saved with orbax after 4 steps (every process writing its own
  shards), restored and continued, next to the uninterrupted run;
- `chunks`: the `dp` run fed by `autoflat.chunks` from each process's half of every batch.

Each of `dp`, `fsdp` and `nnx` runs at `num_steps=1` (one call per step, `pack="auto"`, the
default rule, named whatever `AUTOFLAT_PACK` says) and at `num_steps=4` with packed transport (`pack=True`: a chunk of 4 steps, then
the shorter final chunk of 2), so the packing check has something it could get wrong.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autoflat

STEPS = 6  # per run: 6 calls at num_steps=1; a chunk of 4 and a final chunk of 2 at 4
CHUNK = 4
BATCH = 8  # global: 2 rows per device on the 4 devices of two processes
FEATURES = 4
HIDDEN = 16
OUT = 2
CASES = ("dp", "fsdp", "nnx", "resume", "chunks")
MESH_DEVICES = 4  # every case's mesh: two processes of two devices (or one process of four)

# Adam with its learning rate in the state: two int32 step counts and a float32 scalar that
# `tx.init` makes on one device (so `pack=True` has leaves to pack) beside the moments, which
# take the parameters' shardings
tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


# --- the steps ---------------------------------------------------------------------------------
def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def update(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def nnx_train_step(model, optimizer, x, y):
    def mse(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(mse)(model)
    optimizer.update(model, grads)  # mutation: nothing returned but the loss
    return loss


# --- meshes, shardings, data -------------------------------------------------------------------
def mesh_for(case: str, devices: Sequence[Any]) -> Mesh:
    """The case's mesh over 4 devices (ordered by process: the first two are process 0's)."""
    devices = np.array(devices[:MESH_DEVICES])
    if case in ("dp", "chunks"):
        return Mesh(devices, ("data",))
    if case in ("fsdp", "resume"):
        return Mesh(devices, ("fsdp",))
    # rows are `data`, columns `model`: the transpose puts one device of each process on
    # every row, so the `model` axis spans the processes and each process holds every row
    return Mesh(devices.reshape(2, 2).T, ("data", "model"))


def batch_axis(case: str) -> str:
    return "fsdp" if case in ("fsdp", "resume") else "data"


PARAM_SPECS = {
    "dp": {"w1": P(), "b1": P(), "w2": P()},
    "fsdp": {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)},
}


def nnx_spec(path: str) -> P:
    """The sharding of a Variable of `MLP` by its key path: hidden units over `model`."""
    if "l1" in path:
        return P(None, "model") if "kernel" in path else P("model")
    return P("model", None) if "kernel" in path else P()


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """A global array with the value `x` has in every process (made from each process's own
    copy; no transfer between processes)."""
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def local_part(data: np.ndarray, sharding: NamedSharding) -> np.ndarray:
    """This process's part of a global batch under `sharding`: what a per-process data loader
    would read (the rows its devices hold)."""
    indices = list(sharding.addressable_devices_indices_map(data.shape).values())
    slices = []
    for d, n in enumerate(data.shape):
        starts = [i[d].start or 0 for i in indices]
        stops = [n if i[d].stop is None else i[d].stop for i in indices]
        slices.append(slice(min(starts), max(stops)))
    return data[tuple(slices)]


def global_data() -> tuple[np.ndarray, np.ndarray]:
    """Every step's global batch: xs (STEPS, BATCH, FEATURES), ys (STEPS, BATCH, OUT)."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, BATCH, FEATURES)).astype(np.float32)
    ys = rng.normal(size=(STEPS, BATCH, OUT)).astype(np.float32)
    return xs, ys


def init_state(case: str, mesh: Mesh) -> tuple[Any, Any]:
    """(params, Adam state) or, for `nnx`, (model, optimizer): the same values in every
    process, placed on the mesh as the case shards them."""
    if case == "nnx":
        model = MLP(nnx.Rngs(0))
        state = jax.tree_util.tree_map_with_path(
            lambda path, x: place(x, NamedSharding(mesh, nnx_spec(jax.tree_util.keystr(path)))),
            nnx.state(model),
        )
        nnx.update(model, state)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(1)
    host = {
        "w1": rng.normal(size=(FEATURES, HIDDEN)).astype(np.float32) * 0.5,
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(size=(HIDDEN, OUT)).astype(np.float32) * 0.5,
    }
    specs = PARAM_SPECS["fsdp" if case == "resume" else "dp" if case == "chunks" else case]
    params = {k: place(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    return params, tx.init(params)


def feed(case: str, mesh: Mesh, num_steps: int) -> list[tuple[jax.Array, jax.Array]]:
    """The global (x, y) of every call: one step's batch each at `num_steps=1`, else chunks
    of `num_steps` steps and a shorter final one; built from each process's own part."""
    xs, ys = global_data()
    axis = batch_axis(case)
    if num_steps == 1:
        sharding = NamedSharding(mesh, P(axis))
        starts = [(i, None) for i in range(STEPS)]
    else:
        sharding = NamedSharding(mesh, P(None, axis))  # the steps axis unsplit
        starts = [(i, min(i + num_steps, STEPS)) for i in range(0, STEPS, num_steps)]
    out = []
    for start, stop in starts:
        x, y = (xs[start], ys[start]) if stop is None else (xs[start:stop], ys[start:stop])
        out.append(
            tuple(
                jax.make_array_from_process_local_data(sharding, local_part(a, sharding), a.shape)
                for a in (x, y)
            )
        )
    return out


@functools.cache
def _replicator(sharding: NamedSharding) -> Any:
    return jax.jit(lambda arrays: arrays, out_shardings=sharding)


def to_host(arrays: Sequence[Any], mesh: Mesh) -> list[np.ndarray]:
    """The full values of `arrays` (on `mesh`, or on this process alone), in every process.
    Those spread over several processes are replicated by one compiled identity for all of
    them (`multihost_utils.process_allgather` compiles one per array)."""
    out: list[Any] = [None] * len(arrays)
    spread = []
    for i, x in enumerate(arrays):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            spread.append(i)
        else:
            out[i] = np.asarray(x)
    if spread:
        replicated = _replicator(NamedSharding(mesh, P()))([arrays[i] for i in spread])
        for i, x in zip(spread, replicated, strict=True):
            out[i] = np.asarray(x.addressable_data(0))
    return out


# --- the single-process reference --------------------------------------------------------------
def reference(case: str, devices: Sequence[Any]) -> dict[str, np.ndarray]:
    """The same training as a `jax.jit` loop, one step per call, in this (single) process on a
    mesh of the same shape: the final state's leaves (`state/<i>`) and the losses (`loss`)."""
    mesh = mesh_for(case, devices)
    first, second = init_state(case, mesh)
    batches = feed(case, mesh, 1)
    losses = []
    if case == "nnx":
        graphdef, state = nnx.split((first, second))

        @jax.jit
        def step(state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss = nnx_train_step(model, optimizer, x, y)
            return nnx.state((model, optimizer)), loss

        for x, y in batches:
            state, loss = step(state, x, y)
            losses.append(loss)
        leaves = jax.tree.leaves(state)
    else:
        jitted = jax.jit(update)
        params, opt_state = first, second
        for x, y in batches:
            params, opt_state, loss = jitted(params, opt_state, x, y)
            losses.append(loss)
        leaves = jax.tree.leaves((params, opt_state))
    out = {f"state/{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
    out["loss"] = np.stack([np.asarray(v) for v in losses])
    return out


# --- the checks --------------------------------------------------------------------------------
def sharding_changes(before: list[Any], after: list[Any]) -> list[str]:
    """Leaves placed on several devices whose sharding the run did not keep (a leaf that
    started on one device is placed as `jax.jit` places it, as in the one-process tests)."""
    changes = []
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if len(a.sharding.device_set) > 1 and not b.sharding.is_equivalent_to(a.sharding, a.ndim):
            changes.append(f"leaf {i} {a.shape}: {a.sharding} became {b.sharding}")
    return changes


def packing(lowered: autoflat.Lowered, before: list[Any]) -> dict[str, Any]:
    """How the state travels into the compiled program (`Lowered.args`: the buffers it takes
    per state argument): `spread_packed` lists the leaves placed on several devices that have
    no buffer of their own (packed with others, they would show as part of a 1-D buffer of
    another shape); `leaves` and `buffers` count both, so fewer buffers than leaves shows that
    other leaves were packed."""
    buffers = [(b.shape, b.sharding) for state in lowered.args[0] for b in state]
    n_buffers = len(buffers)
    missing = []
    for i, a in enumerate(before):
        if len(a.sharding.device_set) == 1:
            continue
        for j, (shape, sharding) in enumerate(buffers):
            if shape == a.shape and sharding.is_equivalent_to(a.sharding, a.ndim):
                del buffers[j]
                break
        else:
            missing.append(f"leaf {i} {a.shape} {a.sharding.spec} has no buffer of its own")
    return {"spread_packed": missing, "leaves": len(before), "buffers": n_buffers}


def _spans_processes(leaves: Iterable[Any]) -> bool:
    return any(len({d.process_index for d in x.sharding.device_set}) > 1 for x in leaves)


# --- the runs ----------------------------------------------------------------------------------
Results = dict[str, np.ndarray]
Checks = dict[str, Any]


def _store(results: Results, prefix: str, leaves: list[Any], losses: list[Any], mesh: Mesh) -> None:
    values = to_host([*leaves, *losses], mesh)
    for i, value in enumerate(values[: len(leaves)]):
        results[f"{prefix}/state/{i}"] = value
    results[f"{prefix}/loss"] = np.concatenate([v.reshape(-1) for v in values[len(leaves) :]])


@functools.cache
def make_step(fn: Callable[..., Any], num_steps: int) -> autoflat.Step:
    """One autoflat step per function and `num_steps`, shared by the cases (a case on another
    mesh compiles it again; one on the same mesh, as `chunks` after `dp`, does not).
    `num_steps > 1` packs state (`pack=True`); 1 uses the default rule (`pack="auto"`, named
    so that the check holds whatever `AUTOFLAT_PACK` says)."""
    return autoflat.step(fn, num_steps=num_steps, pack=True if num_steps > 1 else "auto")


def run_functional(case: str, mesh: Mesh, num_steps: int, results: Results, checks: Checks) -> None:
    """`update` under autoflat on the case's mesh (`dp`, `fsdp`)."""
    params, opt_state = init_state(case, mesh)
    before = jax.tree.leaves((params, opt_state))
    step = make_step(update, num_steps)
    start = autoflat.stats(step)
    p, o = params, opt_state
    losses = []
    batches = feed(case, mesh, num_steps)
    for x, y in batches:
        p, o, loss = step(p, o, x, y)
        losses.append(loss)
    end = autoflat.stats(step)
    after = jax.tree.leaves((p, o))
    prefix = f"{case}/k{num_steps}"
    _store(results, prefix, after, losses, mesh)
    checks[prefix] = {
        "spans_processes": _spans_processes(before),
        "sharding_changes": sharding_changes(before, after),
        "packing": packing(step.lower(p, o, *batches[-1]), before),
        "calls": end.calls - start.calls,
        "fast_path": end.fast_path - start.fast_path,
        "traces": end.traces - start.traces,
    }


def run_nnx(mesh: Mesh, num_steps: int, results: Results, checks: Checks) -> None:
    """`nnx_train_step` under autoflat: the caller's model and optimizer updated in place."""
    model, optimizer = init_state("nnx", mesh)
    before = jax.tree.leaves(nnx.state((model, optimizer)))
    step = make_step(nnx_train_step, num_steps)
    losses = []
    batches = feed("nnx", mesh, num_steps)
    for x, y in batches:
        losses.append(step(model, optimizer, x, y))
    after = jax.tree.leaves(nnx.state((model, optimizer)))
    prefix = f"nnx/k{num_steps}"
    _store(results, prefix, after, losses, mesh)
    checks[prefix] = {
        "spans_processes": _spans_processes(before),
        "sharding_changes": sharding_changes(before, after),
        "packing": packing(step.lower(model, optimizer, *batches[-1]), before),
        "optimizer_step": int(to_host([optimizer.step[...]], mesh)[0]),
    }


def run_resume(mesh: Mesh, directory: Path, results: Results, checks: Checks) -> None:
    """Save the `fsdp` state with orbax after the first chunk, restore it, continue; next to
    it, the uninterrupted run from the same handles.

    orbax is given `autoflat.unwrap(...)`: it pairs the tree it saves with a tree it derives
    from it by `jax.tree.map` (which holds the real types where the first holds handles), and
    JAX refuses to pair a `LazyHandle` node with a `dict` (see `autoflat._handles.lazy`)."""
    import orbax.checkpoint as ocp

    params, opt_state = init_state("resume", mesh)
    step = make_step(update, CHUNK)
    (x0, y0), (x1, y1) = feed("resume", mesh, CHUNK)
    p, o, loss0 = step(params, opt_state, x0, y0)
    handle_paths = [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path((p, o))[0]
    ]
    path = directory.resolve() / "after-4-steps"
    state = autoflat.unwrap({"params": p, "opt_state": o})  # every process: its own shards
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)  # shapes, dtypes, shardings
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, target)
        saved_names = sorted(
            leaf.name for leaf in jax.tree.leaves(checkpointer.metadata(path).item_metadata.tree)
        )
    before = jax.tree.leaves(state)
    restored_leaves = jax.tree.leaves(restored)
    checks["resume"] = {
        "handle_paths": handle_paths,
        "saved_names": saved_names,
        "restored_types": [type(restored["params"]).__name__, type(restored["opt_state"]).__name__],
        "restored_sharding_changes": sharding_changes(before, restored_leaves),
        "restored_equal": all(
            np.array_equal(a, b)
            for a, b in zip(to_host(before, mesh), to_host(restored_leaves, mesh), strict=True)
        ),
    }
    rp, ro, rloss = step(restored["params"], restored["opt_state"], x1, y1)
    p, o, loss1 = step(p, o, x1, y1)
    _store(results, "resume/resumed", jax.tree.leaves((rp, ro)), [loss0, rloss], mesh)
    _store(results, "resume/unbroken", jax.tree.leaves((p, o)), [loss0, loss1], mesh)


def run_chunks(mesh: Mesh, results: Results, checks: Checks) -> None:
    """`autoflat.chunks` from each process's half of every batch: the global chunks it builds
    against those built by hand, then the `dp` training fed by it."""
    xs, ys = global_data()
    sharding = NamedSharding(mesh, P("data"))  # one step's batch
    local = [(local_part(xs[i], sharding), local_part(ys[i], sharding)) for i in range(STEPS)]
    built = list(autoflat.chunks(local, CHUNK, sharding=sharding))
    by_hand = feed("chunks", mesh, CHUNK)
    differences = []
    for n, (got, want) in enumerate(zip(built, by_hand, strict=True)):
        got_values, want_values = to_host(got, mesh), to_host(want, mesh)
        for name, g, w, gv, wv in zip(("x", "y"), got, want, got_values, want_values, strict=True):
            if g.shape != w.shape or not g.sharding.is_equivalent_to(w.sharding, w.ndim):
                differences.append(f"chunk {n} {name}: {g.shape} {g.sharding} != {w.sharding}")
            elif not np.array_equal(gv, wv):
                differences.append(f"chunk {n} {name}: values differ")
    params, opt_state = init_state("chunks", mesh)
    step = make_step(update, CHUNK)
    p, o = params, opt_state
    losses = []
    for x, y in autoflat.chunks(local, CHUNK, sharding=sharding):
        p, o, loss = step(p, o, x, y)
        losses.append(loss)
    _store(results, "chunks", jax.tree.leaves((p, o)), losses, mesh)
    checks["chunks"] = {
        "n_chunks": len(built),
        "chunk_shapes": [list(c[0].shape) for c in built],
        "differences": differences,
    }


def run(cases: Iterable[str], directory: Path) -> tuple[Results, Checks]:
    devices = jax.devices()
    results: Results = {}
    checks: Checks = {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
    }
    seconds = checks["seconds"] = {}  # per case: (wall, this process's CPU time)
    for case in cases:
        t0, c0 = time.perf_counter(), time.process_time()
        mesh = mesh_for(case, devices)
        if case in ("dp", "fsdp"):
            for k in (1, CHUNK):
                run_functional(case, mesh, k, results, checks)
        elif case == "nnx":
            for k in (1, CHUNK):
                run_nnx(mesh, k, results, checks)
        elif case == "resume":
            run_resume(mesh, directory, results, checks)
        elif case == "chunks":
            run_chunks(mesh, results, checks)
        else:
            raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")
        seconds[case] = (round(time.perf_counter() - t0, 2), round(time.process_time() - c0, 2))
    return results, checks


# --- the process -------------------------------------------------------------------------------
def gloo_unavailable() -> str | None:
    """Why this JAX cannot run CPU collectives across processes with gloo, or None."""
    try:
        from jax._src import lib
    except ImportError as e:  # pragma: no cover - a JAX without it
        return f"cannot inspect jaxlib ({e})"
    ext = getattr(lib, "_jax", None) or getattr(lib, "xla_extension", None)
    if ext is None or not hasattr(ext, "make_gloo_tcp_collectives"):
        return f"jaxlib {jax.__version__} has no gloo CPU collectives"
    if "jax_cpu_collectives_implementation" not in jax.config.values:
        return f"JAX {jax.__version__} has no jax_cpu_collectives_implementation option"
    return None


def initialize(port: int, num_processes: int, process_id: int, timeout: int) -> None:
    """JAX's distributed runtime on this machine, with gloo CPU collectives; no cluster
    auto-detection (a SLURM or MPI environment around the tests must not change them)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {
        "coordinator_address": f"127.0.0.1:{port}",
        "num_processes": num_processes,
        "process_id": process_id,
        "initialization_timeout": timeout,
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    extra = {
        "cluster_detection_method": "deactivate",
        "heartbeat_timeout_seconds": timeout,
        "shutdown_timeout_seconds": timeout,
    }
    kwargs.update({k: v for k, v in extra.items() if k in accepted})
    jax.distributed.initialize(**kwargs)


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=int, default=60, help="distributed init timeout (s)")
    parser.add_argument(
        "--die-after-init", action="store_true", help="exit at once after joining (tests)"
    )
    args = parser.parse_args(argv)
    reason = gloo_unavailable()
    if reason is not None:
        print(f"SKIP: {reason}", file=sys.stderr)
        return 77
    t0 = time.perf_counter()
    initialize(args.port, args.num_processes, args.process_id, args.timeout)
    initialized = time.perf_counter() - t0
    if args.die_after_init:
        # as a crash would: no distributed shutdown, the others left waiting for this one
        print(f"process {args.process_id}: dying after initialize, as asked", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)
    results, checks = run([c for c in args.cases.split(",") if c], args.out)
    checks["seconds"]["initialize"] = round(initialized, 2)
    np.savez(args.out / f"result-{args.process_id}.npz", **results)
    (args.out / f"result-{args.process_id}.json").write_text(json.dumps(checks, indent=1))
    log(f"process {args.process_id}: {len(results)} arrays written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
