"""Flax NNX at the floor: the mutation-style step against `nnx.jit_partial`, side by side, and
where the host time of each call goes.

    python benchmarks/bench_nnx.py [--quick] [--repeats N] [--block-seconds S] [--rounds N]
                                   [--width 2] [--batch-size 8] [--image-size 16]
                                   [--nnx-batchnorm] [--json PATH]

The model, step and methods are `report.py` section 2's (`nnx_models`: the narrow ResNet50
with `nnx.Optimizer(adam)`, 485 state arrays): `jit_partial` (`nnx.jit_partial(train_step,
model, optimizer, graph=False)`, the best of Flax's documented remedies) and `autoflat_mut_1`
(`autoflat.step(train_step)` called with the caller's model and optimizer every time, their
Variables written back after each call).

1. **Per step** (`harness.time_methods`): round-robin blocks of about `--block-seconds`, each
   method continuing from its own state; medians. The ratio autoflat / jit_partial is given
   as the ratio of the medians and as the median of each repeat's ratio (a repeat's two blocks
   run back to back, under the same load). Then each call's host time with the device idle at
   its start (`Method.run_idle`, wall).
2. **The parts, each measured alone** in this process, taking turns call by call (`--rounds`
   rounds, each one call of every part with the device idle at its start), median µs per
   call:
   - *floor*: JAX's dispatch of a `jax.jit` of `[a + 1 for a in leaves]` on buffers of the
     state's 485 shapes, donated and not (what any transport of one buffer per leaf pays,
     freeing the last call's buffers included), and autoflat's own compiled program for the
     step, launched bare (`step.lower(...).compile().jax`, chained on its outputs);
   - *write-back* of the 485 Variables alone: Flax's checked `set_raw_value` per Variable, and
     the unchecked slot setter that autoflat (like `nnx.jit_partial`) uses for all but one;
   - *autoflat's call*, phase by phase: `prepare` (of it the NNX cache's `lookup`, and of
     that the graph snapshot check), `launch`, `finish` (of it the write-back), `hand_over`
     (which lets go of the call's donated input buffers);
   - *`nnx.jit_partial`'s call*: its `jax.jit` (flattening the 485 Variables, the dispatch,
     the updates' outputs) and applying the updates.

The machine may be shared and loaded: read the ratios, which come from runs taking turns, not
the absolute times.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import harness, nnx_models  # noqa: E402

KEYS = ("jit_partial", "autoflat_mut_1")
ns = time.perf_counter_ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__doc__.splitlines()[0], width=2, batch_size=8, image_size=16)
    ap.add_argument("--rounds", type=int, help="rounds of the parts (one call each)")
    ap.add_argument("--nnx-batchnorm", action="store_true", help="nnx.BatchNorm in the model")
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    args = ap.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 11)
    block_s = args.block_seconds or (0.3 if args.quick else 1.0)
    rounds = args.rounds or (100 if args.quick else 400)

    s = nnx_models.Setup(args.width, args.batch_size, args.image_size, args.nnx_batchnorm)
    harness.log("# Flax NNX at the floor: autoflat mutation style against nnx.jit_partial")
    harness.log("\n".join(harness.environment_lines(harness.machine(), harness.versions())))
    methods = nnx_models.methods(s, KEYS)
    harness.first_calls(methods, s.args, s.checks)
    harness.agree(methods, len(s.checks))
    if any(m.error for m in methods):
        raise SystemExit("a method failed: nothing to compare")
    harness.time_methods(methods, repeats, block_s, idle=True, title="per step")
    jp, af = methods
    result: dict[str, Any] = {"per_step": per_step(jp, af), "config": vars(args)}
    result["parts"] = parts(s, jp, af, rounds)
    print(*report(result), sep="\n")
    if args.json:
        harness.write_json(result, args.json)
    return result


def per_step(jp: harness.Method, af: harness.Method) -> dict[str, Any]:
    """Section 1's figures: per-step medians, both ratios, idle host time per call."""
    ratios = [a / j for a, j in zip(af.totals, jp.totals, strict=True)]
    idle = [a / j for a, j in zip(af.extra["idle_wall"], jp.extra["idle_wall"], strict=True)]
    return {
        "jit_partial_us": harness.summary(jp.totals),
        "autoflat_us": harness.summary(af.totals),
        "ratio_of_medians": statistics.median(af.totals) / statistics.median(jp.totals),
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
        "idle_jit_partial_us": harness.summary(jp.extra["idle_wall"]),
        "idle_autoflat_us": harness.summary(af.extra["idle_wall"]),
        "idle_median_ratio": statistics.median(idle),
    }


