"""What every benchmark and example timing shares: one way of timing, of describing the
machine, and of rendering tables and charts.

Timing (`Method`, `check_and_time`): each way of running a step holds its own state. Before
any timing, every method runs the same steps on the same distinct inputs from the same initial
state, and methods that disagree are left out (`agree`). Then each is warmed up and its calls
per block chosen so a block takes about `block_s`; blocks run round-robin over the methods
(the order rotating every repeat), with a `gc.collect()` before each, calls back to back and
one `jax.block_until_ready` at the end. Every block continues from the state the method's
previous block returned: no method restarts from fresh arrays, so no copy is timed. Reported:
the median per-step time over the blocks and its spread (min-max).

Scripts import it as `from benchmarks import harness` with the repository root on `sys.path`
(`python benchmarks/report.py` and `python examples/train_digits.py` both put it there).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as md
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import autoflat

ROOT = Path(__file__).resolve().parent.parent
perf = time.perf_counter
US = 1e6
CHECK_STEPS = 10  # steps every method runs before timing, compared across methods
STRICT_STEPS = 3  # of which the first ones must agree to rtol()
RTOL_CPU = 1e-4
# On a GPU, XLA computes f32 convolutions and matmuls with TF32 by default: two programs of
# the same step (other fusions, other algorithms picked) then differ by about 2e-4 at once.
RTOL_ACCELERATOR = 1e-3


def rtol() -> float:
    """How far the first checked losses of two methods may differ: `RTOL_CPU` on a CPU,
    `RTOL_ACCELERATOR` elsewhere (see above)."""
    return RTOL_CPU if jax.default_backend() == "cpu" else RTOL_ACCELERATOR


def command(script: str, argv: Sequence[str]) -> str:
    """The command line to record in a results file: the output directory, a path of this
    machine, as `DIR`."""
    args = list(argv)
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            args[i + 1] = "DIR"
        elif a.startswith("--out="):
            args[i] = "--out=DIR"
    return " ".join(["python", script, *args])


def log(msg: str) -> None:
    print(msg, flush=True)


def parser(description: str, **model: int) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: `--quick`, `--repeats`,
    `--block-seconds`; and the model's, with these defaults (`width=2` gives `--width`,
    `batch_size=8` gives `--batch-size`, ...)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="short blocks, few repeats")
    ap.add_argument("--repeats", type=int, help="timed blocks per method")
    ap.add_argument("--block-seconds", type=float, help="target seconds a block")
    for name, default in model.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    return ap


# ==========================================================================================
# autoflat's private attributes: the only place benchmarks/ and examples/ touch them
# ==========================================================================================


def autoflat_private() -> SimpleNamespace:
    """Every private access of the benchmarks, in one place (autoflat's internals change:
    adjust them here). No public API gives these, and none should:

    - `buffers(handle)`: the device buffers a lazy handle holds (with `pack=`, the packed
      ones), to block on them: `jax.block_until_ready(handle)` would unpack a packed handle
      with a device call inside the timed block;
    - `handle_roundtrip(handles)`: a loop `loop(n) -> seconds` of what the fast path does
      with each state handle: read its structure, buffers and placement, and wrap a new
      handle around them (report section 1, the counterpart of flatten + unflatten);
    - `stub_compiled_call(step, *args)`: call `step(*args)`, then replace the step's
      `jax.jit` object (called as `fn(spec, *lowered.args)`) with a
      stub returning that call's outputs; returns the call's result (report section 1 times
      the Python call path without JAX's dispatch);
    - `bare_next_args(args, out)`: a step's bare program (`Compiled.jax`) chained: the
      flat arguments of its next launch, its state outputs in place of the state leaves of
      `args` (`Lowered.args`: state leaves, per-step inputs, broadcast leaves);
    - `auto_max_elements()`: the largest leaf `pack="auto"` packs (bench_transport prints it);
    - `roles_clock()`: the spans of the first calls' role inference (bench_first_call's
      "roles" phase).

    Nothing here runs before it is called: an import of the harness works whatever changed.
    """
    get = object.__getattribute__

    def handle_roundtrip(handles: list[Any]) -> Callable[[int], float]:
        new = type(handles[0])
        tails = [(get(h, "_af_origin"), get(h, "_af_param")) for h in handles]

        def loop(n: int) -> float:
            hs = handles
            t0 = perf()
            for _ in range(n):
                hs = [
                    new(get(h, "_af_structure"), get(h, "_af_arrays"), get(h, "_af_placement"), *t)
                    for h, t in zip(hs, tails, strict=True)
                ]
            return perf() - t0

        return loop

    def stub_compiled_call(step: Any, *args: Any) -> Any:
        real, outputs = step._jit, []

        def capture(*a: Any) -> Any:
            outputs.append(real(*a))
            return outputs[-1]

        step._jit = capture
        result = step(*args)
        step._jit = lambda *a: outputs[-1]
        return result

    def bare_next_args(args: tuple[Any, ...], out: Any) -> tuple[Any, ...]:
        state_out, _ = out  # [state arrays per argument, output leaves]
        return (tuple(state_out), *args[1:])

    def auto_max_elements() -> int:
        from autoflat._transport import layout as _transport

        return _transport.AUTO_MAX_ELEMENTS

    def roles_clock() -> list[tuple[float, float]]:
        """From now on, every first-call role inference (`_roles.infer.infer`, as the
        runtime calls it) appends its (start, end) `perf_counter` times to the list
        returned."""
        from autoflat._runtime import program

        spans: list[tuple[float, float]] = []
        infer = program.infer

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = perf()
            try:
                return infer(*a, **kw)
            finally:
                spans.append((t0, perf()))

        program.infer = timed  # type: ignore[assignment]
        return spans

    return SimpleNamespace(
        roles_clock=roles_clock,
        buffers=lambda h: list(get(h, "_af_arrays")),
        bare_next_args=bare_next_args,
        handle_roundtrip=handle_roundtrip,
        stub_compiled_call=stub_compiled_call,
        auto_max_elements=auto_max_elements,
    )


PRIVATE = autoflat_private()


def device_buffers(tree: Any) -> list[Any]:
    """The device buffers a state is made of, without creating any: a handle's own buffers
    (see `autoflat_private`), the array leaves of anything else."""
    out: list[Any] = []
    for x in tree if type(tree) in (tuple, list) else [tree]:
        if autoflat.is_handle(x):
            out += PRIVATE.buffers(x)
        else:
            out += [leaf for leaf in jax.tree_util.tree_leaves(x) if isinstance(leaf, jax.Array)]
    return out


# ==========================================================================================
# Arrays and figures
# ==========================================================================================


def fresh(tree: Any) -> Any:
    """Fresh buffers for every array leaf (a donating method never consumes another's)."""
    copy = lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array | np.ndarray) else x  # noqa: E731
    return jax.tree_util.tree_map(copy, tree)


