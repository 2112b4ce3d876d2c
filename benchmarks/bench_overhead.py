"""Per-step host overhead of a whole training step, five ways, side by side in one process.

    python benchmarks/bench_overhead.py [--quick] [--json PATH]

The model is `models.NarrowResNet50`: ResNet50's exact layer structure (161 parameter
arrays) with channels so narrow that the compute is tiny, so what is left is the per-call
host work. The step is the usual Equinox one with `optax.adam`:

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = optimizer.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss

and every method below runs exactly that function (`update`), from the same initial state.

Methods (rows of the table):

a.  `jax.jit`: plain `jax.jit` cannot take the model as it is, since the model holds
    `jax.nn.relu` as a field (a non-array leaf). The honest plain-jit version is therefore
    the usual one: `params, static = eqx.partition(model, eqx.is_array)` once, outside the
    loop, and `jax.jit` of a function that does `eqx.combine(params, static)` inside (the
    static half is closed over). The loop is `params, opt_state, loss = f(params, opt_state,
    batch)`: JAX flattens `params` (the same tree, with `None` for the 16 activations) and
    `opt_state` on every call. No donation, as `jax.jit`'s default.
a'. the same with `donate_argnums=(0, 1)`, to separate the effect of donation.
b.  `eqx.filter_jit(update)`, called with the model itself. No donation (its default).
c.  the hand-written flat-leaves recipe: `leaves, treedef = tree_flatten((model,
    opt_state))` once, the array leaves kept in a list and the non-array leaves (the
    activations) closed over with the treedef; a `jax.jit` function with
    `donate_argnums=0` unflattens inside, runs `update`, and returns the new array-leaf list.
    The loop passes leaf lists only.
d.  `autoflat.step(num_steps=1)(update)` (donates its own outputs), handles passed back in.
e.  `autoflat.step(num_steps=10)(update)`, batch with a leading axis of 10; its per-step
    time is the per-call time / 10.

Method: before any timing, every method runs the same 10 steps on the same 10 distinct
batches from the same initial state, and the per-step losses and final parameters are
asserted to agree (this also compiles everything): one-step methods with plain `jax.jit`,
autoflat's `num_steps=10` with a hand-written `lax.scan` of the same step (a loop and a scan
are different XLA programs; this narrow model amplifies their rounding differences over a
few steps, so those two are compared on the first loss only, and the rest is reported).
Then each method is warmed up and its number of calls per timed block N chosen so a block
takes about `--block-seconds`. Blocks are run round-robin over the methods (the order
rotating), `--repeats` times, so slow drifts of the machine hit all methods alike, with a
`gc.collect()` before each block. Within a block the calls are back to back;
`jax.block_until_ready` is called once, at the end of the block. Reported: the median
per-step time over the repeats and its spread (min-max).

Device compute per step is estimated by a `jax.jit`-ed `lax.scan` of `--compute-steps`
steps of the same step on flat leaves (donated), per call / steps: the host cost of one call
is then shared by that many steps. "Overhead" is step time minus that compute. It is an
estimate: the scan body is compiled as a loop, which can differ a little from the one-step
program, and where dispatch is asynchronous host work and compute can overlap, so
step = host + compute is only an upper-bound model. The time the loop takes before the final
`block_until_ready` (host time per call, when dispatch is asynchronous) is recorded in the
JSON as `dispatch_us_per_step`.

Ratios are of per-step time (not of overhead): "x hand-written" is a method's step time
over method c's, "x filter_jit" over method b's. The last column is per call (= per step
times steps per call).

Defaults: width 2, batch 8, 16x16 images (the compute per step is then a few hundred µs on
a small CPU; `--image-size 32` quadruples it). XLA's CPU thread pool is left at its defaults,
so on a machine with few cores the compute of one call and the host work of the next compete
for the same cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
try:
    import autoflat
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(_HERE.parent))
    import autoflat

from models import count_leaves, loss_fn, make_batch, make_model  # noqa: E402

optimizer = optax.adam(1e-3)


def update(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = optimizer.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def _copy(tree: Any) -> Any:
    """Fresh buffers for every array leaf (so a donating method never consumes another's)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def _params(tree: Any) -> list[np.ndarray]:
    """Host copies of the array leaves (copies: the buffers may be donated later)."""
    return [np.array(x, copy=True) for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]


class Method:
    """One way of running the step. Holds its own state between blocks."""

    def __init__(self, key: str, name: str, steps_per_call: int):
        self.key = key
        self.name = name
        self.steps_per_call = steps_per_call
        self.n_calls = 0
        self.totals: list[float] = []  # seconds per step, one per repeat
        self.dispatch: list[float] = []

    # Subclasses define start(model, opt_state); check(batches) -> (losses, final model or
    # its parameter arrays); run(n) -> (seconds before the final block_until_ready, in all).
    def start(self, model: Any, opt_state: Any) -> None:
        raise NotImplementedError

    def check(self, batches: list[Any]) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    def run(self, n: int) -> tuple[float, float]:
        raise NotImplementedError


class PlainJit(Method):
    def __init__(self, key: str, name: str, batch: Any, donate: bool):
        super().__init__(key, name, 1)
        self.batch = batch
        self.donate = donate

    def start(self, model: Any, opt_state: Any) -> None:
        params, static = eqx.partition(model, eqx.is_array)

        def step(params, opt_state, batch):
            model = eqx.combine(params, static)
            model, opt_state, loss = update(model, opt_state, batch)
            return eqx.filter(model, eqx.is_array), opt_state, loss

        self.static = static
        self.fn = jax.jit(step, donate_argnums=(0, 1) if self.donate else ())
        self.state = _copy((params, opt_state))

    def check(self, batches: list[Any]) -> tuple[np.ndarray, Any]:
        p, o = self.state
        losses = []
        for b in batches:
            p, o, loss = self.fn(p, o, b)
            losses.append(loss)
        self.state = (p, o)
        return np.asarray(jnp.stack(losses)), eqx.combine(p, self.static)

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        p, o = self.state
        t0 = time.perf_counter()
        for _ in range(n):
            p, o, loss = f(p, o, batch)
        t1 = time.perf_counter()
        jax.block_until_ready((p, o, loss))
        t2 = time.perf_counter()
        self.state = (p, o)
        return t1 - t0, t2 - t0


class FilterJit(Method):
    def __init__(self, key: str, name: str, batch: Any):
        super().__init__(key, name, 1)
        self.batch = batch
        self.fn = eqx.filter_jit(update)

    def start(self, model: Any, opt_state: Any) -> None:
        self.state = (model, opt_state)  # never donated: no copy needed

    def check(self, batches: list[Any]) -> tuple[np.ndarray, Any]:
        m, o = self.state
        losses = []
        for b in batches:
            m, o, loss = self.fn(m, o, b)
            losses.append(loss)
        self.state = (m, o)
        return np.asarray(jnp.stack(losses)), m

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        m, o = self.state
        t0 = time.perf_counter()
        for _ in range(n):
            m, o, loss = f(m, o, batch)
        t1 = time.perf_counter()
        jax.block_until_ready((m, o, loss))
        t2 = time.perf_counter()
        self.state = (m, o)
        return t1 - t0, t2 - t0


class FlatRecipe:
    """The hand-written recipe's pieces: flatten once, array leaves travel, the rest closes."""

    def __init__(self, model: Any, opt_state: Any):
        leaves, treedef = jax.tree_util.tree_flatten((model, opt_state))
        self.treedef = treedef
        self.array_pos = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
        self.static_leaves = [None if eqx.is_array(x) else x for x in leaves]
        self.arrays = [jnp.array(leaves[i], copy=True) for i in self.array_pos]

    def rebuild(self, arrays: list[Any]) -> tuple[Any, Any]:
        full = list(self.static_leaves)
        for i, a in zip(self.array_pos, arrays, strict=True):
            full[i] = a
        return jax.tree_util.tree_unflatten(self.treedef, full)

    def body(self, arrays: list[Any], batch: Any) -> tuple[list[Any], Any]:
        model, opt_state = self.rebuild(arrays)
        model, opt_state, loss = update(model, opt_state, batch)
        new = jax.tree_util.tree_leaves((model, opt_state))
        return [new[i] for i in self.array_pos], loss


class HandFlat(Method):
    def __init__(self, key: str, name: str, batch: Any):
        super().__init__(key, name, 1)
        self.batch = batch

    def start(self, model: Any, opt_state: Any) -> None:
        self.recipe = FlatRecipe(model, opt_state)
        self.fn = jax.jit(self.recipe.body, donate_argnums=0)
        self.state = self.recipe.arrays

    def check(self, batches: list[Any]) -> tuple[np.ndarray, Any]:
        leaves = self.state
        losses = []
        for b in batches:
            leaves, loss = self.fn(leaves, b)
            losses.append(loss)
        self.state = leaves
        return np.asarray(jnp.stack(losses)), self.recipe.rebuild(leaves)[0]

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        leaves = self.state
        t0 = time.perf_counter()
        for _ in range(n):
            leaves, loss = f(leaves, batch)
        t1 = time.perf_counter()
        jax.block_until_ready((leaves, loss))
        t2 = time.perf_counter()
        self.state = leaves
        return t1 - t0, t2 - t0


class Autoflat(Method):
    def __init__(self, key: str, name: str, batch: Any, num_steps: int):
        super().__init__(key, name, num_steps)
        self.batch = batch
        self.fn = autoflat.step(num_steps=num_steps)(update)

    def start(self, model: Any, opt_state: Any) -> None:
        self.state = (model, opt_state)  # autoflat copies the caller's arrays before donating

    def check(self, batches: list[Any]) -> tuple[np.ndarray, Any]:
        m, o = self.state
        k = self.steps_per_call
        losses = []
        for i in range(0, len(batches), k):
            chunk = batches[i : i + k]
            b = chunk[0] if k == 1 else jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *chunk)
            m, o, loss = self.fn(m, o, b)
            losses.append(jnp.reshape(loss, (-1,)))
        self.state = (m, o)
        # A copy of the parameters, so the handle itself stays unbuilt (the fast path).
        return np.asarray(jnp.concatenate(losses)), _params(m)

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        m, o = self.state
        t0 = time.perf_counter()
        for _ in range(n):
            m, o, loss = f(m, o, batch)
        t1 = time.perf_counter()
        jax.block_until_ready((m, o, loss))
        t2 = time.perf_counter()
        self.state = (m, o)
        return t1 - t0, t2 - t0