# ==========================================================================================
# 2. The parts, measured alone, taking turns
# ==========================================================================================


class Clock:
    """Durations (ns) recorded under names, by wrapped functions (`wrap`)."""

    def __init__(self) -> None:
        self.times: dict[str, list[int]] = {}
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        times = self.times.setdefault(name, [])

        def timed(*a: Any, **kw: Any) -> Any:
            if not self.on:
                return fn(*a, **kw)
            t0 = ns()
            try:
                return fn(*a, **kw)
            finally:
                times.append(ns() - t0)

        return timed


def clock_phases(clock: Clock, partial: Any) -> None:
    """Time the phases of autoflat's call and of `nnx.jit_partial`'s. This script's only
    private access: the names the step's `__call__` calls (`autoflat._step`), the NNX cache
    (`autoflat._handles`), and Flax's `_apply_raw_updates` (what `jit_partial` calls after
    its `jax.jit`)."""
    from flax.nnx.transforms import compilation

    from autoflat import _step
    from autoflat._handles import nnx as af_nnx
    from autoflat._handles import snapshot

    for name in ("prepare", "launch", "finish", "hand_over"):
        setattr(_step, name, clock.wrap(f"autoflat.{name}", getattr(_step, name)))
    af_nnx.NnxState.lookup = clock.wrap("autoflat.prepare.lookup", af_nnx.NnxState.lookup)
    snapshot.GraphSnapshot.unchanged = clock.wrap(
        "autoflat.prepare.lookup.snapshot", snapshot.GraphSnapshot.unchanged
    )
    af_nnx.NnxState.write = clock.wrap("autoflat.finish.write", af_nnx.NnxState.write)
    partial.jitted_fn = clock.wrap("jit_partial.jit", partial.jitted_fn)
    compilation._apply_raw_updates = clock.wrap(
        "jit_partial.apply_updates", compilation._apply_raw_updates
    )


def dispatch_part(leaves: list[Any], x: Any, y: Any, donate: bool) -> Callable[[], Any]:
    """One launch of a `jax.jit` of `[a + 1 for a in leaves]` (and a sum of the batch), chained
    on its outputs: the previous buffers are freed in the call, as in any training loop."""

    def body(ls: list[Any], x: Any, y: Any) -> Any:
        return [a + 1 for a in ls], (x.sum(), y.sum())

    jit = jax.jit(body, donate_argnums=(0,) if donate else ())
    held = [harness.fresh(leaves)]

    def call() -> Any:
        held[0], out = jit(held[0], x, y)
        return out

    return call


def bare_part(af: harness.Method) -> Callable[[], Any]:
    """autoflat's own compiled program for the step, launched bare on its flat inputs, each
    launch on the state buffers the last one returned."""
    lowered = af.fn.lower(*af.fixed, *af.args)
    compiled, flat = lowered.compile().jax, [harness.fresh(lowered.args)]

    def call() -> Any:
        out = compiled(*flat[0])
        flat[0] = harness.PRIVATE.bare_next_args(flat[0], out)
        return out[1]

    return call


def writeback_parts(s: nnx_models.Setup) -> dict[str, Callable[[], Any]]:
    """Writing 485 arrays into 485 Variables, alone: Flax's checked setter, and the slot's."""
    model, optimizer = s.fresh()
    variables = [
        v
        for v in jax.tree_util.tree_leaves(
            (model, optimizer), is_leaf=lambda v: isinstance(v, nnx.Variable)
        )
        if isinstance(v, nnx.Variable)
    ]
    arrays = [v.get_raw_value() for v in variables]
    slot = next(
        t.__dict__["_raw_value"] for t in type(variables[0]).__mro__ if "_raw_value" in t.__dict__
    )

    def checked() -> None:
        for v, a in zip(variables, arrays, strict=True):
            v.set_raw_value(a)

    def unchecked() -> None:
        list(map(slot.__set__, variables, arrays))

    return {"writeback.flax_set_raw_value": checked, "writeback.slot_setter": unchecked}