def stack(trees: Sequence[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def repeat(tree: Any, k: int) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.stack([x] * k), tree)


def summary(values_s: Sequence[float], scale: float = US) -> dict[str, Any]:
    """Median, min, max and every value, times `scale` (default: seconds to µs)."""
    vals = [v * scale for v in values_s]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "all": vals}


def rotations(items: Sequence[Any], repeats: int) -> Iterator[tuple[int, list[Any]]]:
    """`items` once per repeat, the order rotating every repeat (round-robin)."""
    items = list(items)
    for rep in range(repeats):
        r = rep % len(items)
        yield rep, items[r:] + items[:r]


# ==========================================================================================
# Methods and their timing
# ==========================================================================================


@dataclass
class Plan:
    """How a method runs: `build()` makes its callable `fn` (timed apart by compile timings);
    a call is `*state, out = fn(*fixed, *state, *args)`, or `out = fn(*fixed, *args)` where
    `state` is empty (objects the step mutates go in `fixed`)."""

    build: Callable[[], Callable[..., Any]]
    state: tuple[Any, ...] = ()
    fixed: tuple[Any, ...] = ()


class Method:
    """One way of running a step, holding its own state from call to call and block to block.

    `make()` returns its `Plan` (fresh state, called once in `setup`). A method of k steps
    per call takes its inputs with a leading axis of k. Override `_loop` for other calling
    conventions.
    """

    def __init__(
        self,
        key: str,
        label: str,
        make: Callable[[], Plan],
        *,
        steps_per_call: int = 1,
        note: str = "",
    ):
        self.key, self.label, self.make = key, label, make
        self.steps_per_call, self.note = steps_per_call, note
        self.fn: Any = None
        self.state: tuple[Any, ...] = ()
        self.fixed: tuple[Any, ...] = ()
        self.args: tuple[Any, ...] = ()
        self.n_calls = 0
        self.totals: list[float] = []  # seconds per step, one per timed block
        self.dispatch: list[float] = []  # the same, before the block's final block_until_ready
        self.error: str | None = None
        self.check_losses: np.ndarray | None = None
        self.first_call_s: float | None = None
        self.extra: dict[str, Any] = {}

    def setup(self, args: tuple[Any, ...]) -> None:
        """Build the callable and the fresh state; `args` are one step's timed inputs."""
        plan = self.make()
        t0 = perf()
        self.fn = plan.build()
        self.extra["build_s"] = perf() - t0
        self.state, self.fixed = tuple(plan.state), tuple(plan.fixed)
        self.args = args if self.steps_per_call == 1 else repeat(args, self.steps_per_call)

    def _loop(self, n: int, args: tuple[Any, ...]) -> Any:
        """n calls on `args`, back to back, advancing the state; the last call's output."""
        f, fixed, out = self.fn, self.fixed, None
        if not self.state:
            a = fixed + args
            for _ in range(n):
                out = f(*a)
            return out
        s = self.state
        for _ in range(n):
            *s, out = f(*fixed, *s, *args)
        self.state = tuple(s)
        return out

    def call(self, *args: Any) -> Any:
        return self._loop(1, args)

    def ready(self, out: Any) -> None:
        jax.block_until_ready((device_buffers(self.state), out))

    def run(self, n: int) -> tuple[float, float]:
        """n timed calls: (seconds before the final `block_until_ready`, seconds in all).
        An autoflat step that carries handles must stay on its fast path while timed."""
        watch = isinstance(self.fn, autoflat.Step) and self.state
        before = autoflat.stats(self.fn) if watch else None
        t0 = perf()
        out = self._loop(n, self.args)
        t1 = perf()
        self.ready(out)
        t2 = perf()
        if before is not None:
            after = autoflat.stats(self.fn)
            if after.flattens != before.flattens or after.traces != before.traces:
                raise AssertionError(f"left the fast path while timed: {before} -> {after}")
            self.extra["autoflat_stats"] = str(after)
        return t1 - t0, t2 - t0

    def run_idle(self, n: int) -> tuple[float, float]:
        """Host time of one call with the device idle at its start (so it returns as soon as
        it has dispatched), mean of n: (wall seconds, CPU seconds of the calling thread)."""
        wall = cpu = 0.0
        out = None
        for _ in range(n):
            self.ready(out)
            w0, c0 = perf(), time.thread_time()
            out = self._loop(1, self.args)
            cpu += time.thread_time() - c0
            wall += perf() - w0
        self.ready(out)
        return wall / n, cpu / n

    def check(self, batches: Sequence[tuple[Any, ...]], pad: tuple[Any, ...]) -> np.ndarray:
        """Per-step losses of the first len(batches) steps from the initial state; a method
        of k steps per call gets chunks of k (padded with `pad`)."""
        k, n = self.steps_per_call, len(batches)
        batches = [*batches, *[pad] * (-n % k)]
        losses = []
        for i in range(0, len(batches), k):
            args = batches[i] if k == 1 else stack(batches[i : i + k])
            losses.append(np.reshape(np.asarray(self.call(*args)), (-1,)))
        return np.concatenate(losses)[:n]


