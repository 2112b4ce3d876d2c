"""Flat, packed and automatic transport of state, side by side in one process.

    python benchmarks/bench_transport.py [--quick] [--json PATH] [--models abc] [--repeats N]
    python benchmarks/bench_transport.py --sweep   # the leaf-size sweep behind pack="auto"
    python benchmarks/bench_transport.py --compile [--leaves 300,1000,3000] [--num-steps K]
                                         [--legacy]

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
the step's own compiled program launched directly with its flat arguments
(`step.lower(...).compile().jax`), the same way: the runtime's cost of launching that program
with that many buffers, the floor for that transport. The step's host time minus it is
autoflat's own work plus freeing the previous call's arrays, which the step's timing includes
(the caller rebinds its handles in the timed statement) and the bare timing does not.
"buffers" are the state buffers a call passes: the program's arguments less the batch's.

Every figure is timed the way of `harness.py`: round-robin blocks over the three transports
of a (model, k), each continuing from its own state; the host time per call is measured after
each block on a quarter as many calls (at least 3), the device idle before each.

`--compile` times first calls (trace, compile and one call of `--num-steps` steps, default 1,
from a fresh step after `jax.clear_caches()` and `autoflat.clear_caches()`) of two states of
many small leaves, for each number of leaves and each transport, round-robin over the
transports, medians of the repeats: "sweep", N arrays of 8 f32 each updated by `x * 0.99 + g`
(the report's leaves section), and "adam", N/3 arrays of 64 f32 trained with `optax.adam` (N
state arrays with its moments). "auto, no views" is `pack="auto"` with the packed leaves cut
out before the step and repacked after it, every one (`autoflat._runtime.entry.SEGMENTS` off: the
transport before elementwise operations ran on whole buffers). `--legacy` adds the packed
transport before the compile-time fix (static slices in, one concatenate out) at up to 1,000
leaves.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat

import autoflat  # noqa: E402
from benchmarks import harness, models  # noqa: E402
from benchmarks.harness import Method, Plan, perf  # noqa: E402

PACKS = (False, True, "auto")


def resnet_case(quick: bool) -> tuple[Any, Any, Any]:
    model = models.make_model(width=2)
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


def sweep_case(size: int, n_leaves: int = 48) -> tuple[Any, Any, Any]:
    """`n_leaves` weight-like leaves of `size` elements each (plus Adam): the leaf size at
    which packing stops paying sets pack="auto"'s threshold."""
    keys = jax.random.split(jax.random.key(0), n_leaves)
    params = [jax.random.normal(k, (size,)) * 0.01 for k in keys]
    x = jnp.ones((8, size))

    def loss(params: list[jax.Array], batch: jax.Array) -> jax.Array:
        return sum(jnp.mean(jnp.tanh(batch * p)) for p in params)  # type: ignore[return-value]

    return params, x, loss


def pack_methods(case: tuple[Any, Any, Any], k: int, packs: tuple[Any, ...]) -> list[Method]:
    """`autoflat.step(update, num_steps=k, pack=...)` of the case's model, one per pack."""
    model, _, loss_fn = case
    update = models.make_update(loss_fn)
    state = (model, models.tx.init(eqx.filter(model, eqx.is_array)))
    return [
        Method(
            str(pack),
            f"pack={pack}",
            lambda p=pack: Plan(
                lambda: autoflat.step(update, num_steps=k, pack=p), harness.fresh(state)
            ),
            steps_per_call=k,
        )
        for pack in packs
    ]


class BareProgram(Method):
    """A step's own compiled program, launched directly with its flat arguments
    (`step.lower(*args).compile().jax`), each launch on the state buffers the last one
    returned (as the step's are; fresh copies make a launch measurably slower)."""

    def __init__(self, of: Method, batch: Any):
        super().__init__(of.key, f"bare program of {of.label}", of.make)
        lowered = of.fn.lower(*of.state, *of.args)
        # its own buffers: the program donates them, and the step's next call donates its own
        self.fn, self.flat = lowered.compile().jax, harness.fresh(lowered.args)
        n_args = len(jax.tree_util.tree_leaves(lowered.args))
        self.extra["state_buffers"] = n_args - len(jax.tree_util.tree_leaves(of.args))

    def run(self, n: int) -> tuple[float, float]:
        wall = self.run_idle(n)[0] * n
        return wall, wall

    def run_idle(self, n: int) -> tuple[float, float]:
        wall = cpu = 0.0
        for _ in range(n):
            jax.block_until_ready(self.flat)
            w0, c0 = perf(), time.thread_time()
            out = self.fn(*self.flat)
            cpu += time.thread_time() - c0
            wall += perf() - w0
            self.flat = harness.PRIVATE.bare_next_args(self.flat, out)
            del out  # the previous call's outputs are freed outside the timed call
        jax.block_until_ready(self.flat)
        return wall / n, cpu / n