class ComputeScan(Method):
    """Device compute estimate: `compute_steps` steps in one jitted `lax.scan` on flat leaves."""

    def __init__(self, key: str, name: str, batch: Any, steps: int):
        super().__init__(key, name, steps)
        self.batch = jax.tree_util.tree_map(lambda x: jnp.stack([x] * steps), batch)

    def start(self, model: Any, opt_state: Any) -> None:
        recipe = FlatRecipe(model, opt_state)

        def scan(arrays, batches):
            return jax.lax.scan(recipe.body, arrays, batches)

        self.recipe = recipe
        self.fn = jax.jit(scan, donate_argnums=0)
        self.state = recipe.arrays

    def check(self, batches: list[Any]) -> tuple[np.ndarray, Any]:
        """The hand-written `lax.scan` over these batches: the reference for scanned methods."""
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *batches)
        leaves, losses = self.fn(self.state, stacked)
        self.state = leaves
        return np.asarray(losses), _params(self.recipe.rebuild(leaves)[0])

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        leaves = self.state
        t0 = time.perf_counter()
        for _ in range(n):
            leaves, losses = f(leaves, batch)
        t1 = time.perf_counter()
        jax.block_until_ready((leaves, losses))
        t2 = time.perf_counter()
        if not np.all(np.isfinite(np.asarray(losses))):
            raise AssertionError("the compute scan produced non-finite losses")
        self.state = leaves
        return t1 - t0, t2 - t0


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "equinox", "optax", "autoflat"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = getattr(sys.modules.get(pkg), "__version__", "?")
    return out


