"""Flat, packed and automatic transport of state, side by side in one process.

    python benchmarks/bench_transport.py [--quick] [--json PATH] [--models abc] [--repeats N]
    python benchmarks/bench_transport.py --sweep   # the leaf-size sweep behind pack="auto"

For three models, each trained with optax.adam by `@autoflat.step(num_steps=k, pack=...)`
for k in 1 and 10 and pack in False (one buffer per leaf), True (every small-enough-to-pack
leaf packed per dtype) and "auto" (only leaves of at most AUTO_MAX_ELEMENTS elements):

a. the narrow ResNet50-structured Equinox model of `models.py` (161 arrays, 484 with Adam);
b. a small MLP with ~300 tiny leaves (50 layers of 4x4 weights and biases, with Adam);
c. a full-width MLP of 8.5M parameters (two 2048x2048 layers and small in/out layers; 2.2M
   at width 1024 with --quick).

Reported per (model, k, pack): the host time per call (the time spent inside the Python
call of the step, i.e. until JAX has dispatched it: argument handling, the executable's
launch and the creation of its output buffers), the median time per step over repeats
(calls back to back, one `block_until_ready` at the end of each timed block, so host work
and device work overlap as in training: the end-to-end figure), spreads, ratios against
pack=False, and the number of buffers per call. "host CPU" is the CPU time the calling thread
spends in the call (`time.thread_time`): on a CPU backend the program starts running on the
same cores as soon as it is launched, so the wall time of the rest of the call includes time
the calling thread waits for a core. "bare program" is the host time per call of
the step's own compiled program called directly with its buffers, the same way: the runtime's
cost of launching that program with that many buffers, the floor for that transport. The
step's host time minus it is autoflat's own work plus freeing the previous call's arrays,
which the step's timing includes (the caller rebinds its handles in the timed statement)
and the bare timing does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402

import autoflat  # noqa: E402
from autoflat import _transport  # noqa: E402

tx = optax.adam(1e-3)


def resnet_case(quick: bool) -> tuple[Any, Any, Any]:
    model = models.make_model(jax.random.key(0), width=2)
    batch = models.make_batch(jax.random.key(1), 4, image_size=16)
    return model, batch, models.loss_fn


def mlp_params(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(params: list[dict[str, jax.Array]], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    x = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((x - y) ** 2)


def tiny_mlp_case(quick: bool) -> tuple[Any, Any, Any]:
    params = mlp_params(jax.random.key(0), [4] * 51)
    batch = (jnp.ones((8, 4)), jnp.zeros((8, 4)))
    return params, batch, mlp_loss


def wide_mlp_case(quick: bool) -> tuple[Any, Any, Any]:
    width = 1024 if quick else 2048
    params = mlp_params(jax.random.key(0), [64, width, width, width, 10])
    batch = (jnp.ones((32, 64)), jnp.zeros((32, 10)))
    return params, batch, mlp_loss


def make_update(loss_fn: Any) -> Any:
    def update(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return update


def run_case(name: str, case: Any, quick: bool, repeats: int) -> list[dict[str, Any]]:
    model, batch, loss_fn = case(quick)
    update = make_update(loss_fn)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    n_arrays = len(jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array)))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    rows = []
    results: dict[tuple[int, Any], Any] = {}
    for k in (1, 10):
        batches = jax.tree.map(lambda x, k=k: jnp.stack([x] * k), batch) if k > 1 else batch
        steps = {}
        for pack in (False, True, "auto"):
            step = autoflat.step(update, num_steps=k, pack=pack)
            state = step(model, opt_state, batches)  # compile
            state = step(*state[:2], batches)
            jax.block_until_ready(state[2])
            steps[pack] = [step, state]
            results[(k, pack)] = state[2]
        # calls per block: about 0.5 s
        t0 = time.perf_counter()
        s = steps[False]
        for _ in range(3):
            s[1] = s[0](*s[1][:2], batches)
        jax.block_until_ready(s[1][2])
        per_call = (time.perf_counter() - t0) / 3
        n_calls = max(3, min(2000, int((0.15 if quick else 0.5) / max(per_call, 1e-6))))
        times: dict[Any, list[float]] = {p: [] for p in steps}
        host: dict[Any, list[float]] = {p: [] for p in steps}
        bare_host: dict[Any, list[float]] = {p: [] for p in steps}
        host_cpu: dict[Any, list[float]] = {p: [] for p in steps}
        bare = {p: _bare_program(steps[p][0], steps[p][1], batches) for p in steps}
        clock = time.perf_counter
        cpu_clock = time.thread_time
        for r in range(repeats):
            order = list(steps)[r % 3 :] + list(steps)[: r % 3]
            for pack in order:
                st = steps[pack]
                t0 = clock()
                for _ in range(n_calls):
                    st[1] = st[0](*st[1][:2], batches)
                jax.block_until_ready(st[1][2])
                times[pack].append((clock() - t0) / n_calls / k)
                # Host time of a call: the device idle when it starts, so the call returns
                # as soon as it has dispatched (no back-pressure from earlier calls).
                in_calls = 0.0
                cpu_in_calls = 0.0
                n_host = max(3, n_calls // 4)
                for _ in range(n_host):
                    # block on the raw buffers: blocking on a packed handle would unpack it
                    jax.block_until_ready([h._af_arrays for h in st[1][:2]])
                    c0 = clock()
                    t0 = cpu_clock()
                    st[1] = st[0](*st[1][:2], batches)
                    cpu_in_calls += cpu_clock() - t0
                    in_calls += clock() - c0
                jax.block_until_ready(st[1])
                host[pack].append(in_calls / n_host)
                host_cpu[pack].append(cpu_in_calls / n_host)
                bare_host[pack].append(_bare_call_time(bare[pack], n_host, clock))
        base = float(np.median(times[False]))
        for pack in steps:
            handle = steps[pack][1][0]
            layout = handle._af_layout if autoflat.is_handle(handle) else None
            opt_layout = steps[pack][1][1]._af_layout
            buffers = sum(
                (lay.n_buffers if lay is not None else len(h._af_arrays))
                for lay, h in ((layout, steps[pack][1][0]), (opt_layout, steps[pack][1][1]))
            )
            med = float(np.median(times[pack]))
            rows.append(
                {
                    "model": name,
                    "arrays": n_arrays,
                    "params": int(n_params),
                    "num_steps": k,
                    "pack": str(pack),
                    "buffers": buffers,
                    "us_per_step": med * 1e6,
                    "min": min(times[pack]) * 1e6,
                    "max": max(times[pack]) * 1e6,
                    "vs_flat": med / base,
                    "host_us_per_call": float(np.median(host[pack])) * 1e6,
                    "host_vs_flat": float(np.median(host[pack])) / float(np.median(host[False])),
                    "bare_us_per_call": float(np.median(bare_host[pack])) * 1e6,
                    "host_cpu_us_per_call": float(np.median(host_cpu[pack])) * 1e6,
                    "host_cpu_vs_flat": float(np.median(host_cpu[pack]))
                    / float(np.median(host_cpu[False])),
                    "repeats_us": [t * 1e6 for t in times[pack]],
                }
            )
    return rows


def _bare_program(step: Any, state: Any, batches: Any) -> list[Any]:
    """The step's own compiled program, to be called without autoflat: its executable and a
    fresh copy of the buffers it takes (see `_bare_call_time`)."""
    (spec,) = step._specs.values()
    buffers = tuple([jnp.copy(b) for b in h._af_arrays] for h in state[:2])
    compiled = step._jit.lower(spec, buffers, (batches,), ()).compile()
    return [compiled, buffers, (batches,)]


def _bare_call_time(bare: list[Any], n: int, clock: Any) -> float:
    """Host time of a call of the compiled program itself, the device idle at its start as
    for the step's: the runtime's own cost of launching it with these buffers. The previous
    buffers are freed outside the timed call (see the module docstring)."""
    compiled, buffers, xs = bare
    total = 0.0
    for _ in range(n):
        jax.block_until_ready(buffers)
        c0 = clock()
        state_out, _ = compiled(buffers, xs, ())
        total += clock() - c0
        buffers = tuple(f.arrays for f in state_out)
    jax.block_until_ready(buffers)
    bare[1] = buffers
    return total / n


def sweep_case(size: int, n_leaves: int = 48) -> tuple[Any, Any, Any]:
    """`n_leaves` weight-like leaves of `size` elements each (plus Adam): the leaf size at
    which packing stops paying sets pack="auto"'s threshold."""
    keys = jax.random.split(jax.random.key(0), n_leaves)
    params = [jax.random.normal(k, (size,)) * 0.01 for k in keys]
    x = jnp.ones((8, size))

    def loss(params: list[jax.Array], batch: jax.Array) -> jax.Array:
        return sum(jnp.mean(jnp.tanh(batch * p)) for p in params)  # type: ignore[return-value]

    return params, x, loss


