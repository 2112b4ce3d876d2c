"""Per-step host overhead of a whole training step, run several ways side by side in one process.

    python benchmarks/bench_overhead.py [--quick] [--lazy] [--json PATH] [--width 2]
                                        [--image-size 16]

The Equinox group of `report.py`'s section 2, alone and shorter: the narrow ResNet50 of
`models.py` (ResNet50's 161 parameter arrays, channels so narrow that the compute is tiny)
with `optax.adam`, its step `models.update`

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss

run by plain `jax.jit` (partition once outside, combine inside) without and with donation,
`eqx.filter_jit`, the hand-written flat-leaves recipe (`jax.jit`, donated), autoflat
`num_steps=1` and `num_steps=10` (and with `lazy=False`, at the default transport, against
its handles), the floor of returning real objects (hand-written flat leaves whose outputs are
rebuilt into the real model and optimizer state after every call, `FLOOR_KEYS`), and the
device compute per step (a jitted `lax.scan` of `--compute-steps` steps on flat leaves;
"overhead" is step time minus it). `--lazy` runs only the `lazy=False` rows, their handles
with both transports and the floor, and prints their ratios. `models.methods`
says what each one does; `harness.py` how they are checked against each other and timed
(round-robin blocks, every method continuing from its own state). Also the memory each
holds across a call.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat

import jax  # noqa: E402

from benchmarks import harness, models  # noqa: E402
from benchmarks.harness import Method, Plan  # noqa: E402

KEYS = ("jit", "jit_donate", "filter_jit", "hand_flat", "autoflat_1", "autoflat_10", "compute")
# `--lazy`: handles against `lazy=False` (real objects back from every call), at the default
# transport (`pack="auto"`), k=1 and k=10: the cost of returning real objects.
LAZY_KEYS = (
    "autoflat_1_auto",
    "autoflat_1_auto_lazyfalse",
    "autoflat_10_auto",
    "autoflat_10_auto_lazyfalse",
)
# The floor of returning real objects, beside `LAZY_KEYS`: the hand-written flat-leaves step
# (jax.jit, donated; for k > 1 a lax.scan of k steps), its array leaves rebuilt into the real
# (model, opt_state) with one tree_unflatten after every call and held until the next, as
# lazy=False's objects are. It carries one buffer per leaf, as lazy=False does under "auto".
FLOOR_KEYS = ("floor_1", "floor_10")
# And handles travelling one buffer per leaf (`pack=False`), as lazy=False's state does: what
# of lazy=False's cost is the transport, and what the rebuild.
FLAT_KEYS = ("autoflat_1", "autoflat_10")


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__.splitlines()[0], width=2, batch_size=8, image_size=16)
    ap.add_argument("--json", metavar="PATH", help="write the raw figures here")
    ap.add_argument("--compute-steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=1, help="first calls (compiles) at a time")
    ap.add_argument(
        "--lazy", action="store_true", help="only handles against lazy=False (k=1 and k=10)"
    )
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    block_s = args.block_seconds or (0.3 if args.quick else 1.0)

    s = models.Setup(args.width, args.batch_size, args.image_size)
    counts = models.count_leaves((s.model, s.opt_state))
    machine, versions = harness.machine(), harness.versions()
    harness.log("# autoflat overhead benchmark: narrow ResNet50 + optax.adam")
    harness.log("\n".join(harness.environment_lines(machine, versions)))
    harness.log(
        f"model: width {args.width}, batch {args.batch_size}x{args.image_size}x"
        f"{args.image_size}x3; (model, adam state): {counts['arrays']} arrays + "
        f"{counts['static']} non-array leaves"
    )
    keys = LAZY_KEYS + FLAT_KEYS if args.lazy else KEYS + LAZY_KEYS
    methods = models.methods(s, keys, args.compute_steps)
    methods += [floor_method(key, s) for key in FLOOR_KEYS]
    result = harness.check_and_time(
        "Equinox", methods, s.args, s.checks, repeats, block_s, args.jobs
    )
    result |= {"rows": harness.method_rows(methods), "memory": harness.measure_memory(methods)}
    refs = [("hand_flat", "hand-written"), ("filter_jit", "filter_jit")]
    print("", *harness.step_table(result["rows"], refs), "", sep="\n")
    print(*lazy_ratios(result["rows"]), "", sep="\n")
    print(*harness.memory_table(result["memory"]), sep="\n")
    result |= {"machine": machine, "versions": versions, "leaves": counts, "config": vars(args)}
    if args.json:
        harness.write_json(result, args.json)
    return result


def lazy_ratios(rows: list[dict]) -> list[str]:
    """Per k, the median time per step of `lazy=False` over that of handles; of handles with
    one buffer per leaf, and of the floor (flat leaves + rebuild), over that of handles."""
    ok = {r["key"]: r["us_per_step"]["median"] for r in rows if "us_per_step" in r}
    lines = []
    for k in (1, 10):
        handles, eager = ok.get(f"autoflat_{k}_auto"), ok.get(f"autoflat_{k}_auto_lazyfalse")
        floor, flat = ok.get(f"floor_{k}"), ok.get(f"autoflat_{k}")
        if handles and eager:
            lines.append(f"lazy=False / handles at num_steps={k}: {eager / handles:.2f}x")
        if handles and flat:
            lines.append(
                f"handles, one buffer per leaf (pack=False) / handles at num_steps={k}: "
                f"{flat / handles:.2f}x"
            )
        if handles and floor:
            lines.append(
                f"floor (flat leaves + rebuild) / handles at num_steps={k}: {floor / handles:.2f}x"
            )
    return lines


class Rebuilt:
    """A jitted step on flat array leaves whose state outputs are rebuilt into the real
    objects after every call (`objects`, held until the next call replaces them)."""

    def __init__(self, layout: models.FlatLayout, fn: Any) -> None:
        self.layout, self.fn, self.objects = layout, fn, None

    def __call__(self, arrays: Any, *args: Any) -> tuple[Any, Any]:
        arrays, out = self.fn(arrays, *args)
        self.objects = self.layout.rebuild(arrays)
        return arrays, out


def floor_method(key: str, s: models.Setup) -> Method:
    """`floor_{k}` (`FLOOR_KEYS`)."""
    k = int(key.rsplit("_", 1)[1])

    def plan() -> Plan:
        layout = models.FlatLayout(s.fresh())
        body: Any = layout.body
        if k > 1:
            body = lambda a, bs: jax.lax.scan(layout.body, a, bs)  # noqa: E731
        jit = jax.jit(body, donate_argnums=0)
        return Plan(lambda: Rebuilt(layout, jit), (layout.arrays,))

    note = (
        "hand-written flat leaves (jax.jit + donate"
        + (f", a lax.scan of {k} steps" if k > 1 else "")
        + "); (model, opt_state) rebuilt with one tree_unflatten after every call and held "
        "until the next, as lazy=False's objects are"
    )
    label = f"floor: flat leaves + rebuild, {k} step{'s' * (k > 1)}/call"
    return Method(key, label, plan, steps_per_call=k, note=note)


if __name__ == "__main__":
    main()
