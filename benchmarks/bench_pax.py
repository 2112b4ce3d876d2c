"""PAX's "Improve performance" tutorial, measured, with autoflat side by side.

    python benchmarks/bench_pax.py [--quick] [--iterations N] [--json PATH]

Needs PAX (`pax3`, `opax`), which needs an older JAX: run it in the environment of
`nox -s pax` (jax 0.4.35). The model and optimizer are the tutorial's: `pax.nets.ResNet50(3,
10)` and `opax.adam(1e-4)`, on one 3x64x64 image per step (`--batch-size`, `--image-size`).

Part 1, the tutorial's own measurement: `--iterations` (default 10,000 as in the tutorial;
200 with `--quick`) rounds of `tree_flatten` + `tree_unflatten` of

1. `(net, optimizer)`, the naive state;
2. `(net, optimizer)` with `opax.adam(1e-4)(net.parameters(), flatten=True)`;
3. that optimizer alone;
4. `(net_leaves, optimizer)`: the model held as its leaf list ("Flatten model");
5. `pax.experimental.Flattener(model=net, optimizer=optimizer)`.

Each is timed `--repeats` times; the median is reported, and the seconds per 10,000
iterations (the tutorial's unit). This is the host work a `jax.jit` call does on its state
arguments every step.

Part 2, per-step time of a whole training step, each method running the tutorial's `update`
unchanged (rows of the table):

a. `jax.jit(update)` (the tutorial's `@jax.jit`), naive `opax.adam`;
b. the same with the optimizer's `flatten=True`;
c. the tutorial's `multistep_update`: `pax.scan` of `update`, num_steps=10, in `jax.jit`
   (optimizer `flatten=True`, as at that point of the tutorial);
d. the tutorial's `pax.experimental.Flattener` recipe (`flat_update_wrapper`), optimizer
   `flatten=True`;
e. `autoflat.step(update, num_steps=1)`, naive `opax.adam`, handles passed back in;
e'. the same with `donate=False` (on jax 0.4.35's CPU backend a call that donates a buffer
   still being computed waits for it, so e dispatches synchronously; a-d do not donate);
f. `autoflat.step(update, num_steps=10)`, naive `opax.adam`, inputs with a leading axis of 10;
f'. the same with `donate=False`.

(The tutorial's hand-written `flatten_update` is not a row: as printed it calls
`loss_fn(params, model, inputs)`, a signature its `loss_fn` does not have. Part 1 row 4 times
its state; the `Flattener` row is the tutorial's packaged form of the same idea.)

Before timing, every method runs the same 10 steps on 10 distinct batches from the same
initial state (which also compiles it); the losses and final model (and optimizer) arrays
must agree to 1e-5 (relative to each array's largest value): e, e' with a, b with a (model), d
with b, f with c (model), f's first loss with a's. A loop and a scan are different XLA
programs, and Adam turns rounding differences in gradients near zero into steps of up to
about `lr`, so c against a is only reported.

Then the methods are timed in blocks of about `--block-seconds`, round-robin, `--repeats`
rounds, with `jax.block_until_ready` once per block. Reported: the median seconds per step
(spread min-max), the median host time per step before the final `block_until_ready`
(dispatch: with asynchronous dispatch, the host work of a call), and the ratio to a.
On XLA:CPU the convolutions of a step inside a `lax.scan` run slower than the same step
called in a loop, so c and f can be slower per step than a on a CPU; they are slowed alike.
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

import jax
import jax.numpy as jnp
import numpy as np

try:
    import opax
    import pax
    from pax.nets import ResNet50
except ImportError as e:  # pragma: no cover
    raise SystemExit(
        f"bench_pax needs PAX ({e}); run it where `nox -s pax` installs it (jax 0.4.35)."
    ) from None

_HERE = Path(__file__).resolve().parent
try:
    import autoflat
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(_HERE.parent))
    import autoflat

pax.seed_rng_key(42)

LR = 1e-4
NUM_STEPS = 10


# --- the tutorial's code, as written -------------------------------------------------------


def loss_fn(model: ResNet50, inputs):
    images, labels = inputs
    model, logits = pax.purecall(model, images)
    log_pr = jax.nn.log_softmax(logits, axis=-1)
    loss = jnp.mean(jnp.sum(jax.nn.one_hot(labels, num_classes=10) * log_pr, axis=-1))
    return loss, (loss, model)


@jax.jit
def update(model, optimizer, inputs):
    grads, (loss, model) = jax.grad(loss_fn, has_aux=True)(model, inputs)
    model, optimizer = opax.apply_gradients(model, optimizer, grads=grads)
    return model, optimizer, loss


@jax.jit
def multistep_update(model, optimizer, inputs):
    def _step(m_o, i):
        m, o, aux = update(*m_o, i)
        return (m, o), aux

    (model, optimizer), losses = pax.scan(_step, (model, optimizer), inputs)
    return model, optimizer, jnp.mean(losses)


@jax.jit
def flat_update_wrapper(flat_mods: pax.experimental.Flattener, inputs):
    model, optimizer = flat_mods.model, flat_mods.optimizer
    model, optimizer, loss = update(model, optimizer, inputs)
    return flat_mods.update(model=model, optimizer=optimizer), loss


# --- part 1: flatten + unflatten ------------------------------------------------------------


def _flatten_rounds(value: Any, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        a, b = jax.tree_util.tree_flatten(value)
        value = jax.tree_util.tree_unflatten(b, a)
    return time.perf_counter() - start


def part1(net: Any, iterations: int, repeats: int) -> list[dict[str, Any]]:
    optimizer = opax.adam(LR)(net.parameters())
    optimizer_flat = opax.adam(LR)(net.parameters(), flatten=True)
    net_leaves, _ = jax.tree_util.tree_flatten(net)
    cases = [
        ("1. (net, optimizer), naive", (net, optimizer)),
        ("2. (net, optimizer), optimizer flatten=True", (net, optimizer_flat)),
        ("3. optimizer flatten=True alone", optimizer_flat),
        ("4. (net_leaves, optimizer): model flattened", (net_leaves, optimizer_flat)),
        (
            "5. pax.experimental.Flattener(model, optimizer)",
            pax.experimental.Flattener(model=net, optimizer=optimizer_flat),
        ),
    ]
    rows = []
    for name, value in cases:
        _flatten_rounds(value, min(iterations, 20))  # warm-up
        times = []
        for _ in range(repeats):
            gc.collect()
            times.append(_flatten_rounds(value, iterations))
        leaves = len(jax.tree_util.tree_leaves(value))
        med = statistics.median(times)
        rows.append(
            {
                "case": name,
                "leaves": leaves,
                "seconds_median": med,
                "seconds_all": times,
                "us_per_iteration": med / iterations * 1e6,
                "seconds_per_10000": med / iterations * 10_000,
            }
        )
    return rows


# --- part 2: the training step --------------------------------------------------------------


def _copy(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


def _arrays(tree: Any) -> list[np.ndarray]:
    """Host copies of the array leaves (copies: autoflat may donate the buffers later)."""
    return [np.array(x, copy=True) for x in jax.tree_util.tree_leaves(tree)]


class Method:
    def __init__(self, key: str, name: str, steps_per_call: int, batch: Any):
        self.key = key
        self.name = name
        self.steps_per_call = steps_per_call
        self.batch = batch  # one call's input (stacked for multi-step methods)
        self.n_calls = 1
        self.totals: list[float] = []
        self.dispatch: list[float] = []

    def call(self, batch: Any) -> Any:
        """One call; returns the loss(es)."""
        raise NotImplementedError

    def final(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(model arrays, optimizer arrays)."""
        raise NotImplementedError

    def run(self, n: int) -> tuple[float, float]:
        call, batch = self.call, self.batch
        t0 = time.perf_counter()
        for _ in range(n):
            loss = call(batch)
        t1 = time.perf_counter()
        jax.block_until_ready((loss, self.state))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0