def autoflat_method(
    key: str, step_fn: Callable[..., Any], state: Callable[[], Any], suffix: str = ""
) -> Method:
    """`autoflat_..._{k}[_nodonate][_pack|_auto]`: `autoflat.step` of `step_fn` with those
    options, from `state()`; the returned handles are passed back. The transport is always
    explicit (`pack=False` without a suffix), so rows mean the same whatever the default."""
    k = int(next(part for part in key.split("_") if part.isdigit()))
    options: dict[str, Any] = {"num_steps": k, "donate": "_nodonate" not in key}
    options["pack"] = True if key.endswith("_pack") else "auto" if key.endswith("_auto") else False
    defaults = (("donate", True), ("pack", False))
    shown = ", ".join(f"{o}={v!r}" for o, v in options.items() if (o, v) not in defaults)
    note = (
        f"autoflat.step({', '.join(f'{o}={v!r}' for o, v in options.items())})"
        f"({step_fn.__name__}); returned handles passed back"
        + (f"; inputs with a leading axis of {k}" if k > 1 else "")
        + {
            True: "; state leaves packed into one buffer per dtype",
            "auto": "; small state leaves packed per dtype (the default rule)",
            False: "; one buffer per state leaf",
        }[options["pack"]]
    )
    plan = lambda: Plan(lambda: autoflat.step(step_fn, **options), state())  # noqa: E731
    return Method(key, f"autoflat {shown}{suffix}", plan, steps_per_call=k, note=note)