def run_case(name: str, case: Any, quick: bool, repeats: int) -> list[dict[str, Any]]:
    model, batch, _ = c = case(quick)
    opt_state = models.tx.init(eqx.filter(model, eqx.is_array))
    n_arrays = len(jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array)))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    rows = []
    for k in (1, 10):
        methods = pack_methods(c, k, PACKS)
        harness.first_calls(methods, (batch,), [(batch,)] * 2 * k)
        harness.agree(methods, 2 * k)
        bare = [BareProgram(m, batch) for m in methods if m.error is None]
        block_s, title = (0.15 if quick else 0.5), f"{name}, num_steps={k}"
        harness.time_methods(methods + bare, repeats, block_s, idle=True, title=title)
        med = {
            (m, what): float(np.median(m.extra[what]))
            for m in methods + bare
            for what in ("idle_wall", "idle_cpu")
        }
        base = methods[0]
        for m, b in zip(methods, bare, strict=True):
            step = np.median(m.totals)
            rows.append(
                {
                    "model": name,
                    "arrays": n_arrays,
                    "params": int(n_params),
                    "num_steps": k,
                    "pack": m.key,
                    "buffers": b.extra["state_buffers"],
                    "us_per_step": step * 1e6,
                    "min": min(m.totals) * 1e6,
                    "max": max(m.totals) * 1e6,
                    "vs_flat": step / np.median(base.totals),
                    "host_us_per_call": med[m, "idle_wall"] * 1e6,
                    "host_vs_flat": med[m, "idle_wall"] / med[base, "idle_wall"],
                    "bare_us_per_call": med[b, "idle_wall"] * 1e6,
                    "host_cpu_us_per_call": med[m, "idle_cpu"] * 1e6,
                    "host_cpu_vs_flat": med[m, "idle_cpu"] / med[base, "idle_cpu"],
                    "repeats_us": [t * 1e6 for t in m.totals],
                }
            )
    return rows


def run_sweep(sizes: list[int], repeats: int, quick: bool) -> list[dict[str, Any]]:
    """End-to-end time per step at num_steps=1, pack=False against pack=True, per leaf size."""
    rows = []
    for size in sizes:
        case = sweep_case(size)
        methods = pack_methods(case, 1, (False, True))
        batch = (case[1],)
        harness.check_and_time(
            f"{size}", methods, batch, [batch] * 2, repeats, 0.15 if quick else 0.4
        )
        flat, packed = (float(np.median(m.totals)) for m in methods)
        rows.append(
            {
                "leaf_elements": size,
                "leaves": 48 * 3,
                "flat_us": flat * 1e6,
                "packed_us": packed * 1e6,
                "packed_vs_flat": packed / flat,
            }
        )
        harness.log(
            f"  leaves of {size:>7,} elements: flat {flat * 1e6:8.0f} µs, "
            f"packed {packed * 1e6:8.0f} µs, packed × flat {packed / flat:.2f}"
        )
    return rows


