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

Each is timed `--repeats` times, round-robin; the median is reported, and the seconds per
10,000 iterations (the tutorial's unit). This is the host work a `jax.jit` call does on its
state arguments every step.

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

Then the methods are timed as `harness.py` times them: blocks of about `--block-seconds`,
round-robin, `--repeats` rounds, each method continuing from its own state, with
`jax.block_until_ready` once per block. Reported: the median time per step (spread min-max)
and the ratio to a; the JSON also has the host time per step before the final
`block_until_ready` (dispatch: with asynchronous dispatch, the host work of a call).
On XLA:CPU the convolutions of a step inside a `lax.scan` run slower than the same step
called in a loop, so c and f can be slower per step than a on a CPU; they are slowed alike.
"""

from __future__ import annotations

import sys
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat

import autoflat  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.harness import Method, Plan  # noqa: E402

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


def part1(net: Any, iterations: int, repeats: int) -> list[dict[str, Any]]:
    optimizer = opax.adam(LR)(net.parameters())
    optimizer_flat = opax.adam(LR)(net.parameters(), flatten=True)
    net_leaves, _ = jax.tree_util.tree_flatten(net)
    cases = {
        "1. (net, optimizer), naive": (net, optimizer),
        "2. (net, optimizer), optimizer flatten=True": (net, optimizer_flat),
        "3. optimizer flatten=True alone": optimizer_flat,
        "4. (net_leaves, optimizer): model flattened": (net_leaves, optimizer_flat),
        "5. pax.experimental.Flattener(model, optimizer)": pax.experimental.Flattener(
            model=net, optimizer=optimizer_flat
        ),
    }
    loops = {name: harness.roundtrip(value) for name, value in cases.items()}
    times = harness.time_loops(loops, iterations, repeats)
    rows = []
    for name, value in cases.items():
        med = float(np.median(times[name]))
        rows.append(
            {
                "case": name,
                "leaves": len(jax.tree_util.tree_leaves(value)),
                "seconds_median": med,
                "seconds_all": times[name],
                "us_per_iteration": med / iterations * 1e6,
                "seconds_per_10000": med / iterations * 10_000,
            }
        )
    return rows


# --- part 2: the training step --------------------------------------------------------------


def _arrays(tree: Any) -> list[np.ndarray]:
    """Host copies of the array leaves (copies: autoflat may donate the buffers later).
    `tree_leaves` of a handle reads its leaves without rebuilding the module."""
    return [np.array(x, copy=True) for x in jax.tree_util.tree_leaves(tree)]


def _final(m: Method) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(model arrays, optimizer arrays) of a method's current state."""
    state = m.state[0] if m.key == "flattener" else m.state
    if m.key == "flattener":
        return _arrays(state.model), _arrays(state.optimizer)
    return _arrays(state[0]), _arrays(state[1])


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


def methods(net: Any) -> list[Method]:
    """The rows of part 2 (see the module docstring); each starts from copies of `net` and
    its optimizer."""
    params = net.parameters()
    adam, adam_flat = opax.adam(LR)(params), opax.adam(LR)(params, flatten=True)

    def plan(fn: Any, opt: Any, flattener: bool = False) -> Any:
        def make() -> Plan:
            model, optimizer = harness.fresh((net, opt))
            if flattener:
                return Plan(
                    lambda: fn, (pax.experimental.Flattener(model=model, optimizer=optimizer),)
                )
            return Plan(lambda: fn, (model, optimizer))

        return make

    def af(k: int, donate: bool) -> Any:
        return lambda: Plan(lambda: autoflat.step(update, num_steps=k, donate=donate), (net, adam))

    return [
        Method("jit", "a. jax.jit(update)", plan(update, adam)),
        Method(
            "jit_flat_opt", "b. jax.jit(update), optimizer flatten=True", plan(update, adam_flat)
        ),
        Method(
            "pax_scan",
            "c. pax.scan multistep (10), opt. flatten=True",
            plan(multistep_update, adam_flat),
            steps_per_call=NUM_STEPS,
        ),
        Method(
            "flattener",
            "d. Flattener recipe, opt. flatten=True",
            plan(flat_update_wrapper, adam_flat, flattener=True),
        ),
        Method("autoflat_1", "e. autoflat num_steps=1", af(1, True)),
        Method("autoflat_1_nodonate", "e'. autoflat num_steps=1, donate=False", af(1, False)),
        Method(
            "autoflat_10", "f. autoflat num_steps=10", af(NUM_STEPS, True), steps_per_call=NUM_STEPS
        ),
        Method(
            "autoflat_10_nodonate",
            "f'. autoflat num_steps=10, donate=False",
            af(NUM_STEPS, False),
            steps_per_call=NUM_STEPS,
        ),
    ]


def part2(net: Any, batch_size: int, image_size: int, repeats: int, block_s: float) -> Any:
    k_img, k_label, k_check = jax.random.split(jax.random.PRNGKey(42), 3)
    shape = (batch_size, 3, image_size, image_size)
    batch = (jax.random.normal(k_img, shape), jax.random.randint(k_label, (batch_size,), 0, 10))
    check = [
        (
            (
                jax.random.normal(k, shape),
                jax.random.randint(jax.random.fold_in(k, 1), (batch_size,), 0, 10),
            ),
        )
        for k in jax.random.split(k_check, NUM_STEPS)
    ]
    ms = methods(net)
    # The same 10 steps from the same state (this also compiles everything).
    harness.first_calls(ms, (batch,), check)
    failed = [m.label for m in ms if m.error is not None]
    if failed:
        raise RuntimeError(f"failed in their first calls: {failed}")
    f = {m.key: _final(m) for m in ms}
    losses = {m.key: m.check_losses for m in ms}
    agreement = {
        "autoflat_1 vs jit": _diff(f["autoflat_1"], f["jit"]),
        "autoflat_1_nodonate vs jit": _diff(f["autoflat_1_nodonate"], f["jit"]),
        "jit_flat_opt vs jit (model)": _diff(f["jit_flat_opt"], f["jit"], False),
        "flattener vs jit_flat_opt": _diff(f["flattener"], f["jit_flat_opt"]),
        "autoflat_10 vs pax_scan (model)": _diff(f["autoflat_10"], f["pax_scan"], False),
        "autoflat_10_nodonate vs autoflat_10": _diff(f["autoflat_10_nodonate"], f["autoflat_10"]),
    }
    rel = lambda a, b: float(np.max(np.abs(a - b) / np.abs(b)))  # noqa: E731
    loss_diff = {
        "autoflat_1 vs jit": rel(losses["autoflat_1"], losses["jit"]),
        "autoflat_10 (mean) vs pax_scan": rel(losses["autoflat_10"].mean(), losses["pax_scan"][0]),
        "autoflat_10 vs jit, first step": rel(losses["autoflat_10"][0], losses["jit"][0]),
    }
    # A scan and a loop are different XLA programs: reported, not asserted.
    scan_vs_loop = {
        "model": _diff(f["pax_scan"], f["jit"], False),
        "losses": rel(losses["autoflat_10"], losses["jit"]),
    }
    harness.log(
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
    harness.time_methods(ms, repeats, block_s, title="part 2")
    rows = harness.method_rows(ms)
    print("", *harness.step_table(rows, [("jit", "jax.jit(update)")]), sep="\n")
    return {
        "rows": rows,
        "agreement_max_abs": agreement,
        "loss_rel_diff": loss_diff,
        "scan_vs_loop": scan_vs_loop,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__doc__.split("\n")[0], batch_size=1, image_size=64)
    ap.add_argument("--iterations", type=int, default=None, help="part 1 (default 10000)")
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--skip-part2", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="write the raw figures here")
    args = ap.parse_args(argv)
    iterations = args.iterations or (200 if args.quick else 10_000)
    repeats = args.repeats or (3 if args.quick else 5)
    block_s = args.block_seconds or (1.0 if args.quick else 5.0)

    machine, versions = (
        harness.machine(),
        harness.versions(("jax", "jaxlib", "numpy", "pax3", "opax")),
    )
    harness.log("# PAX 'Improve performance' tutorial: ResNet50(3, 10) + opax.adam(1e-4)")
    harness.log("\n".join(harness.environment_lines(machine, versions)))
    net = ResNet50(3, 10)
    result: dict[str, Any] = {"machine": machine, "versions": versions, "config": vars(args)}
    if not args.skip_part1:
        harness.log(f"\n## Part 1: tree_flatten + tree_unflatten, {iterations} iterations\n")
        rows1 = result["part1"] = part1(net, iterations, repeats)
        body = [
            [r["case"], str(r["leaves"]), f"{r['seconds_median']:.3f}"]
            + [harness.fmt(r["us_per_iteration"]), f"{r['seconds_per_10000']:.2f}"]
            for r in rows1
        ]
        header = ["state", "leaves", "s (median)", "µs/iteration", "s per 10,000"]
        print(*harness.table(header, "lrrrr", body), sep="\n")
    if not args.skip_part2:
        harness.log(f"\n## Part 2: per-step time, {args.batch_size}x3x{args.image_size}^2 per step")
        result["part2"] = part2(net, args.batch_size, args.image_size, repeats, block_s)
    if args.json:
        harness.write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