def fail(m: Method, e: BaseException, when: str) -> None:
    m.error = f"{type(e).__name__}{when}: {e}"
    m.extra["traceback"] = "".join(traceback.format_exception(e))
    log(f"  {m.label}: FAILED{when} ({m.error.splitlines()[0][:300]}); left out of timing")


def first_calls(
    methods: list[Method],
    args: tuple[Any, ...],
    batches: Sequence[tuple[Any, ...]],
    jobs: int = 1,
) -> None:
    """Set up every method (serially), then run its checked first steps, which trace and
    compile it, `jobs` at a time (XLA compiles without holding the GIL)."""
    for m in methods:
        try:
            m.setup(args)
        except Exception as e:
            fail(m, e, " in setup")

    def first(m: Method) -> None:
        t0 = perf()
        try:
            m.check_losses = m.check(batches, args)
            m.first_call_s = perf() - t0
        except Exception as e:
            m.extra["first_error"] = e

    todo = [m for m in methods if m.error is None]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(first, todo))
    for m in todo:
        e = m.extra.pop("first_error", None)
        if e is not None:
            fail(m, e, " in its first calls")


def agree(methods: list[Method], n_checked: int) -> dict[str, Any]:
    """Compare the checked losses: one-step methods against the first one-step method (the
    loop reference), scanned methods against the hand-written scan (key `compute`, else the
    first scanned method), and that scan against the loop on its first loss only (a loop and
    a scan are different XLA programs, and rounding differences can grow within a few
    steps). A method that disagrees is failed."""
    ok = [m for m in methods if m.error is None and m.check_losses is not None]
    loops = [m for m in ok if m.steps_per_call == 1]
    scans = [m for m in ok if m.steps_per_call > 1]
    loop_ref = loops[0] if loops else None
    scan_ref = next((m for m in scans if m.key == "compute"), scans[0] if scans else None)
    agreement: dict[str, Any] = {}
    for m in ok:
        losses = m.check_losses
        assert losses is not None
        try:
            if not np.all(np.isfinite(losses)):
                raise AssertionError(f"non-finite losses {losses}")
            if m.steps_per_call == 1 or m is scan_ref:
                ref, strict = loop_ref, (STRICT_STEPS if m.steps_per_call == 1 else 1)
            else:
                ref, strict = scan_ref, STRICT_STEPS
            if ref is None or ref.check_losses is None:
                continue
            rel = np.abs(losses - ref.check_losses) / np.abs(ref.check_losses)
            a = agreement[m.key] = {
                "reference": ref.key,
                "losses": losses.tolist(),
                "compared_steps": strict,
                "max_rel_diff_compared": float(np.max(rel[:strict])),
                "max_rel_diff_all_steps": float(np.max(rel)),
            }
            if a["max_rel_diff_compared"] > rtol():
                raise AssertionError(
                    f"losses disagree with {ref.key}: {losses[:strict]} vs "
                    f"{ref.check_losses[:strict]} (max relative difference "
                    f"{a['max_rel_diff_compared']:.2e} > {rtol()} over the first {strict} step(s))"
                )
            log(
                f"  {m.label}: first call + {n_checked} checked steps in "
                f"{m.first_call_s or 0:.1f} s; vs {ref.key}: max rel. diff "
                f"{a['max_rel_diff_compared']:.1e} (first {strict}), "
                f"{a['max_rel_diff_all_steps']:.1e} (all {n_checked})"
            )
        except Exception as e:
            fail(m, e, "")
    return agreement