class Jit(Method):
    def __init__(self, key, name, batch, net, optimizer):
        super().__init__(key, name, 1, batch)
        self.state = _copy((net, optimizer))

    def call(self, batch):
        m, o = self.state
        m, o, loss = update(m, o, batch)
        self.state = (m, o)
        return loss

    def final(self):
        return _arrays(self.state[0]), _arrays(self.state[1])


class PaxScan(Method):
    def __init__(self, key, name, batch, net, optimizer):
        super().__init__(key, name, NUM_STEPS, batch)
        self.state = _copy((net, optimizer))

    def call(self, batch):
        m, o = self.state
        m, o, loss = multistep_update(m, o, batch)
        self.state = (m, o)
        return loss

    def final(self):
        return _arrays(self.state[0]), _arrays(self.state[1])


class FlattenerRecipe(Method):
    def __init__(self, key, name, batch, net, optimizer):
        super().__init__(key, name, 1, batch)
        net, optimizer = _copy((net, optimizer))
        self.state = pax.experimental.Flattener(model=net, optimizer=optimizer)

    def call(self, batch):
        self.state, loss = flat_update_wrapper(self.state, batch)
        return loss

    def final(self):
        return _arrays(self.state.model), _arrays(self.state.optimizer)


class Autoflat(Method):
    def __init__(self, key, name, batch, net, optimizer, num_steps, donate=True):
        super().__init__(key, name, num_steps, batch)
        self.fn = autoflat.step(update, num_steps=num_steps, donate=donate)
        self.state = (net, optimizer)  # autoflat copies the caller's arrays before donating

    def call(self, batch):
        m, o = self.state
        m, o, loss = self.fn(m, o, batch)
        self.state = (m, o)
        return loss

    def final(self):
        # `tree_leaves` of a handle reads its leaves without rebuilding the module, so the
        # handle stays on the fast path.
        return _arrays(self.state[0]), _arrays(self.state[1])