def parts(
    s: nnx_models.Setup, jp: harness.Method, af: harness.Method, rounds: int
) -> dict[str, Any]:
    """Every part, one idle call each per round, the order rotating; per name, the median µs
    per call and how many calls (`n`)."""
    leaves = harness.device_buffers(jax.tree_util.tree_leaves(nnx.state(af.fixed)))
    x, y = af.args
    calls: dict[str, Callable[[], Any]] = {
        "floor.dispatch_485_donated": dispatch_part(leaves, x, y, donate=True),
        "floor.dispatch_485_kept": dispatch_part(leaves, x, y, donate=False),
        "floor.autoflat_program_bare": bare_part(af),
        **writeback_parts(s),
        "autoflat.call": lambda: af.fn(*af.fixed, *af.args),
        "jit_partial.call": lambda: jp.fn(*jp.args),
    }
    clock = Clock()
    clock_phases(clock, jp.fn)
    totals: dict[str, list[int]] = {name: [] for name in calls}
    for _ in range(5):  # warm every part up
        jax.block_until_ready([f() for f in calls.values()])
    out: Any = None
    for r in range(rounds):
        if r % 50 == 0:
            gc.collect()
        order = list(calls.items())
        order = order[r % len(order) :] + order[: r % len(order)]
        for name, f in order:
            jax.block_until_ready(out)
            clock.on = name in ("autoflat.call", "jit_partial.call")
            t0 = ns()
            out = f()
            totals[name].append(ns() - t0)
            clock.on = False
    jax.block_until_ready(out)
    figures = {name: _us(v) for name, v in totals.items()}
    figures |= {name: _us(v) for name, v in clock.times.items() if v}
    return figures


def _us(values_ns: list[int]) -> dict[str, float]:
    return {"median": statistics.median(values_ns) / 1e3, "n": len(values_ns)}


# ==========================================================================================
# The report
# ==========================================================================================


def report(r: dict[str, Any]) -> list[str]:
    p, parts_ = r["per_step"], r["parts"]
    med = lambda d: d["median"]  # noqa: E731
    lines = [
        "",
        "## 1. Per step (round-robin blocks)",
        "",
        f"jit_partial {med(p['jit_partial_us']):,.0f} µs/step "
        f"({p['jit_partial_us']['min']:,.0f}-{p['jit_partial_us']['max']:,.0f}), "
        f"autoflat_mut_1 {med(p['autoflat_us']):,.0f} µs/step "
        f"({p['autoflat_us']['min']:,.0f}-{p['autoflat_us']['max']:,.0f})",
        f"autoflat_mut_1 / jit_partial: {p['ratio_of_medians']:.2f}x (ratio of medians), "
        f"{p['median_ratio']:.2f}x (median of per-repeat ratios)",
        f"host time of a call, device idle at its start: jit_partial "
        f"{med(p['idle_jit_partial_us']):,.0f} µs, autoflat {med(p['idle_autoflat_us']):,.0f} "
        f"µs: {p['idle_median_ratio']:.2f}x (median of per-repeat ratios)",
        "",
        "## 2. The parts, each alone, taking turns call by call (median µs per call)",
        "",
        "| part | µs | calls |",
        "|---|---:|---:|",
    ]
    for name in sorted(parts_):
        lines.append(f"| {name} | {parts_[name]['median']:,.1f} | {parts_[name]['n']} |")
    jp = parts_["jit_partial.call"]["median"]
    floor = (
        parts_["floor.autoflat_program_bare"]["median"] + parts_["writeback.slot_setter"]["median"]
    )
    lines += [
        "",
        f"autoflat.call / jit_partial.call: {parts_['autoflat.call']['median'] / jp:.2f}x; "
        f"floor (bare program + slot write-back) / jit_partial.call: {floor / jp:.2f}x",
    ]
    return lines


if __name__ == "__main__":
    main()