def calibrate(m: Method, block_s: float) -> None:
    """Warm up, then choose the calls per block (at least 2) so a block takes about
    `block_s`: probes of doubling length until one takes a tenth of a block."""
    _, total = m.run(1)
    probe = 1
    while total <= 0.1 * block_s and probe < 10_000:
        probe *= 2
        _, total = m.run(probe)
    if total < block_s:  # the fastest of three probes: a stray pause must not shrink blocks
        total = min(total, *(m.run(probe)[1] for _ in range(2)))
    m.n_calls = max(2, round(block_s * probe / total))


def time_methods(
    methods: list[Method], repeats: int, block_s: float, idle: bool = False, title: str = ""
) -> None:
    """Calibrate, then time `repeats` round-robin blocks of every method that has not
    failed. With `idle`, each block is followed by a quarter as many calls (at least 3),
    each started with the device idle (`Method.run_idle`): `extra["idle_wall"]` and
    `extra["idle_cpu"]`, seconds per call, one per block."""
    for m in methods:
        if m.error is None:
            try:
                calibrate(m, block_s)
            except Exception as e:
                fail(m, e, " while calibrating")
    timed = [m for m in methods if m.error is None]
    if not timed:
        return
    log(f"  {title}: {repeats} repeats of ~{block_s:g} s blocks over {len(timed)} methods")
    t_start = perf()
    for rep, order in rotations(timed, repeats):
        for m in order:
            if m.error is not None:
                continue
            gc.collect()
            try:
                dispatch, total = m.run(m.n_calls)
                if idle:
                    wall, cpu = m.run_idle(max(3, m.n_calls // 4))
                    m.extra.setdefault("idle_wall", []).append(wall)
                    m.extra.setdefault("idle_cpu", []).append(cpu)
            except Exception as e:
                fail(m, e, " during timing")
                continue
            steps = m.n_calls * m.steps_per_call
            m.totals.append(total / steps)
            m.dispatch.append(dispatch / steps)
        log(f"    repeat {rep + 1}/{repeats} done ({perf() - t_start:.0f} s)")


def check_and_time(
    title: str,
    methods: list[Method],
    args: tuple[Any, ...],
    batches: Sequence[tuple[Any, ...]],
    repeats: int,
    block_s: float,
    jobs: int = 1,
) -> dict[str, Any]:
    """Set up, check agreement on `batches`, calibrate and time a group of methods on `args`
    (one step's inputs). Returns the agreement figures."""
    t0 = perf()
    first_calls(methods, args, batches, jobs)
    log(f"  {title}: first calls (compiles) done in {perf() - t0:.0f} s, {jobs} at a time")
    agreement = agree(methods, len(batches))
    time_methods(methods, repeats, block_s, title=title)
    return {"agreement": agreement}


def method_rows(methods: list[Method]) -> list[dict[str, Any]]:
    """The figures of timed methods, one JSON-able row each."""
    rows = []
    for m in methods:
        row: dict[str, Any] = {
            "key": m.key,
            "method": m.label,
            "steps_per_call": m.steps_per_call,
            "note": m.note,
            "first_call_and_check_s": m.first_call_s,
        }
        if m.error is not None or not m.totals:
            row["error"] = m.error or "not timed"
        else:
            row["calls_per_block"] = m.n_calls
            row["us_per_step"] = summary(m.totals)
            row["dispatch_us_per_step"] = summary(m.dispatch)
            row["us_per_call_median"] = row["us_per_step"]["median"] * m.steps_per_call
        for k, v in m.extra.items():
            row[k] = summary(v) if k.startswith("idle_") else v
        rows.append(row)
    return rows


def _live_bytes() -> tuple[int, int]:
    arrs = jax.live_arrays()
    return sum(int(a.nbytes) for a in arrs), len(arrs)


def measure_memory(methods: list[Method]) -> dict[str, Any]:
    """Bytes of `jax.live_arrays()` held by each compiled, warm method's state across one
    call (donated buffers are deleted, so not live), in multiples of the state's size."""
    dev = jax.devices()[0]
    in_use = lambda: (dev.memory_stats() or {}).get("bytes_in_use")  # noqa: E731 - not on CPU
    rows = []
    for m in methods:
        if m.error is not None or m.key == "compute" or not m.state:
            continue
        row: dict[str, Any] = {"key": m.key, "method": m.label}
        try:
            prev = m.state
            state_bytes = sum(int(x.nbytes) for x in device_buffers(prev))
            gc.collect()
            b0, n0, use0 = *_live_bytes(), in_use()
            m.run(1)  # the caller still holds `prev`; donated buffers are deleted
            b1, n1, use1 = *_live_bytes(), in_use()
            del prev
            gc.collect()
            b2, _ = _live_bytes()
            held, steady = b1 - b0 + state_bytes, b2 - b0 + state_bytes
            row |= {
                "state_bytes": state_bytes,
                "held_across_call_bytes": held,
                "held_across_call_buffers_added": n1 - n0,
                "steady_bytes": steady,
                "held_in_states": held / state_bytes,
                "steady_in_states": steady / state_bytes,
                "memory_stats_bytes_in_use_delta": None if use0 is None else use1 - use0,
            }
            log(
                f"  memory {m.label}: held across a call {row['held_in_states']:.2f} states, "
                f"steady {row['steady_in_states']:.2f}"
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"  memory {m.label}: FAILED ({row['error'][:300]})")
        rows.append(row)
    stats = "" if in_use() is None else "; the JSON has memory_stats() deltas too"
    return {"method": "jax.live_arrays() total bytes" + stats, "rows": rows}


def time_compiles(
    method: Callable[[str], Method], keys: Sequence[str], repeats: int, args: tuple[Any, ...]
) -> list[dict[str, Any]]:
    """First calls from fresh function objects: per repeat and key, `method(key)` after
    `jax.clear_caches()` and `autoflat.clear_caches()`; its callable built ("make": for
    autoflat, the decoration), its first call (trace + compile + one call), a second call."""
    found: dict[str, dict[str, Any]] = {}
    times = ("make_s", "first_call_s", "second_call_s")
    for _ in range(repeats):
        for key in keys:
            m = method(key)
            r = found.setdefault(key, {"key": key, "method": m.label, **{t: [] for t in times}})
            if "error" in r:
                continue
            try:
                jax.clear_caches()
                autoflat.clear_caches()
                gc.collect()
                m.setup(args)
                t1 = perf()
                m.ready(m.call(*m.args))
                t2 = perf()
                m.ready(m.call(*m.args))
                t3 = perf()
                for t, value in zip(times, (m.extra["build_s"], t2 - t1, t3 - t2), strict=True):
                    r[t].append(value)
                log(
                    f"  compile {m.label}: make {m.extra['build_s']:.2f} s, first call "
                    f"{t2 - t1:.2f} s, second {1e3 * (t3 - t2):.1f} ms"
                )
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"
                log(f"  compile {m.label}: FAILED ({r['error'][:300]})")
    jax.clear_caches()
    autoflat.clear_caches()
    gc.collect()
    return [
        r if "error" in r else r | {t: summary(r[t], 1.0) for t in times} for r in found.values()
    ]


def roundtrip(value: Any) -> Callable[[int], float]:
    """A loop for `time_loops`: n rounds of `tree_flatten` + `tree_unflatten` of `value` (the
    host work `jax.jit` does on its arguments every call)."""

    def loop(n: int) -> float:
        v = value
        t0 = perf()
        for _ in range(n):
            leaves, treedef = jax.tree_util.tree_flatten(v)
            v = jax.tree_util.tree_unflatten(treedef, leaves)
        return perf() - t0

    return loop


def time_loops(
    loops: dict[str, Callable[[int], float]], n: int, repeats: int
) -> dict[str, list[float]]:
    """Round-robin timing of plain host loops: `loop(n)` runs n iterations and returns its
    seconds. Every loop is warmed up first. Returns the seconds of each repeat."""
    for loop in loops.values():
        loop(max(10, n // 100))
    times: dict[str, list[float]] = {key: [] for key in loops}
    for _, order in rotations(list(loops), repeats):
        for key in order:
            gc.collect()
            times[key].append(loops[key](n))
    return times


def write_json(obj: Any, path: str | Path) -> None:
    """Write `obj` as JSON, atomically (a crash leaves the previous file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


# ==========================================================================================
# The machine and the versions
# ==========================================================================================


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
        "n_devices": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_at_start": load_average(),
    }


def _git(*args: str) -> str:
    cmd = ["git", "-C", str(ROOT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10).stdout


def versions(
    packages: Sequence[str] = ("jax", "jaxlib", "equinox", "flax", "optax", "numpy", "libcst"),
) -> dict[str, str]:
    """Python's and the packages' versions, and the autoflat commit this checkout is at."""
    out = {"python": platform.python_version()}
    for pkg in (*packages, "autoflat"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = getattr(sys.modules.get(pkg), "__version__", "not installed")
    try:
        dirty = _git("status", "--porcelain", "--", "autoflat").strip()
        out["autoflat_commit"] = _git("rev-parse", "--short", "HEAD").strip() + (
            " (autoflat/ has uncommitted changes)" if dirty else ""
        )
    except Exception:
        out["autoflat_commit"] = "unknown"
    where = Path(autoflat.__file__).resolve().parent
    # Relative to this checkout when it is this checkout's autoflat (no machine paths in
    # committed results), else only that it is an installed copy.
    out["autoflat_path"] = (
        str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else "installed"
    )
    return out


def environment_lines(m: dict[str, Any], v: dict[str, str], end_load: Any = None) -> list[str]:
    """The machine and versions as Markdown list items."""
    lines = [
        f"- **Machine**: {m['platform']} ({m['processor']}), {m['cpu_count']} CPUs; JAX "
        f"backend {m['jax_backend']} ({m['device']} x{m['n_devices']})"
        + (f"; XLA_FLAGS={m['xla_flags']}" if m.get("xla_flags") else "")
    ]
    la = m.get("load_average_at_start")
    if la:
        busy = la[0] > 0.5 * (m["cpu_count"] or 1)
        lines.append(
            f"- **Load average** (1/5/15 min): {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} at start"
            + (
                f", {end_load[0]:.2f}/{end_load[1]:.2f}/{end_load[2]:.2f} at end"
                if end_load
                else ""
            )
            + (" — the machine was busy: absolute timings are noisy" if busy else "")
        )
    lines.append(
        "- **Versions**: " + ", ".join(f"{k} {x}" for k, x in v.items() if k != "autoflat_path")
    )
    return lines


# ==========================================================================================
# Markdown
# ==========================================================================================


def fmt(x: float | None) -> str:
    """Three significant digits or so; "–" for a missing figure."""
    if x is None or x != x:
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def spread(s: dict[str, Any]) -> str:
    return f"{fmt(s['min'])}–{fmt(s['max'])}"


def table(header: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """A Markdown table; `align` has one letter a column, "l" or "r"."""
    out = ["| " + " | ".join(header) + " |"]
    out.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def step_table(rows: list[dict[str, Any]], refs: list[tuple[str, str]]) -> list[str]:
    """Markdown for a group of timed methods (`method_rows`); `refs`: (key, column title) for
    ratios of per-step time. With a `compute` row, an overhead column: step time minus it."""
    ok = {r["key"]: r for r in rows if "us_per_step" in r}
    compute = ok["compute"]["us_per_step"]["median"] if "compute" in ok else None
    header = ["method", "µs/step (median)", "spread (min–max)"]
    header += ["overhead µs/step"] if compute is not None else []
    header += [f"× {title}" for _, title in refs] + ["µs/call", "steps/call"]
    body = []
    for r in rows:
        if "us_per_step" not in r:
            err = str(r.get("error", "not run")).splitlines()[0][:160].replace("|", "\\|")
            body.append([r["method"], f"failed: {err}", *[""] * (len(header) - 2)])
            continue
        med = r["us_per_step"]["median"]
        cells = [r["method"], fmt(med), spread(r["us_per_step"])]
        if compute is not None:
            cells.append("(compute)" if r["key"] == "compute" else fmt(med - compute))
        for key, _ in refs:
            cells.append(f"{med / ok[key]['us_per_step']['median']:.2f}" if key in ok else "–")
        body.append([*cells, fmt(r["us_per_call_median"]), str(r["steps_per_call"])])
    return table(header, "l" + "r" * (len(header) - 1), body)


def memory_table(mem: dict[str, Any]) -> list[str]:
    """Markdown for `measure_memory`'s figures."""
    body = [
        [
            x["method"],
            f"{x['held_in_states']:.2f}",
            f"{x['held_across_call_bytes']:,}",
            f"{x['steady_in_states']:.2f}",
            f"{x['state_bytes']:,}",
        ]
        if "error" not in x
        else [x["method"], "failed", "", "", ""]
        for x in mem["rows"]
    ]
    source = f" ({mem['source']})" if "source" in mem else ""
    return [
        f'Memory{source}: measured with {mem["method"]}. "Held across a '
        "call\": the state's live bytes right after one call while the caller still holds "
        "the previous state (donated buffers are deleted and do not count), i.e. what a "
        'step needs at its peak besides temporaries; "steady": after the previous state '
        "is dropped. In multiples of the state's size (about 2 without donation, 1 with).",
        "",
        *table(
            ["method", "held across a call (states)", "bytes", "steady (states)", "state bytes"],
            "lrrrr",
            body,
        ),
    ]


def notes_list(rows: list[dict[str, Any]]) -> list[str]:
    return [f"- **{r['method']}**: {r['note']}" for r in rows if r.get("note")]


def agreement_line(agreement: dict[str, Any]) -> str:
    parts = [
        f"{k} vs {v['reference']} {v['max_rel_diff_compared']:.0e} (first "
        f"{v['compared_steps']}) / {v['max_rel_diff_all_steps']:.0e}"
        for k, v in agreement.items()
        if k != v["reference"]
    ]
    return (
        f"Agreement before timing (max relative loss difference over the compared steps / over "
        f"all {CHECK_STEPS} checked steps; tolerance {rtol():g}): " + ", ".join(parts) + ". "
        "Loop and scan programs are compared on the first step only (rounding differences "
        "between the two XLA programs grow within a few steps on these narrow models)."
    )


# ==========================================================================================
# Charts (matplotlib, imported only here)
# ==========================================================================================


def figure(rows: int, cols: int, size: tuple[float, float], title: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size)
    fig.suptitle(title, fontsize=13)
    return fig, axes


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0, 1, 0.97))
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def not_run(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def hbars(
    ax: Any,
    labels: list[str],
    stats: list[dict[str, Any]],
    color: Any,
    title: str,
    xlabel: str,
    log: bool = True,
) -> None:
    """Horizontal bars of medians with min-max error bars (`summary` dicts)."""
    med = [s["median"] for s in stats]
    err = np.array(
        [[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]]
    )
    y = np.arange(len(labels))
    ax.barh(y, med, xerr=err, color=color, capsize=3, alpha=0.85)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    for yi, s in zip(y, stats, strict=True):
        ax.text(s["max"], yi, f"  {fmt(s['median'])}", va="center", fontsize=7)
    ax.margins(x=0.12)


def step_bars(ax: Any, group: dict[str, Any] | None, title: str) -> None:
    """`hbars` of a group's µs per step: compute green, autoflat blue, the rest red."""
    rows = [x for x in (group or {}).get("rows", []) if "us_per_step" in x]
    if not rows:
        return not_run(ax, title)
    colors = {"compute": "tab:green", "single_buffer": "tab:gray"}
    hbars(
        ax,
        [x["method"] for x in rows],
        [x["us_per_step"] for x in rows],
        [
            colors.get(x["key"], "tab:blue" if x["key"].startswith("autoflat") else "tab:red")
            for x in rows
        ],
        title,
        "µs per step (log; median, min–max)",
    )
    comp = next((x for x in rows if x["key"] == "compute"), None)
    if comp:
        ax.axvline(comp["us_per_step"]["median"], color="tab:green", ls="--", lw=1)


def lines(ax: Any, series: list[tuple[str, Any, str, list[int], list[dict[str, Any]]]]) -> None:
    """Error-bar lines: (label, color, format, xs, `summary` dicts) each."""
    for label, color, style, xs, stats in series:
        if xs:
            med = [s["median"] for s in stats]
            lo = [s["median"] - s["min"] for s in stats]
            hi = [s["max"] - s["median"] for s in stats]
            ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, color=color, label=label, capsize=3)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