def run_sweep(sizes: list[int], repeats: int, quick: bool) -> list[dict[str, Any]]:
    """End-to-end time per step at num_steps=1, pack=False against pack=True, per leaf size."""
    rows = []
    for size in sizes:
        params, batch, loss_fn = sweep_case(size)
        update = make_update(loss_fn)
        opt_state = tx.init(params)
        steps = {}
        for pack in (False, True):
            step = autoflat.step(update, num_steps=1, pack=pack)
            state = step(params, opt_state, batch)
            state = step(*state[:2], batch)
            jax.block_until_ready(state[2])
            steps[pack] = [step, state]
        s = steps[False]
        t0 = time.perf_counter()
        for _ in range(3):
            s[1] = s[0](*s[1][:2], batch)
        jax.block_until_ready(s[1][2])
        per_call = (time.perf_counter() - t0) / 3
        n_calls = max(3, min(2000, int((0.15 if quick else 0.4) / max(per_call, 1e-6))))
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(repeats):
            for pack in (False, True) if r % 2 == 0 else (True, False):
                st = steps[pack]
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    st[1] = st[0](*st[1][:2], batch)
                jax.block_until_ready(st[1][2])
                times[pack].append((time.perf_counter() - t0) / n_calls)
        flat, packed = (float(np.median(times[p])) for p in (False, True))
        rows.append(
            {
                "leaf_elements": size,
                "leaves": 48 * 3,
                "flat_us": flat * 1e6,
                "packed_us": packed * 1e6,
                "packed_vs_flat": packed / flat,
            }
        )
        print(
            f"  leaves of {size:>7,} elements: flat {flat * 1e6:8.0f} µs, "
            f"packed {packed * 1e6:8.0f} µs, packed × flat {packed / flat:.2f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--models", default="abc", help="which of the models a, b, c to run (default: all)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="only the leaf-size sweep behind pack='auto''s threshold",
    )
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, backend {jax.default_backend()}"
        f" ({jax.devices()[0].device_kind})"
    )
    print(
        f"versions: python {platform.python_version()}, jax {jax.__version__}, "
        f"equinox {eqx.__version__}, optax {optax.__version__}, autoflat {autoflat.__version__}"
    )
    print(f"pack='auto' packs leaves of at most {_transport.AUTO_MAX_ELEMENTS} elements")
    if args.sweep:
        sizes = [128, 256, 512, 1_024, 2_048, 4_096, 16_384]
        print("leaf-size sweep: 48 leaves of each size with Adam (144 arrays), num_steps=1")
        sweep = run_sweep(sizes, repeats, args.quick)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(sweep, f, indent=1)
        return
    rows = []
    for name, case in (
        ("a. narrow ResNet50 + adam", resnet_case),
        ("b. tiny MLP (~300 leaves) + adam", tiny_mlp_case),
        ("c. wide MLP + adam", wide_mlp_case),
    ):
        if name[0] not in args.models:
            continue
        print(f"running {name} ...", flush=True)
        rows += run_case(name, case, args.quick, repeats)
    print()
    print(
        "| model | params | arrays | num_steps | pack | buffers | host µs/call | host × flat "
        "| host CPU µs/call | CPU × flat | bare program µs/call | µs/step (median) | spread "
        "| step × flat |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params']:,} | {r['arrays']} | {r['num_steps']} | {r['pack']} | "
            f"{r['buffers']} | "
            f"{r['host_us_per_call']:,.0f} | {r['host_vs_flat']:.2f} | "
            f"{r['host_cpu_us_per_call']:,.0f} | {r['host_cpu_vs_flat']:.2f} | "
            f"{r['bare_us_per_call']:,.0f} | "
            f"{r['us_per_step']:,.0f} | {r['min']:,.0f}–{r['max']:,.0f} | {r['vs_flat']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