def compile_case(kind: str, n_leaves: int) -> tuple[Any, tuple[Any, ...], Any]:
    """(update, first call's state, its per-step argument) with `n_leaves` state arrays."""
    if kind == "sweep":

        def sweep_update(state: list[jax.Array], g: jax.Array) -> list[jax.Array]:
            state = [x * 0.99 + g for x in state]
            return state

        state = [jnp.arange(8, dtype=jnp.float32) / 8 + i for i in range(n_leaves)]
        return sweep_update, (state,), jnp.float32(0.5)
    keys = jax.random.split(jax.random.key(0), n_leaves // 3)
    params = [jax.random.normal(k, (64,)) * 0.01 for k in keys]

    def loss(params: list[jax.Array], batch: jax.Array) -> jax.Array:
        return sum(jnp.mean(jnp.tanh(batch * p)) for p in params)  # type: ignore[return-value]

    update = models.make_update(loss)
    return update, (params, models.tx.init(params)), jnp.ones((8, 64))


class _Legacy:
    """The packed transport before the compile-time fix: static slices in, one concatenate
    out (while active, for comparison only)."""

    def __enter__(self) -> None:
        from autoflat._transport import layout as _transport

        self.saved = _transport._take, _transport._concatenate
        _transport._take = lambda buf, off, n, shape, total: jax.lax.slice(
            buf, (off,), (off + n,)
        ).reshape(shape)
        _transport._concatenate = lambda parts, inputs=False: jnp.concatenate(parts)

    def __exit__(self, *exc: Any) -> None:
        from autoflat._transport import layout as _transport

        _transport._take, _transport._concatenate = self.saved


class _NoViews:
    """Packed leaves cut out before the step, every one (while active)."""

    def __enter__(self) -> None:
        from autoflat._runtime import entry as _entry

        self.saved = _entry.SEGMENTS
        _entry.SEGMENTS = False

    def __exit__(self, *exc: Any) -> None:
        from autoflat._runtime import entry as _entry

        _entry.SEGMENTS = self.saved


def run_compile(
    sizes: list[int], repeats: int, legacy: bool, num_steps: int = 1
) -> list[dict[str, Any]]:
    """First-call seconds per (case, leaves, transport), round-robin, medians."""
    import contextlib
    import gc

    modes: list[tuple[str, Any]] = [
        ("False", False),
        ("auto", "auto"),
        ("True", True),
        ("auto, no views", "auto"),
    ]
    rows = []
    for kind in ("sweep", "adam"):
        for n in sizes:
            update, state, arg = compile_case(kind, n)
            if num_steps > 1:
                arg = jnp.stack([arg] * num_steps)
            todo = modes + ([("legacy True", True)] if legacy and n <= 1000 else [])
            times: dict[str, list[float]] = {name: [] for name, _ in todo}
            layouts: dict[str, str] = {}
            for _, order in harness.rotations(todo, repeats):
                for name, pack in order:
                    jax.clear_caches()
                    autoflat.clear_caches()
                    gc.collect()
                    context = (
                        _Legacy()
                        if name.startswith("legacy")
                        else _NoViews()
                        if name.endswith("no views")
                        else contextlib.nullcontext()
                    )
                    with context:
                        step = autoflat.step(update, pack=pack, num_steps=num_steps)
                        fresh = harness.fresh(state)
                        t0 = perf()
                        out = step(*fresh, arg)
                        jax.block_until_ready(harness.device_buffers(out))
                        times[name].append(perf() - t0)
                    layouts[name] = str(getattr(out[0], "_af_layout", None))
            flat = float(np.median(times["False"]))
            for name, ts in times.items():
                med = float(np.median(ts))
                rows.append(
                    {
                        "case": kind,
                        "leaves": len(jax.tree.leaves(state)),
                        "pack": name,
                        "first_call_s": med,
                        "min_s": min(ts),
                        "max_s": max(ts),
                        "vs_flat": med / flat,
                        "num_steps": num_steps,
                        "layout": layouts[name],
                        "repeats_s": ts,
                    }
                )
                harness.log(
                    f"  {kind:5s} {rows[-1]['leaves']:>5} leaves  pack={name:<11s} first call "
                    f"{med:7.2f} s ({min(ts):.2f}-{max(ts):.2f})  x flat {med / flat:5.2f}"
                )
    return rows


def main() -> None:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default="abc", help="which of the models a, b, c (default: all)")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="only the leaf-size sweep behind pack='auto''s threshold",
    )
    ap.add_argument("--compile", action="store_true", help="only first-call (compile) times")
    ap.add_argument("--leaves", default="300,1000,3000", help="--compile: numbers of leaves")
    ap.add_argument("--legacy", action="store_true", help="--compile: the transport before")
    ap.add_argument("--num-steps", type=int, default=1, help="--compile: steps per call")
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    harness.log("\n".join(harness.environment_lines(harness.machine(), harness.versions())))
    auto_max = harness.PRIVATE.auto_max_elements()
    harness.log(f"pack='auto' packs leaves of at most {auto_max} elements")
    if args.compile:
        sizes = [int(x) for x in args.leaves.split(",")]
        rows = run_compile(sizes, args.repeats or 3, args.legacy, args.num_steps)
        header = ["case", "leaves", "pack", "first call s (median)", "spread", "× flat"]
        body = [
            [r["case"], str(r["leaves"]), r["pack"], f"{r['first_call_s']:.2f}"]
            + [f"{r['min_s']:.2f}–{r['max_s']:.2f}", f"{r['vs_flat']:.2f}"]
            for r in rows
        ]
        print("", *harness.table(header, "lrlrrr", body), sep="\n")
    elif args.sweep:
        sizes = [128, 256, 512, 1_024, 2_048, 4_096, 16_384]
        harness.log("leaf-size sweep: 48 leaves of each size with Adam (144 arrays), num_steps=1")
        rows = run_sweep(sizes, repeats, args.quick)
    else:
        rows = []
        for name, case in (
            ("a. narrow ResNet50 + adam", resnet_case),
            ("b. tiny MLP (~300 leaves) + adam", tiny_mlp_case),
            ("c. wide MLP + adam", wide_mlp_case),
        ):
            if name[0] in args.models:
                harness.log(f"running {name} ...")
                rows += run_case(name, case, args.quick, repeats)
        header = "model params arrays num_steps pack buffers".split() + [
            "host µs/call",
            "host × flat",
            "host CPU µs/call",
            "CPU × flat",
            "bare program µs/call",
            "µs/step (median)",
            "spread",
            "step × flat",
        ]
        f = harness.fmt
        body = [
            [r["model"], f"{r['params']:,}", str(r["arrays"]), str(r["num_steps"]), r["pack"]]
            + [str(r["buffers"]), f(r["host_us_per_call"]), f"{r['host_vs_flat']:.2f}"]
            + [f(r["host_cpu_us_per_call"]), f"{r['host_cpu_vs_flat']:.2f}"]
            + [f(r["bare_us_per_call"]), f(r["us_per_step"]), f"{f(r['min'])}–{f(r['max'])}"]
            + [f"{r['vs_flat']:.2f}"]
            for r in rows
        ]
        print("", *harness.table(header, "lrrrlr" + "r" * 8, body), sep="\n")
    if args.json:
        harness.write_json(rows, args.json)


if __name__ == "__main__":
    main()