def _stack(batches: list[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *batches)


def _diff(a: Any, b: Any, optimizer: bool = True) -> float:
    """Max over arrays of max |a - b| / max |b|: the model arrays (parameters and batch-norm
    averages), and the optimizer's where both use the same optimizer (`flatten=True` holds
    its state differently)."""
    worst = 0.0
    pairs = zip(a, b, strict=True) if optimizer else [(a[0], b[0])]
    for xs, ys in pairs:
        assert len(xs) == len(ys), (len(xs), len(ys))
        for x, y in zip(xs, ys, strict=True):
            if x.size:
                d = np.max(np.abs(x.astype(np.float64) - y))
                worst = max(worst, float(d / (np.max(np.abs(y)) + 1e-12)))
    return worst


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "numpy", "pax3", "opax", "autoflat"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "?"
    return out


def _fmt(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 iterations, short blocks")
    ap.add_argument("--iterations", type=int, default=None, help="part 1 (default 10000)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; 3)")
    ap.add_argument("--block-seconds", type=float, default=None, help="default 5; 1")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--skip-part2", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="write the raw figures here")
    args = ap.parse_args(argv)
    iterations = args.iterations or (200 if args.quick else 10_000)
    repeats = args.repeats or (3 if args.quick else 5)
    block_s = args.block_seconds or (1.0 if args.quick else 5.0)

    t_start = time.perf_counter()
    versions = _versions()
    print("# PAX 'Improve performance' tutorial: ResNet50(3, 10) + opax.adam(1e-4)")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, JAX backend "
        f"{jax.default_backend()} x{jax.device_count()}"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    net = ResNet50(3, 10)
    result: dict[str, Any] = {
        "versions": versions,
        "config": {
            "iterations": iterations,
            "repeats": repeats,
            "block_seconds": block_s,
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "quick": args.quick,
        },
    }

    if not args.skip_part1:
        print(f"\n## Part 1: tree_flatten + tree_unflatten, {iterations} iterations")
        print(f"median of {repeats}\n")
        rows1 = part1(net, iterations, repeats)
        print("| state | leaves | s (median) | µs/iteration | s per 10,000 |")
        print("|---|---:|---:|---:|---:|")
        for r in rows1:
            print(
                f"| {r['case']} | {r['leaves']} | {r['seconds_median']:.3f} | "
                f"{_fmt(r['us_per_iteration'])} | {r['seconds_per_10000']:.2f} |"
            )
        result["part1"] = rows1
        sys.stdout.flush()

    if not args.skip_part2:
        print(f"\n## Part 2: per-step time, {args.batch_size}x3x{args.image_size}^2 per step")
        rng_key = jax.random.PRNGKey(42)
        k_img, k_label, k_check = jax.random.split(rng_key, 3)
        shape = (args.batch_size, 3, args.image_size, args.image_size)
        batch = (
            jax.random.normal(k_img, shape),
            jax.random.randint(k_label, (args.batch_size,), 0, 10),
        )
        batch10 = _stack([batch] * NUM_STEPS)
        check = [
            (
                jax.random.normal(k, shape),
                jax.random.randint(jax.random.fold_in(k, 1), (args.batch_size,), 0, 10),
            )
            for k in jax.random.split(k_check, NUM_STEPS)
        ]
        params = net.parameters()
        adam = opax.adam(LR)(params)
        adam_flat = opax.adam(LR)(params, flatten=True)
        methods: list[Method] = [
            Jit("jit", "a. jax.jit(update)", batch, net, adam),
            Jit(
                "jit_flat_opt", "b. jax.jit(update), optimizer flatten=True", batch, net, adam_flat
            ),
            PaxScan(
                "pax_scan", "c. pax.scan multistep (10), opt. flatten=True", batch10, net, adam_flat
            ),
            FlattenerRecipe(
                "flattener", "d. Flattener recipe, opt. flatten=True", batch, net, adam_flat
            ),
            Autoflat("autoflat_1", "e. autoflat num_steps=1", batch, net, adam, 1),
            Autoflat(
                "autoflat_1_nodonate",
                "e'. autoflat num_steps=1, donate=False",
                batch,
                net,
                adam,
                1,
                donate=False,
            ),
            Autoflat("autoflat_10", "f. autoflat num_steps=10", batch10, net, adam, NUM_STEPS),
            Autoflat(
                "autoflat_10_nodonate",
                "f'. autoflat num_steps=10, donate=False",
                batch10,
                net,
                adam,
                NUM_STEPS,
                donate=False,
            ),
        ]

        # --- agreement over the same 10 steps (and the compiles) ------------------------------
        first_s: dict[str, float] = {}
        losses: dict[str, np.ndarray] = {}
        finals: dict[str, Any] = {}
        for m in methods:
            t0 = time.perf_counter()
            if m.steps_per_call == 1:
                out = [m.call(b) for b in check]
            else:
                out = [m.call(_stack(check))]
            jax.block_until_ready((out, m.state))
            first_s[m.key] = time.perf_counter() - t0
            losses[m.key] = np.stack([np.asarray(x) for x in out]).reshape(-1)
            finals[m.key] = m.final()
            print(f"  first 10 steps (compile included): {m.key} {first_s[m.key]:.1f} s")
            sys.stdout.flush()
        agreement = {
            "autoflat_1 vs jit": _diff(finals["autoflat_1"], finals["jit"]),
            "autoflat_1_nodonate vs jit": _diff(finals["autoflat_1_nodonate"], finals["jit"]),
            "jit_flat_opt vs jit (model)": _diff(finals["jit_flat_opt"], finals["jit"], False),
            "flattener vs jit_flat_opt": _diff(finals["flattener"], finals["jit_flat_opt"]),
            "autoflat_10 vs pax_scan (model)": _diff(
                finals["autoflat_10"], finals["pax_scan"], False
            ),
            "autoflat_10_nodonate vs autoflat_10": _diff(
                finals["autoflat_10_nodonate"], finals["autoflat_10"]
            ),
        }
        loss_diff = {
            "autoflat_1 vs jit": float(
                np.max(np.abs(losses["autoflat_1"] - losses["jit"]) / np.abs(losses["jit"]))
            ),
            "autoflat_10 (mean) vs pax_scan": float(
                abs(losses["autoflat_10"].mean() - losses["pax_scan"][0])
                / abs(losses["pax_scan"][0])
            ),
            "autoflat_10 vs jit, first step": float(
                abs(losses["autoflat_10"][0] - losses["jit"][0]) / abs(losses["jit"][0])
            ),
        }
        # A scan and a loop are different XLA programs: reported, not asserted.
        scan_vs_loop = {
            "model": _diff(finals["pax_scan"], finals["jit"], False),
            "losses": float(
                np.max(np.abs(losses["autoflat_10"] - losses["jit"]) / np.abs(losses["jit"]))
            ),
        }
        print(
            "agreement after 10 steps, max relative difference (per array, of its max): "
            + ", ".join(f"{k} {v:.1e}" for k, v in agreement.items())
            + "; losses: "
            + ", ".join(f"{k} {v:.1e}" for k, v in loss_diff.items())
            + f"; scan vs loop (not asserted): model {scan_vs_loop['model']:.1e}, losses "
            f"{scan_vs_loop['losses']:.1e}"
        )
        for k, v in [*agreement.items(), *loss_diff.items()]:
            if v > 1e-5:
                raise AssertionError(f"{k}: relative difference {v:.2e} > 1e-5")
        sys.stdout.flush()

        # --- calibration ----------------------------------------------------------------------
        for m in methods:
            _, total = m.run(1)
            m.n_calls = max(1, round(block_s / total))
        afs = [m for m in methods if isinstance(m, Autoflat)]
        before = {m.key: autoflat.stats(m.fn) for m in afs}

        # --- timed blocks, round-robin --------------------------------------------------------
        for rep in range(repeats):
            for m in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
                gc.collect()
                dispatch, total = m.run(m.n_calls)
                steps = m.n_calls * m.steps_per_call
                m.dispatch.append(dispatch / steps)
                m.totals.append(total / steps)
        for m in afs:
            s, b = autoflat.stats(m.fn), before[m.key]
            calls = s.calls - b.calls
            if (
                s.flattens != b.flattens
                or s.traces != b.traces
                or s.fast_path - b.fast_path != 2 * calls
            ):
                raise AssertionError(f"{m.name} left the fast path during timing: {b} -> {s}")

        ms = 1e3
        ref = statistics.median(methods[0].totals)
        rows2 = []
        print(f"\n{repeats} rounds of ~{block_s} s blocks, round-robin\n")
        print(
            "| method | ms/step (median) | spread (min–max) | host dispatch ms/step "
            "| × jax.jit(update) | calls/block |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for m in methods:
            med = statistics.median(m.totals)
            row = {
                "key": m.key,
                "method": m.name,
                "steps_per_call": m.steps_per_call,
                "calls_per_block": m.n_calls,
                "ms_per_step_median": med * ms,
                "ms_per_step_all": [t * ms for t in m.totals],
                "dispatch_ms_per_step_median": statistics.median(m.dispatch) * ms,
                "ratio_vs_jit": med / ref,
                "first_10_steps_s": first_s[m.key],
            }
            rows2.append(row)
            print(
                f"| {m.name} | {row['ms_per_step_median']:.2f} | "
                f"{min(m.totals) * ms:.2f}–{max(m.totals) * ms:.2f} | "
                f"{row['dispatch_ms_per_step_median']:.3f} | {row['ratio_vs_jit']:.3f} | "
                f"{m.n_calls} |"
            )
        print("\nautoflat: " + "; ".join(f"{m.key} {autoflat.stats(m.fn)}" for m in afs))
        result["part2"] = {
            "rows": rows2,
            "agreement_max_abs": agreement,
            "loss_rel_diff": loss_diff,
            "scan_vs_loop": scan_vs_loop,
            "autoflat_stats": {m.key: str(autoflat.stats(m.fn)) for m in afs},
        }

    print(f"\ntotal run time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