def _machine() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
        "n_devices": jax.device_count(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _fmt(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short blocks, fewer repeats")
    ap.add_argument("--json", metavar="PATH", help="write the raw figures here")
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=None, help="timed blocks per method")
    ap.add_argument("--block-seconds", type=float, default=None, help="target seconds a block")
    ap.add_argument("--compute-steps", type=int, default=100)
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    block_s = args.block_seconds or (0.3 if args.quick else 1.0)

    t_start = time.perf_counter()
    key = jax.random.PRNGKey(0)
    k_model, k_batch, k_check = jax.random.split(key, 3)
    model = make_model(k_model, width=args.width)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    batch = make_batch(k_batch, args.batch_size, args.image_size)
    batch10 = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 10), batch)
    check_batches = [
        make_batch(k, args.batch_size, args.image_size) for k in jax.random.split(k_check, 10)
    ]

    model_counts = count_leaves(model)
    state_counts = count_leaves((model, opt_state))
    machine, versions = _machine(), _versions()
    print("# autoflat overhead benchmark: NarrowResNet50 + optax.adam")
    print(
        f"machine: {machine['platform']} ({machine['processor']}), {machine['cpu_count']} CPUs, "
        f"JAX backend {machine['jax_backend']} ({machine['device']} x{machine['n_devices']})"
        + (
            f", load average {machine['load_average_at_start'][0]:.2f} at start"
            if machine["load_average_at_start"]
            else ""
        )
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(
        f"model: width {args.width}, batch {args.batch_size}x3x{args.image_size}x"
        f"{args.image_size}; model leaves: {model_counts['arrays']} arrays + "
        f"{model_counts['static']} non-array (activations) = {model_counts['leaves']}; "
        f"(model, adam state): {state_counts['arrays']} arrays + {state_counts['static']} "
        f"non-array"
    )
    quick = " (--quick)" if args.quick else ""
    print(f"timing: {repeats} repeats of ~{block_s} s blocks, round-robin{quick}")
    sys.stdout.flush()

    methods: list[Method] = [
        PlainJit("jit", "a. jax.jit (partition outside)", batch, donate=False),
        PlainJit("jit_donate", "a'. jax.jit + donate_argnums", batch, donate=True),
        FilterJit("filter_jit", "b. eqx.filter_jit", batch),
        HandFlat("hand_flat", "c. hand-written flat leaves", batch),
        Autoflat("autoflat_1", "d. autoflat num_steps=1", batch, 1),
        Autoflat("autoflat_10", "e. autoflat num_steps=10", batch10, 10),
    ]
    compute = ComputeScan(
        "compute",
        f"device compute (scan of {args.compute_steps}, flat leaves)",
        batch,
        args.compute_steps,
    )

    # --- agreement: the same 10 steps from the same state (this also compiles everything) ----
    # References: method a for one step per call, and a hand-written `lax.scan` of the same
    # step on flat leaves for methods that scan. A loop and a scan are different XLA programs
    # (fused differently), and this narrow model amplifies rounding differences over a few
    # steps (per-channel normalisation of 1-2 channels over few values, and adam's early
    # updates of about lr * sign(grad) even for gradients at rounding level), so loop and scan
    # are only compared on the first loss; each method is compared strictly with the
    # reference of its own kind.
    def diffs(losses: np.ndarray, params: list[np.ndarray], ref: Any) -> dict[str, float]:
        ref_losses, ref_params = ref
        assert len(params) == len(ref_params)
        return {
            "max_rel_loss_diff": float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses))),
            "max_rel_param_diff": max(
                float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                for a, b in zip(params, ref_params, strict=True)
            ),
        }

    compile_s: dict[str, float] = {}
    results: dict[str, tuple[np.ndarray, list[np.ndarray]]] = {}
    for m in [*methods, compute]:
        m.start(model, opt_state)
        t0 = time.perf_counter()
        losses, final = m.check(check_batches)
        compile_s[m.key] = time.perf_counter() - t0
        results[m.key] = (losses, final if isinstance(final, list) else _params(final))
    t0 = time.perf_counter()
    compute.run(1)
    compile_s[compute.key] += time.perf_counter() - t0

    loop_ref, scan_ref = results["jit"], results["compute"]
    agreement: dict[str, dict[str, Any]] = {}
    tol = 1e-5
    for m in methods[1:]:
        ref_key = "jit" if m.steps_per_call == 1 else "compute"
        d = diffs(*results[m.key], results[ref_key])
        agreement[m.key] = {"reference": ref_key, **d}
        if d["max_rel_loss_diff"] > tol or d["max_rel_param_diff"] > tol:
            raise AssertionError(
                f"{m.name} disagrees with its reference ({ref_key}): max relative difference "
                f"{d['max_rel_loss_diff']:.2e} in the losses, {d['max_rel_param_diff']:.2e} in "
                f"the parameters (tol {tol})"
            )
    loop_vs_scan = diffs(*scan_ref, loop_ref)
    first = abs(scan_ref[0][0] - loop_ref[0][0]) / abs(loop_ref[0][0])
    agreement["scan_vs_loop"] = {"first_loss_rel_diff": float(first), **loop_vs_scan}
    if first > 1e-4:
        raise AssertionError(f"scan and loop disagree on the first loss: {first:.2e}")
    print(
        "agreement over 10 steps, max relative difference (losses / parameters): "
        + ", ".join(
            f"{k} {v['max_rel_loss_diff']:.1e} / {v['max_rel_param_diff']:.1e}"
            for k, v in agreement.items()
            if k != "scan_vs_loop"
        )
        + " (one-step methods vs a. jax.jit, autoflat_10 vs a hand-written lax.scan); "
        f"scan vs loop: first loss {first:.1e}, after 10 steps "
        f"{loop_vs_scan['max_rel_loss_diff']:.1e} / {loop_vs_scan['max_rel_param_diff']:.1e} "
        "(rounding, amplified by the model)"
    )
    print(
        "first calls (compile + 10 steps), s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items())
        + " (compute: two lengths)"
    )
    sys.stdout.flush()

    # --- warm-up and calibration ---------------------------------------------------------------
    timed = [*methods, compute]
    for m in timed:
        m.run(3)
        probe = 2
        while True:
            _, total = m.run(probe)
            if total > 0.1 * block_s or probe >= 10_000:
                break
            probe *= 2
        # The fastest of three probes: a stray pause must not shrink the timed blocks.
        per_call = min(total, *(m.run(probe)[1] for _ in range(2))) / probe
        m.n_calls = max(2, round(block_s / per_call))
    afs = [m for m in methods if isinstance(m, Autoflat)]
    before = {m.key: autoflat.stats(m.fn) for m in afs}

    # --- timed blocks, round-robin -------------------------------------------------------------
    # The order rotates each repeat so no method always follows the same one, and a full
    # garbage collection before every block keeps one method's garbage out of the next's time.
    for rep in range(repeats):
        for m in timed[rep % len(timed) :] + timed[: rep % len(timed)]:
            gc.collect()
            dispatch, total = m.run(m.n_calls)
            steps = m.n_calls * m.steps_per_call
            m.dispatch.append(dispatch / steps)
            m.totals.append(total / steps)

    for m in afs:
        s, b = autoflat.stats(m.fn), before[m.key]
        calls = s.calls - b.calls
        if s.traces != b.traces or s.copies != b.copies or s.fast_path - b.fast_path != 2 * calls:
            raise AssertionError(f"{m.name} left the fast path during timing: {b} -> {s}")

    # --- report ------------------------------------------------------------------------------
    us = 1e6
    compute_us = statistics.median(compute.totals) * us
    med = {m.key: statistics.median(m.totals) * us for m in timed}
    hand_flat = next(m for m in timed if m.key == "hand_flat")
    rows: list[dict[str, Any]] = []
    for m in timed:
        step_us = med[m.key]
        rows.append(
            {
                "key": m.key,
                "method": m.name,
                "steps_per_call": m.steps_per_call,
                "calls_per_block": m.n_calls,
                "us_per_step_median": step_us,
                "us_per_step_min": min(m.totals) * us,
                "us_per_step_max": max(m.totals) * us,
                "us_per_step_all": [t * us for t in m.totals],
                "dispatch_us_per_step_median": statistics.median(m.dispatch) * us,
                "dispatch_us_per_step_all": [t * us for t in m.dispatch],
                "overhead_us_per_step": step_us - compute_us,
                "ratio_vs_hand_flat": step_us / med["hand_flat"],
                "ratio_vs_filter_jit": step_us / med["filter_jit"],
                "ratio_vs_hand_flat_of_minima": min(m.totals) / min(hand_flat.totals),
            }
        )

    print()
    print(
        "| method | µs/step (median) | spread (min–max) | overhead µs/step | × hand-written "
        "| × filter_jit | µs/call (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        is_compute = r["key"] == "compute"
        print(
            f"| {r['method']} | {_fmt(r['us_per_step_median'])} | "
            f"{_fmt(r['us_per_step_min'])}–{_fmt(r['us_per_step_max'])} | "
            f"{'(compute)' if is_compute else _fmt(r['overhead_us_per_step'])} | "
            f"{r['ratio_vs_hand_flat']:.2f} | {r['ratio_vs_filter_jit']:.2f} | "
            f"{_fmt(r['us_per_step_median'] * r['steps_per_call'])} |"
        )
    print()
    print(
        "calls per block: "
        + ", ".join(f"{m.key} {m.n_calls}" for m in timed)
        + f"; total run time {time.perf_counter() - t_start:.0f} s"
    )

    result = {
        "machine": machine,
        "versions": versions,
        "config": {
            "width": args.width,
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "repeats": repeats,
            "block_seconds": block_s,
            "compute_steps": args.compute_steps,
            "quick": args.quick,
        },
        "leaves": {"model": model_counts, "model_and_opt_state": state_counts},
        "first_call_seconds": compile_s,
        "agreement": agreement,
        "compute_us_per_step": compute_us,
        "rows": rows,
        "autoflat_stats": {m.key: str(autoflat.stats(m.fn)) for m in afs},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
