"""The autoflat benchmark report: four sections, side by side in one process.

    python benchmarks/report.py                 # the full run (about 10-20 min on 2 CPU cores)
    python benchmarks/report.py --quick         # short blocks, few repeats (a few minutes)
    python benchmarks/report.py --out DIR       # default: benchmarks/results/
    python benchmarks/report.py --sections 2,3  # a subset (1 seed, 2 steps, 3 leaves, 4 compile)

Writes `report.md` (Markdown tables), `report.json` (every figure, every repeat) and
`report.png` (charts) into the output folder. `report.json` is rewritten after every section,
so a crash late in the run keeps what came before; a section that fails is reported (with its
traceback in the JSON) and the others still run; the exit status is then 1.

Every timed figure is the median over repeats with the spread (min-max) next to it. The
header records the machine (platform, CPU count, load average at start and end), Python and
package versions and the autoflat commit.

Sections
--------

1. **The seed tutorial's measurement today** (PAX's "Improve performance" tutorial): N
   iterations (default 10,000; `--quick` 300) of `tree_flatten` + `tree_unflatten` of the state
   of a ResNet50-structured Equinox model (`models.make_model`) and its `optax.adam` state:
   naive `(model, opt_state)`; "optimizer flattened" (the model tree plus the optimizer's leaf
   list, what PAX's `flatten=True` optimizer gives); "model flattened" (two leaf lists only);
   and autoflat. For autoflat two figures: (a) the handle round trip: what autoflat's fast
   path reads from each returned lazy handle (its interned structure, leaf list and placement)
   plus wrapping a leaf list in a new handle for each output, i.e. the exact counterpart of
   flatten + unflatten; (b) the whole Python call path of `autoflat.step` (binding, fast
   path, spec lookup, handle creation, counters) with the compiled call replaced by a stub
   that returns the previous outputs, so JAX's own dispatch is not in it. The step used for
   (b) has a trivial body (it returns its state) but the same roles and state trees as a real
   step, so the call path is the same. Flax is imported in this process, so autoflat's Flax
   NNX checks run on every call (as in any program that imports Flax).

2. **Per-step host overhead of a whole training step**, narrow ResNet50-structured models
   with Adam, one process, blocks round-robin. Equinox (`models.NarrowResNet50`, the step of
   `bench_overhead.py`): plain `jax.jit` (model partitioned once outside, combined inside; no
   donation), the same with `donate_argnums=(0, 1)` (the "partition once, jit the dynamic part
   with donation, combine inside" loop), `eqx.filter_jit`, Equinox's documented "Low-overhead
   training loops" recipe (docs/tricks.md: `tree_flatten` model and optimizer state once,
   `eqx.filter_jit` a step that takes the two leaf lists, unflattens inside and returns
   `tree_leaves` of both; as written there, no donation), the hand-written flat-leaves recipe
   (array leaves only, `jax.jit`, donated), autoflat `num_steps` 1 (also with
   `donate=False`, and with `pack=True` where this autoflat has it), 10 and 100, and the
   single-buffer floor (all array leaves packed into ONE f32 buffer, donated, sliced and
   reshaped inside, packed again on the way out: the best case for a call's host cost).
   Flax NNX (`nnx_models.NarrowResNet50`, same structure, NHWC) with the mutation-style
   `train_step(model, optimizer, x, y)`: `nnx.jit` (graph mode, Flax 0.12's default), `nnx.jit(
   graph=False)` (tree mode), `nnx.cached_partial` (graph mode + graph_updates, as its
   docstring), `nnx.jit_partial` (tree mode, as its docstring), the functional split/merge
   loop of Flax's performance guide (`nnx.split` once, `jax.jit` taking `graphdef, state`,
   `nnx.merge` inside, `nnx.state` out; no donation, as written there), autoflat `num_steps` 1
   and 10 on the same mutation-style step, and autoflat 1 and 10 on the functional step that
   returns `model, optimizer, loss` (handles passed back). Each table also has the device
   compute per step, estimated by a jitted `lax.scan` of 100 steps on flat leaves (donated);
   "overhead" is step time minus that.

3. **Overhead against the number of leaves** (10 ... 3000): a state of that many small f32
   arrays (8 elements each) with the update `x * 0.99 + g` (`g` a per-step scalar input):
   `jax.jit` without and with donation against autoflat `num_steps` 1 and 10 (and 1 with
   `pack=True` where available; with `--quick` only up to 300 leaves, as XLA's compile time
   for packing thousands of leaves grows super-linearly: about 2 min at 3000 on 2 cores).

4. **Compile time and memory.** Compile: first-call wall time (trace + compile + one step)
   of the Equinox step of section 2 under `jax.jit`, `jax.jit` + donation, `eqx.filter_jit`,
   the hand-written flat-leaves recipe, autoflat 1 and 10, and a hand-written `jax.jit` of a
   10-step `lax.scan` (`--quick`: `jax.jit`, autoflat 1 and 10, once), each from fresh
   function objects after `jax.clear_caches()` and `autoflat.clear_caches()`, with JAX's
   persistent compilation cache disabled; building the callable is timed apart ("make": for
   autoflat, the decoration, which parses the source and generates code). Memory, with and
   without donation: measured on section 2's Equinox methods after their timing (already
   compiled; if section 2 is not run, on five of them compiled here). `memory_stats()` is
   unavailable on CPU, so it counts the bytes of `jax.live_arrays()` (donated buffers are
   deleted, so not live): right after a call while the caller still holds the previous state
   (what a step holds at its peak besides temporaries, in state sizes: about 2 without
   donation, 1 with), and after the previous state is dropped.

Method: before any timing, every method of sections 2 and 3 runs the same steps on the same
distinct inputs from the same initial state (10 steps; a method of k > 10 steps per call gets
them padded with the timing batch). One-step methods must agree with the first one
(`jax.jit` / `nnx.jit`) on the first three losses to a relative 1e-4; scanned methods with the
hand-written `lax.scan` ("device compute") likewise; that scan with the loop on the first
loss only (a loop and a scan are different XLA programs, and these narrow models amplify
rounding differences within a few steps). The maximum difference over all checked steps is
reported too. A method that disagrees or fails is reported and left out of the timing. These
first calls (which compile) run `--jobs` at a time (default 2: XLA compiles without holding
the GIL); nothing is timed then except each method's own first call, for information. Each
method is then warmed up and its calls per block chosen so a block takes about
`--block-seconds`; blocks run round-robin over the methods (the order rotating every repeat)
with a `gc.collect()` before each, calls back to back, and one `jax.block_until_ready` at the
end of the block.

Other options: `--repeats`, `--block-seconds`, `--iterations` (section 1), `--width`,
`--batch-size`, `--image-size`, `--nnx-batchnorm` (the NNX model with `nnx.BatchNorm`),
`--jobs 1` (compile serially), `--render-only` (rewrite report.md and report.png from the
report.json in `--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata as md
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

try:
    import autoflat
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(_HERE.parent))
    import autoflat

import models as eqx_models  # noqa: E402

try:
    import nnx_models
    from flax import nnx

    _NNX_ERROR = ""
except Exception as e:  # pragma: no cover - Flax missing or broken
    nnx = None  # type: ignore[assignment]
    nnx_models = None  # type: ignore[assignment]
    _NNX_ERROR = f"{type(e).__name__}: {e}"

warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"flax(\..*)?")

perf = time.perf_counter
US = 1e6
SWEEP_LEAVES = (10, 30, 100, 300, 1000, 3000)
CHECK_STEPS = 10
STRICT_STEPS = 3
RTOL = 1e-4


def _disable_persistent_cache() -> None:
    for name, value in (
        ("jax_enable_compilation_cache", False),
        ("jax_compilation_cache_dir", None),
    ):
        with contextlib.suppress(Exception):
            jax.config.update(name, value)


_disable_persistent_cache()


# ==========================================================================================
# The steps
# ==========================================================================================

eqx_tx = optax.adam(1e-3)


def eqx_update(model, opt_state, batch):
    """The Equinox training step of `bench_overhead.py`."""
    loss, grads = eqx.filter_value_and_grad(eqx_models.loss_fn)(model, batch)
    updates, opt_state = eqx_tx.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def passthrough(model, opt_state, batch):
    """A step with a trivial body and the roles of `eqx_update` (section 1's call path)."""
    loss = jnp.zeros(())
    return model, opt_state, loss


def sweep_update(state, g):
    """Section 3: a trivial update of every leaf."""
    state = [x * 0.99 + g for x in state]
    return state


# ==========================================================================================
# Helpers
# ==========================================================================================


def _copy(tree: Any) -> Any:
    """Fresh buffers for every array leaf (a donating method never consumes another's)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def _stack(batches: Sequence[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *batches)


def _repeat(batch: Any, k: int) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.stack([x] * k), batch)


def _device_buffers(tree: Any) -> list[Any]:
    """The device buffers a state is made of, without creating any: for an autoflat lazy
    handle, the buffers it holds (`_af_arrays`: with pack=True, the packed buffers; flattening
    such a handle would unpack them with a device call); for anything else, its array leaves."""
    items = tree if type(tree) in (tuple, list) else [tree]
    out: list[Any] = []
    for x in items:
        if autoflat.is_handle(x):
            try:
                out += list(object.__getattribute__(x, "_af_arrays"))
                continue
            except AttributeError:
                pass
        out += [leaf for leaf in jax.tree_util.tree_leaves(x) if isinstance(leaf, jax.Array)]
    return out


def _summary(values_s: Sequence[float], scale: float = US) -> dict[str, Any]:
    vals = [v * scale for v in values_s]
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "all": vals,
    }


def _fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _fmt_s(x: float) -> str:
    """Seconds, three significant digits."""
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _spread(s: dict[str, Any]) -> str:
    return f"{_fmt(s['min'])}–{_fmt(s['max'])}"


def _log(msg: str) -> None:
    print(msg, flush=True)


class FlatLayout:
    """A tree held as (treedef, static leaves, array positions): flatten once, rebuild inside."""

    def __init__(self, tree: Any):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        self.treedef = treedef
        self.pos = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
        self.static = [None if eqx.is_array(x) else x for x in leaves]
        self.arrays = [leaves[i] for i in self.pos]

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        full = list(self.static)
        for i, a in zip(self.pos, arrays, strict=True):
            full[i] = a
        return jax.tree_util.tree_unflatten(self.treedef, full)

    def arrays_of(self, tree: Any) -> list[Any]:
        leaves = jax.tree_util.tree_leaves(tree)
        return [leaves[i] for i in self.pos]


class Packing(FlatLayout):
    """The array leaves packed into one f32 buffer (integer leaves, Adam's count, are exact
    in f32 below 2**24)."""

    def __init__(self, tree: Any):
        super().__init__(tree)
        self.shapes = [tuple(a.shape) for a in self.arrays]
        self.dtypes = [a.dtype for a in self.arrays]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = np.cumsum([0, *self.sizes]).tolist()

    def pack(self, arrays: Sequence[Any]) -> jax.Array:
        return jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in arrays])

    def unpack(self, buf: jax.Array) -> list[Any]:
        out = []
        for o, n, s, d in zip(self.offsets, self.sizes, self.shapes, self.dtypes, strict=False):
            out.append(jax.lax.slice(buf, (o,), (o + n,)).reshape(s).astype(d))
        return out


# ==========================================================================================
# The timing harness
# ==========================================================================================


class Method:
    """One way of running a step. Holds its own state between blocks.

    Subclasses set `self.batch` (the input of one timed call) and define `setup()`,
    `_call(arg)` (one call on `arg`, advancing the state, returning the loss or losses) and
    `run(n)` (n calls back to back: returns seconds before the final `block_until_ready`,
    and in all).
    """

    def __init__(self, key: str, label: str, steps_per_call: int = 1, note: str = ""):
        self.key = key
        self.label = label
        self.steps_per_call = steps_per_call
        self.note = note
        self.n_calls = 0
        self.totals: list[float] = []  # seconds per step, one per repeat
        self.dispatch: list[float] = []
        self.error: str | None = None
        self.check_losses: np.ndarray | None = None
        self.first_call_s: float | None = None
        self.extra: dict[str, Any] = {}
        self.batch: Any = None

    def setup(self) -> None:
        raise NotImplementedError

    def _call(self, arg: Any) -> Any:
        raise NotImplementedError

    def run(self, n: int) -> tuple[float, float]:
        raise NotImplementedError

    def check(self, batches: list[Any], pad: Any) -> np.ndarray:
        """Per-step losses of the first len(batches) steps, from the initial state. A method
        with k steps per call gets chunks of k (padded with `pad` up to k)."""
        k = self.steps_per_call
        batches = list(batches)
        n = len(batches)
        if n % k:
            batches += [pad] * (k - n % k)
        losses = []
        for i in range(0, len(batches), k):
            chunk = batches[i : i + k]
            arg = chunk[0] if k == 1 else _stack(chunk)
            losses.append(np.reshape(np.asarray(self._call(arg)), (-1,)))
        return np.concatenate(losses)[:n]


def calibrate(m: Method, block_s: float) -> None:
    m.run(3)
    probe = 1
    while True:
        _, total = m.run(probe)
        if total > 0.1 * block_s or probe >= 10_000:
            break
        probe *= 2
    # The fastest of three probes: a stray pause must not shrink the timed blocks.
    per_call = min(total, *(m.run(probe)[1] for _ in range(2))) / probe
    m.n_calls = max(2, round(block_s / per_call))


def _fail(m: Method, e: BaseException, when: str) -> None:
    m.error = f"{type(e).__name__}{when}: {e}"
    m.extra["traceback"] = "".join(traceback.format_exception(e))
    _log(f"  {m.label}: FAILED{when} ({m.error.splitlines()[0][:300]}); left out of timing")


def _first_calls(methods: list[Method], batches: list[Any], pad: Any, jobs: int) -> None:
    """Set up every method (serially, in this thread), then run its checked first steps, which
    trace and compile it: `jobs` at a time (XLA compiles without holding the GIL). Nothing is
    timed while this runs except each method's own first-call time, for information."""
    for m in methods:
        try:
            m.setup()
        except Exception as e:
            _fail(m, e, " in setup")

    def first(m: Method) -> None:
        t0 = perf()
        try:
            m.check_losses = m.check(batches, pad)
            m.first_call_s = perf() - t0
        except Exception as e:
            m.extra["first_error"] = e

    todo = [m for m in methods if m.error is None]
    if jobs > 1 and len(todo) > 1:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(first, todo))
    else:
        for m in todo:
            first(m)
    for m in todo:
        e = m.extra.pop("first_error", None)
        if e is not None:
            _fail(m, e, " in its first calls")


def _agree(methods: list[Method], n_checked: int) -> dict[str, Any]:
    """Compare the checked losses. One-step methods against the first one-step method (the
    loop reference); scanned methods against the hand-written scan (key `compute`, or else
    the first scanned method), and that scan against the loop on its first loss only: a
    loop and a scan are different XLA programs, and rounding differences grow within a few
    steps on these narrow models."""
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
            agreement[m.key] = {
                "reference": ref.key,
                "losses": losses.tolist(),
                "compared_steps": strict,
                "max_rel_diff_compared": float(np.max(rel[:strict])),
                "max_rel_diff_all_steps": float(np.max(rel)),
            }
            if float(np.max(rel[:strict])) > RTOL:
                raise AssertionError(
                    f"losses disagree with {ref.key}: {losses[:strict]} vs "
                    f"{ref.check_losses[:strict]} (max relative difference "
                    f"{np.max(rel[:strict]):.2e} > {RTOL} over the first {strict} step(s))"
                )
            _log(
                f"  {m.label}: first call + {n_checked} checked steps in "
                f"{m.first_call_s or 0:.1f} s; vs {ref.key}: max rel. diff "
                f"{agreement[m.key]['max_rel_diff_compared']:.1e} (first {strict}), "
                f"{agreement[m.key]['max_rel_diff_all_steps']:.1e} (all {n_checked})"
            )
        except Exception as e:
            _fail(m, e, "")
    return agreement


def check_and_time(
    title: str,
    methods: list[Method],
    batches: list[Any],
    pad: Any,
    repeats: int,
    block_s: float,
    jobs: int = 1,
) -> dict[str, Any]:
    """Set up, check agreement, calibrate and time a group of methods. Returns the figures."""
    t0 = perf()
    _first_calls(methods, batches, pad, jobs)
    _log(f"  {title}: first calls (compiles) done in {perf() - t0:.0f} s, {jobs} at a time")
    agreement = _agree(methods, len(batches))
    timed = [m for m in methods if m.error is None]
    for m in timed:
        try:
            calibrate(m, block_s)
        except Exception as e:
            _fail(m, e, " while calibrating")
    timed = [m for m in timed if m.error is None]
    if timed:
        _log(f"  {title}: {repeats} repeats of ~{block_s:g} s blocks over {len(timed)} methods")
    t_start = perf()
    for rep in range(repeats):
        order = timed[rep % len(timed) :] + timed[: rep % len(timed)]
        for m in order:
            if m.error is not None:
                continue
            gc.collect()
            try:
                dispatch, total = m.run(m.n_calls)
            except Exception as e:
                _fail(m, e, " during timing")
                continue
            steps = m.n_calls * m.steps_per_call
            m.totals.append(total / steps)
            m.dispatch.append(dispatch / steps)
        _log(f"    repeat {rep + 1}/{repeats} done ({perf() - t_start:.0f} s)")
    return {"agreement": agreement}


def method_rows(methods: list[Method]) -> list[dict[str, Any]]:
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
            if "traceback" in m.extra:
                row["traceback"] = m.extra["traceback"]
        else:
            row["calls_per_block"] = m.n_calls
            row["us_per_step"] = _summary(m.totals)
            row["dispatch_us_per_step"] = _summary(m.dispatch)
            row["us_per_call_median"] = row["us_per_step"]["median"] * m.steps_per_call
        for k, v in m.extra.items():
            if k != "traceback":
                row[k] = v
        rows.append(row)
    return rows


# ==========================================================================================
# Section 2 (Equinox) methods
# ==========================================================================================


class EqxState2(Method):
    """Methods whose loop is `a, b, loss = f(a, b, batch)`."""

    fn: Callable[..., Any]
    state: tuple[Any, Any]

    def _call(self, arg: Any) -> Any:
        a, b, loss = self.fn(*self.state, arg)
        self.state = (a, b)
        return loss

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        a, b = self.state
        t0 = perf()
        for _ in range(n):
            a, b, loss = f(a, b, batch)
        t1 = perf()
        jax.block_until_ready((_device_buffers((a, b)), loss))
        t2 = perf()
        self.state = (a, b)
        return t1 - t0, t2 - t0


class EqxState1(Method):
    """Methods whose loop is `s, loss = f(s, batch)`."""

    fn: Callable[..., Any]
    state: Any

    def _call(self, arg: Any) -> Any:
        self.state, loss = self.fn(self.state, arg)
        return loss

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        s = self.state
        t0 = perf()
        for _ in range(n):
            s, loss = f(s, batch)
        t1 = perf()
        jax.block_until_ready((s, loss))
        t2 = perf()
        self.state = s
        return t1 - t0, t2 - t0


class EqxSetup:
    """The shared initial state and batches of the Equinox methods."""

    def __init__(self, width: int, batch_size: int, image_size: int):
        key = jax.random.PRNGKey(0)
        k_model, k_batch, k_check = jax.random.split(key, 3)
        self.model = eqx_models.make_model(k_model, width=width)
        self.opt_state = eqx_tx.init(eqx.filter(self.model, eqx.is_array))
        self.batch = eqx_models.make_batch(k_batch, batch_size, image_size)
        self.check_batches = [
            eqx_models.make_batch(k, batch_size, image_size)
            for k in jax.random.split(k_check, CHECK_STEPS)
        ]

    def fresh(self) -> tuple[Any, Any]:
        return _copy((self.model, self.opt_state))


class EqxPlainJit(EqxState2):
    def __init__(self, s: EqxSetup, donate: bool):
        if donate:
            super().__init__(
                "jit_donate",
                "jax.jit + donate (partition once, combine inside)",
                note="params, static = eqx.partition(model, eqx.is_array) once; jax.jit("
                "donate_argnums=(0, 1)) of a step doing eqx.combine(params, static) inside",
            )
        else:
            super().__init__(
                "jit",
                "jax.jit (partition outside)",
                note="as above, without donation (jax.jit's default)",
            )
        self.s, self.donate = s, donate

    def setup(self) -> None:
        model, opt_state = self.s.fresh()
        params, static = eqx.partition(model, eqx.is_array)

        def step(params, opt_state, batch):
            model = eqx.combine(params, static)
            model, opt_state, loss = eqx_update(model, opt_state, batch)
            return eqx.filter(model, eqx.is_array), opt_state, loss

        self.fn = jax.jit(step, donate_argnums=(0, 1) if self.donate else ())
        self.state = (params, opt_state)
        self.batch = self.s.batch


class EqxFilterJit(EqxState2):
    def __init__(self, s: EqxSetup):
        super().__init__("filter_jit", "eqx.filter_jit", note="called with the model itself")
        self.s = s

    def setup(self) -> None:
        self.fn = eqx.filter_jit(eqx_update)
        self.state = self.s.fresh()
        self.batch = self.s.batch


class EqxDocsRecipe(EqxState2):
    def __init__(self, s: EqxSetup):
        super().__init__(
            "eqx_recipe",
            "Equinox docs recipe (flat leaves + filter_jit)",
            note="Equinox docs 'Low-overhead training loops': tree_flatten model and opt_state "
            "once; eqx.filter_jit step takes both leaf lists, unflattens inside, returns "
            "tree_leaves; no donation (as written)",
        )
        self.s = s

    def setup(self) -> None:
        model, opt_state = self.s.fresh()
        flat_model, treedef_model = jax.tree_util.tree_flatten(model)
        flat_opt_state, treedef_opt_state = jax.tree_util.tree_flatten(opt_state)

        @eqx.filter_jit
        def make_step(flat_model, flat_opt_state, batch):
            model = jax.tree_util.tree_unflatten(treedef_model, flat_model)
            opt_state = jax.tree_util.tree_unflatten(treedef_opt_state, flat_opt_state)
            model, opt_state, loss = eqx_update(model, opt_state, batch)
            return jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(opt_state), loss

        self.fn = make_step
        self.state = (flat_model, flat_opt_state)
        self.batch = self.s.batch


class EqxHandFlat(EqxState1):
    def __init__(self, s: EqxSetup):
        super().__init__(
            "hand_flat",
            "hand-written flat leaves (jax.jit + donate)",
            note="(model, opt_state) flattened once; the array leaves travel as one list "
            "(donated), non-array leaves and treedef closed over; unflatten inside",
        )
        self.s = s

    def setup(self) -> None:
        layout = FlatLayout(self.s.fresh())

        def body(arrays, batch):
            model, opt_state = layout.rebuild(arrays)
            model, opt_state, loss = eqx_update(model, opt_state, batch)
            return layout.arrays_of((model, opt_state)), loss

        self.fn = jax.jit(body, donate_argnums=0)
        self.state = layout.arrays
        self.batch = self.s.batch


class EqxSingleBuffer(EqxState1):
    def __init__(self, s: EqxSetup):
        super().__init__(
            "single_buffer",
            "single-buffer floor (one packed f32 buffer)",
            note="every array leaf packed into ONE f32 buffer (donated); sliced, reshaped and "
            "cast inside, packed again on the way out: one state buffer in, one out",
        )
        self.s = s

    def setup(self) -> None:
        packing = Packing(self.s.fresh())

        def body(buf, batch):
            model, opt_state = packing.rebuild(packing.unpack(buf))
            model, opt_state, loss = eqx_update(model, opt_state, batch)
            return packing.pack(packing.arrays_of((model, opt_state))), loss

        self.fn = jax.jit(body, donate_argnums=0)
        self.state = packing.pack(packing.arrays)
        self.extra["buffer_elements"] = int(self.state.size)
        self.batch = self.s.batch


def _has_pack() -> bool:
    """Whether this autoflat has the `pack=` option (state packed into per-dtype buffers)."""
    try:
        return "pack" in inspect.signature(autoflat.step).parameters
    except (TypeError, ValueError):
        return False


class EqxAutoflat(EqxState2):
    def __init__(self, s: EqxSetup, k: int, donate: bool = True, pack: bool = False):
        extra = ("" if donate else ", donate=False") + (", pack=True" if pack else "")
        super().__init__(
            f"autoflat_{k}" + ("" if donate else "_nodonate") + ("_pack" if pack else ""),
            f"autoflat num_steps={k}{extra}",
            steps_per_call=k,
            note=f"autoflat.step(num_steps={k}{extra})(update); returned handles passed back"
            + (f"; batch with a leading axis of {k}" if k > 1 else "")
            + ("; state leaves packed into one buffer per dtype" if pack else ""),
        )
        self.s, self.k, self.donate, self.pack = s, k, donate, pack

    def setup(self) -> None:
        options: dict[str, Any] = {"num_steps": self.k, "donate": self.donate}
        if self.pack:
            options["pack"] = True
        self.fn = autoflat.step(**options)(eqx_update)
        self.state = self.s.fresh()
        self.batch = self.s.batch if self.k == 1 else _repeat(self.s.batch, self.k)

    def run(self, n: int) -> tuple[float, float]:
        before = autoflat.stats(self.fn)
        out = super().run(n)
        after = autoflat.stats(self.fn)
        if after.flattens != before.flattens or after.traces != before.traces:
            raise AssertionError(f"left the fast path while timed: {before} -> {after}")
        self.extra["autoflat_stats"] = str(after)
        return out


class EqxCompute(EqxState1):
    def __init__(self, s: EqxSetup, k: int):
        super().__init__(
            "compute",
            f"device compute (lax.scan of {k}, flat leaves)",
            steps_per_call=k,
            note=f"jax.jit of a lax.scan of {k} steps on the flat array leaves (donated): the "
            "host cost of one call shared by k steps; an estimate of the compute per step",
        )
        self.s, self.k = s, k

    def setup(self) -> None:
        layout = FlatLayout(self.s.fresh())

        def body(arrays, batch):
            model, opt_state = layout.rebuild(arrays)
            model, opt_state, loss = eqx_update(model, opt_state, batch)
            return layout.arrays_of((model, opt_state)), loss

        self.fn = jax.jit(lambda a, bs: jax.lax.scan(body, a, bs), donate_argnums=0)
        self.state = layout.arrays
        self.batch = _repeat(self.s.batch, self.k)


# ==========================================================================================
# Section 2 (Flax NNX) methods
# ==========================================================================================


class NnxSetup:
    def __init__(self, width: int, batch_size: int, image_size: int, batchnorm: bool):
        self.width, self.batchnorm = width, batchnorm
        key = jax.random.PRNGKey(1)
        k_batch, k_check = jax.random.split(key)
        self.batch = nnx_models.make_batch(k_batch, batch_size, image_size)
        self.check_batches = [
            nnx_models.make_batch(k, batch_size, image_size)
            for k in jax.random.split(k_check, CHECK_STEPS)
        ]

    def fresh(self) -> tuple[Any, Any]:
        model = nnx_models.make_model(seed=0, width=self.width, batchnorm=self.batchnorm)
        return model, nnx_models.make_optimizer(model)


class NnxMutation(Method):
    """Loop: `loss = f(model, optimizer, x, y)` (the objects are updated in place)."""

    fn: Callable[..., Any]

    def _call(self, arg: Any) -> Any:
        return self.fn(self.model, self.optimizer, *arg)

    def run(self, n: int) -> tuple[float, float]:
        f, (x, y) = self.fn, self.batch
        model, optimizer = self.model, self.optimizer
        t0 = perf()
        for _ in range(n):
            loss = f(model, optimizer, x, y)
        t1 = perf()
        jax.block_until_ready(loss)
        t2 = perf()
        return t1 - t0, t2 - t0


class NnxJit(NnxMutation):
    def __init__(self, s: NnxSetup, graph: bool):
        if graph:
            super().__init__(
                "nnx_jit",
                "nnx.jit (graph mode, the default)",
                note="nnx.jit(train_step): graph=True, graph_updates=True are Flax 0.12's "
                "defaults; no donation",
            )
        else:
            super().__init__(
                "nnx_jit_tree",
                "nnx.jit(graph=False) (tree mode)",
                note="modules treated as pytrees; no donation",
            )
        self.s, self.graph = s, graph

    def setup(self) -> None:
        self.model, self.optimizer = self.s.fresh()
        if self.graph:
            self.fn = nnx.jit(nnx_models.train_step)
        else:
            self.fn = nnx.jit(nnx_models.train_step, graph=False)
        self.batch = self.s.batch


class NnxPartial(Method):
    """Loop: `loss = f(x, y)` (model and optimizer bound in a partial)."""

    fn: Callable[..., Any]

    def _call(self, arg: Any) -> Any:
        return self.fn(*arg)

    def run(self, n: int) -> tuple[float, float]:
        f, (x, y) = self.fn, self.batch
        t0 = perf()
        for _ in range(n):
            loss = f(x, y)
        t1 = perf()
        jax.block_until_ready(loss)
        t2 = perf()
        return t1 - t0, t2 - t0


class NnxCachedPartial(NnxPartial):
    def __init__(self, s: NnxSetup):
        super().__init__(
            "cached_partial",
            "nnx.cached_partial (graph mode)",
            note="nnx.cached_partial(nnx.jit(train_step, graph=True, graph_updates=True), "
            "model, optimizer) under set_graph_mode(True), set_graph_updates(True), as its "
            "docstring",
        )
        self.s = s

    def setup(self) -> None:
        self.model, self.optimizer = self.s.fresh()
        jitted = nnx.jit(nnx_models.train_step, graph=True, graph_updates=True)
        with nnx.set_graph_mode(True), nnx.set_graph_updates(True):
            self.fn = nnx.cached_partial(jitted, self.model, self.optimizer)
        self.batch = self.s.batch


class NnxJitPartial(NnxPartial):
    def __init__(self, s: NnxSetup):
        super().__init__(
            "jit_partial",
            "nnx.jit_partial (tree mode)",
            note="nnx.jit_partial(train_step, model, optimizer, graph=False), as its docstring",
        )
        self.s = s

    def setup(self) -> None:
        if not hasattr(nnx, "jit_partial"):
            raise RuntimeError("nnx.jit_partial does not exist in this Flax")
        self.model, self.optimizer = self.s.fresh()
        self.fn = nnx.jit_partial(nnx_models.train_step, self.model, self.optimizer, graph=False)
        self.batch = self.s.batch


class NnxSplitMerge(Method):
    def __init__(self, s: NnxSetup):
        super().__init__(
            "split_merge",
            "split/merge loop (jax.jit on state)",
            note="Flax performance guide's functional loop: graphdef, state = nnx.split(("
            "model, optimizer)) once; jax.jit(step)(graphdef, state, x, y) merges inside and "
            "returns nnx.state(...); no donation (as written)",
        )
        self.s = s

    def setup(self) -> None:
        model, optimizer = self.s.fresh()
        self.graphdef, self.state = nnx.split((model, optimizer))

        @jax.jit
        def jax_train_step(graphdef, state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss = nnx_models.train_step(model, optimizer, x, y)
            return loss, nnx.state((model, optimizer))

        self.fn = jax_train_step
        self.batch = self.s.batch

    def _call(self, arg: Any) -> Any:
        loss, self.state = self.fn(self.graphdef, self.state, *arg)
        return loss

    def run(self, n: int) -> tuple[float, float]:
        f, (x, y), g = self.fn, self.batch, self.graphdef
        state = self.state
        t0 = perf()
        for _ in range(n):
            loss, state = f(g, state, x, y)
        t1 = perf()
        jax.block_until_ready((loss, state))
        t2 = perf()
        self.state = state
        return t1 - t0, t2 - t0


class NnxAutoflatMutation(NnxMutation):
    def __init__(self, s: NnxSetup, k: int):
        super().__init__(
            f"autoflat_mut_{k}",
            f"autoflat num_steps={k} (mutation style)",
            steps_per_call=k,
            note=f"autoflat.step(train_step, num_steps={k}) called with the caller's model and "
            "optimizer every time (written back in place after each call, as nnx.jit does)",
        )
        self.s, self.k = s, k

    def setup(self) -> None:
        self.model, self.optimizer = self.s.fresh()
        self.fn = autoflat.step(nnx_models.train_step, num_steps=self.k)
        self.batch = self.s.batch if self.k == 1 else _repeat(self.s.batch, self.k)


class NnxAutoflatFunctional(Method):
    def __init__(self, s: NnxSetup, k: int):
        super().__init__(
            f"autoflat_fn_{k}",
            f"autoflat num_steps={k} (functional, handles)",
            steps_per_call=k,
            note=f"autoflat.step(functional_train_step, num_steps={k}): returns model, "
            "optimizer, loss; the returned handles are passed back",
        )
        self.s, self.k = s, k

    def setup(self) -> None:
        self.state = self.s.fresh()
        self.fn = autoflat.step(nnx_models.functional_train_step, num_steps=self.k)
        self.batch = self.s.batch if self.k == 1 else _repeat(self.s.batch, self.k)

    def _call(self, arg: Any) -> Any:
        m, o, loss = self.fn(*self.state, *arg)
        self.state = (m, o)
        return loss

    def run(self, n: int) -> tuple[float, float]:
        f, (x, y) = self.fn, self.batch
        m, o = self.state
        before = autoflat.stats(f)
        t0 = perf()
        for _ in range(n):
            m, o, loss = f(m, o, x, y)
        t1 = perf()
        jax.block_until_ready((_device_buffers((m, o)), loss))
        t2 = perf()
        self.state = (m, o)
        after = autoflat.stats(f)
        if after.flattens != before.flattens or after.traces != before.traces:
            raise AssertionError(f"left the fast path while timed: {before} -> {after}")
        self.extra["autoflat_stats"] = str(after)
        return t1 - t0, t2 - t0


class NnxCompute(Method):
    def __init__(self, s: NnxSetup, k: int):
        super().__init__(
            "compute",
            f"device compute (lax.scan of {k}, split/merge)",
            steps_per_call=k,
            note=f"jax.jit of a lax.scan of {k} split/merge steps (state donated): an estimate "
            "of the compute per step",
        )
        self.s, self.k = s, k

    def setup(self) -> None:
        model, optimizer = self.s.fresh()
        graphdef, self.state = nnx.split((model, optimizer))

        def body(state, xy):
            model, optimizer = nnx.merge(graphdef, state)
            loss = nnx_models.train_step(model, optimizer, *xy)
            return nnx.state((model, optimizer)), loss

        self.fn = jax.jit(lambda s, xy: jax.lax.scan(body, s, xy), donate_argnums=0)
        self.batch = _repeat(self.s.batch, self.k)

    def _call(self, arg: Any) -> Any:
        self.state, loss = self.fn(self.state, arg)
        return loss

    def run(self, n: int) -> tuple[float, float]:
        f, batch = self.fn, self.batch
        s = self.state
        t0 = perf()
        for _ in range(n):
            s, loss = f(s, batch)
        t1 = perf()
        jax.block_until_ready((s, loss))
        t2 = perf()
        self.state = s
        return t1 - t0, t2 - t0


# ==========================================================================================
# Section 3 methods
# ==========================================================================================


class Sweep(Method):
    """A state of `n_leaves` small arrays; the loop is `s = f(s, g)`."""

    def __init__(self, n_leaves: int, kind: str):
        labels = {
            "jit": "jax.jit",
            "jit_donate": "jax.jit + donate",
            "autoflat_1": "autoflat num_steps=1",
            "autoflat_10": "autoflat num_steps=10",
            "autoflat_1_pack": "autoflat num_steps=1, pack=True",
        }
        k = 10 if kind == "autoflat_10" else 1
        super().__init__(kind, labels[kind], steps_per_call=k)
        self.n_leaves, self.kind = n_leaves, kind

    def setup(self) -> None:
        base = jnp.arange(8, dtype=jnp.float32) / 8
        self.state = [base + i for i in range(self.n_leaves)]
        if self.kind == "jit":
            self.fn = jax.jit(sweep_update)
        elif self.kind == "jit_donate":
            self.fn = jax.jit(sweep_update, donate_argnums=0)
        elif self.kind == "autoflat_1_pack":
            self.fn = autoflat.step(sweep_update, pack=True)
        else:
            self.fn = autoflat.step(sweep_update, num_steps=self.steps_per_call)
        g = jnp.asarray(0.01, jnp.float32)
        self.batch = g if self.steps_per_call == 1 else jnp.full((10,), 0.01, jnp.float32)

    def _call(self, arg: Any) -> Any:
        self.state = self.fn(self.state, arg)
        leaves = jax.tree_util.tree_leaves(self.state)
        # One number per call that depends on every leaf: the "loss" compared across methods.
        return np.float64(sum(float(x[0]) for x in leaves[:: max(1, len(leaves) // 50)]))

    def check(self, batches: list[Any], pad: Any) -> np.ndarray:
        # Ten steps with distinct inputs; compared on the final state (per call for k = 1).
        gs = [jnp.asarray(0.01 * (i + 1), jnp.float32) for i in range(CHECK_STEPS)]
        if self.steps_per_call == 1:
            vals = [self._call(g) for g in gs]
        else:
            vals = [self._call(jnp.stack(gs))]
        return np.asarray(vals[-1:], dtype=np.float64)

    def run(self, n: int) -> tuple[float, float]:
        f, g = self.fn, self.batch
        s = self.state
        t0 = perf()
        for _ in range(n):
            s = f(s, g)
        t1 = perf()
        jax.block_until_ready(_device_buffers(s))
        t2 = perf()
        self.state = s
        return t1 - t0, t2 - t0


# ==========================================================================================
# Sections
# ==========================================================================================


def section_seed(
    args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]
) -> dict[str, Any]:
    """Section 1: the PAX tutorial's flatten/unflatten measurement, today."""
    n_iter = cfg["iterations"]
    repeats = cfg["seed_repeats"]
    s = EqxSetup(args.width, args.batch_size, args.image_size)
    net, opt = s.model, s.opt_state
    model_leaves = eqx_models.count_leaves(net)
    state_leaves = eqx_models.count_leaves((net, opt))
    opt_leaves = jax.tree_util.tree_leaves(opt)
    net_leaves = jax.tree_util.tree_leaves(net)

    flatten, unflatten = jax.tree_util.tree_flatten, jax.tree_util.tree_unflatten

    def naive(n: int) -> float:
        net_, opt_ = net, opt
        t0 = perf()
        for _ in range(n):
            a, b = flatten((net_, opt_))
            net_, opt_ = unflatten(b, a)
        return perf() - t0

    def opt_flat(n: int) -> float:
        net_, opt_ = net, list(opt_leaves)
        t0 = perf()
        for _ in range(n):
            a, b = flatten((net_, opt_))
            net_, opt_ = unflatten(b, a)
        return perf() - t0

    def model_flat(n: int) -> float:
        net_, opt_ = list(net_leaves), list(opt_leaves)
        t0 = perf()
        for _ in range(n):
            a, b = flatten((net_, opt_))
            net_, opt_ = unflatten(b, a)
        return perf() - t0

    variants: list[tuple[str, str, str, Callable[[int], float] | None, str]] = [
        (
            "naive",
            "naive: (model, opt_state)",
            f"{state_leaves['leaves']} leaves, full trees",
            naive,
            "tree_flatten((model, opt_state)) + tree_unflatten",
        ),
        (
            "optimizer_flattened",
            "optimizer flattened: (model, opt leaf list)",
            f"{model_leaves['leaves']} model leaves in a tree + {len(opt_leaves)} in a list",
            opt_flat,
            "the model tree plus the optimizer state as a list of leaves (PAX flatten=True)",
        ),
        (
            "model_flattened",
            "model flattened: (model leaf list, opt leaf list)",
            f"{len(net_leaves)} + {len(opt_leaves)} leaves in two lists",
            model_flat,
            "two leaf lists only (the tutorial's flatten_update loop)",
        ),
    ]

    # autoflat: real handles from a real call of a trivial-body step with the same roles.
    notes: dict[str, str] = {}
    af_rows: list[tuple[str, str, str, Callable[[int], float] | None, str]] = []
    try:
        step = autoflat.step(passthrough)
        m_h, o_h, _ = step(*s.fresh(), s.batch)
        m_h, o_h, _ = step(m_h, o_h, s.batch)
        if not (autoflat.is_handle(m_h) and autoflat.is_handle(o_h)):
            raise RuntimeError("autoflat did not return lazy handles")
        handle_type = type(m_h)
        origin = object.__getattribute__(m_h, "_af_origin")

        def handle_roundtrip(n: int) -> float:
            m, o = m_h, o_h
            get = object.__getattribute__
            t0 = perf()
            for _ in range(n):
                # What the fast path reads from each state argument ...
                sm, am, pm = get(m, "_af_structure"), get(m, "_af_arrays"), get(m, "_af_placement")
                so, ao, po = get(o, "_af_structure"), get(o, "_af_arrays"), get(o, "_af_placement")
                # ... and what it does with each state output: wrap the leaf list.
                m = handle_type(sm, am, pm, origin, "model")
                o = handle_type(so, ao, po, origin, "opt_state")
            return perf() - t0

        handle_roundtrip(2)  # the private layout is as expected
        af_rows.append(
            (
                "autoflat_handles",
                "autoflat handles: read leaf lists + wrap new handles",
                "2 handles (structure + leaf list each); no tree traversal",
                handle_roundtrip,
                "per state argument: read the handle's interned structure, leaf list and "
                "placement (what the fast path reads); per state output: a new LazyHandle "
                "around the leaf list",
            )
        )

        # The whole call path, with the compiled call stubbed out.
        real_jit = step._jit
        captured: dict[str, Any] = {}

        def capture(*a: Any) -> Any:
            captured["out"] = real_jit(*a)
            return captured["out"]

        def stub(*a: Any) -> Any:
            return captured["out"]

        step._jit = capture
        m_h, o_h, _ = step(m_h, o_h, s.batch)
        jax.block_until_ready((m_h, o_h))
        step._jit = stub
        batch = s.batch

        current = {"state": (m_h, o_h)}  # handles are consumed: carry the latest ones

        def call_path(n: int) -> float:
            m, o = current["state"]
            before = autoflat.stats(step)
            t0 = perf()
            for _ in range(n):
                m, o, _loss = step(m, o, batch)
            dt = perf() - t0
            current["state"] = (m, o)
            after = autoflat.stats(step)
            if after.flattens != before.flattens or after.fast_path - before.fast_path != 2 * n:
                raise AssertionError(f"the stubbed calls left the fast path: {before} -> {after}")
            return dt

        call_path(2)
        af_rows.append(
            (
                "autoflat_call_path",
                "autoflat.step call path (compiled call stubbed)",
                "2 handles in, 2 out, plus the batch",
                call_path,
                "the whole Python of Step.__call__ for (model handle, opt handle, batch) with "
                "the jitted call replaced by a stub returning the previous outputs: binding, "
                "fast path, spec lookup, Flax checks, new handles, counters. JAX's own "
                "dispatch (per-buffer work in C++) is not included",
            )
        )
    except Exception as e:
        notes["autoflat"] = f"autoflat rows skipped: {type(e).__name__}: {e}"
        _log(f"  {notes['autoflat']}")

    all_variants = variants + af_rows
    results: dict[str, list[float]] = {key: [] for key, *_ in all_variants}
    for _, _label, _, fn, _ in all_variants:
        assert fn is not None
        fn(max(10, n_iter // 100))  # warm up
    t_start = perf()
    for rep in range(repeats):
        for key, _, _, fn, _ in (
            all_variants[rep % len(all_variants) :] + all_variants[: rep % len(all_variants)]
        ):
            assert fn is not None
            gc.collect()
            results[key].append(fn(n_iter))
        _log(f"    repeat {rep + 1}/{repeats} done ({perf() - t_start:.0f} s)")

    tutorial_s = {"naive": 40.00, "optimizer_flattened": 8.34, "model_flattened": 0.63}
    rows = []
    naive_med = statistics.median(results["naive"])
    for key, label, what, _, how in all_variants:
        secs = results[key]
        rows.append(
            {
                "key": key,
                "variant": label,
                "what": what,
                "how": how,
                "iterations": n_iter,
                "seconds_per_N": _summary(secs, 1.0),
                "us_per_iteration": _summary([x / n_iter for x in secs]),
                "x_naive": statistics.median(secs) / naive_med,
                "tutorial_seconds_per_10000": tutorial_s.get(key),
            }
        )
    return {
        "model_leaves": model_leaves,
        "state_leaves": state_leaves,
        "opt_state_leaves": len(opt_leaves),
        "iterations": n_iter,
        "repeats": repeats,
        "rows": rows,
        "notes": notes,
    }


def section_steps(
    args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]
) -> dict[str, Any]:
    """Section 2: per-step host overhead of a whole training step (Equinox, then Flax NNX)."""
    out: dict[str, Any] = {}
    s = EqxSetup(args.width, args.batch_size, args.image_size)
    eqx_methods: list[Method] = [
        EqxPlainJit(s, donate=False),
        EqxPlainJit(s, donate=True),
        EqxFilterJit(s),
        EqxDocsRecipe(s),
        EqxHandFlat(s),
        EqxSingleBuffer(s),
        EqxAutoflat(s, 1),
        EqxAutoflat(s, 1, donate=False),
        *([EqxAutoflat(s, 1, pack=True)] if _has_pack() else []),
        EqxAutoflat(s, 10),
        EqxAutoflat(s, 100),
        EqxCompute(s, 100),
    ]
    _log("  Equinox:")
    eq = check_and_time(
        "Equinox",
        eqx_methods,
        s.check_batches,
        s.batch,
        cfg["repeats"],
        cfg["block_s"],
        cfg["jobs"],
    )
    memory = measure_memory(eqx_methods)
    out["equinox"] = {
        "model_leaves": eqx_models.count_leaves(s.model),
        "state_leaves": eqx_models.count_leaves((s.model, s.opt_state)),
        "rows": method_rows(eqx_methods),
        "memory": memory,
        **eq,
    }
    del eqx_methods, s
    gc.collect()

    if nnx is None:
        out["nnx"] = {"error": f"Flax NNX unavailable: {_NNX_ERROR}"}
        return out
    ns = NnxSetup(args.width, args.batch_size, args.image_size, args.nnx_batchnorm)
    nnx_methods: list[Method] = [
        NnxJit(ns, graph=True),
        NnxJit(ns, graph=False),
        NnxCachedPartial(ns),
        NnxJitPartial(ns),
        NnxSplitMerge(ns),
        NnxAutoflatMutation(ns, 1),
        NnxAutoflatMutation(ns, 10),
        NnxAutoflatFunctional(ns, 1),
        NnxAutoflatFunctional(ns, 10),
        NnxCompute(ns, 100),
    ]
    _log("  Flax NNX:")
    nn = check_and_time(
        "Flax NNX",
        nnx_methods,
        ns.check_batches,
        ns.batch,
        cfg["repeats"],
        cfg["block_s"],
        cfg["jobs"],
    )
    m0, o0 = ns.fresh()
    out["nnx"] = {
        "leaves": nnx_models.count_leaves(m0, o0),
        "model_leaves": nnx_models.count_leaves(m0),
        "batchnorm": args.nnx_batchnorm,
        "graph_mode_default": bool(nnx.set_graph_mode.current_value())
        if hasattr(nnx, "set_graph_mode")
        else None,
        "rows": method_rows(nnx_methods),
        **nn,
    }
    return out


def section_leaves(
    args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]
) -> dict[str, Any]:
    """Section 3: overhead against the number of leaves."""
    out: dict[str, Any] = {"leaves": list(cfg["sweep_leaves"]), "by_leaves": {}}
    for n in cfg["sweep_leaves"]:
        _log(f"  {n} leaves:")
        methods: list[Method] = [
            Sweep(n, "jit"),
            Sweep(n, "jit_donate"),
            Sweep(n, "autoflat_1"),
            Sweep(n, "autoflat_10"),
            *(
                [Sweep(n, "autoflat_1_pack")]
                if _has_pack() and n <= cfg["sweep_pack_max_leaves"]
                else []
            ),
        ]
        res = check_and_time(
            f"{n} leaves",
            methods,
            [None] * CHECK_STEPS,
            None,
            cfg["repeats"],
            cfg["sweep_block_s"],
            cfg["jobs"],
        )
        out["by_leaves"][str(n)] = {"rows": method_rows(methods), **res}
        del methods
        gc.collect()
    return out


def _live_bytes() -> tuple[int, int]:
    arrs = jax.live_arrays()
    return sum(int(a.nbytes) for a in arrs), len(arrs)


def measure_memory(methods: list[Method]) -> dict[str, Any]:
    """Device memory held by each method's state across one call, with the method already
    compiled and warm. Counts `jax.live_arrays()` bytes (deleted, i.e. donated, buffers are
    not live); also `memory_stats()` where the backend has it (not on CPU)."""
    dev = jax.devices()[0]
    stats_available = bool(dev.memory_stats())
    rows = []
    for m in methods:
        if m.error is not None or m.key == "compute" or not hasattr(m, "state"):
            continue
        row: dict[str, Any] = {"key": m.key, "method": m.label}
        try:
            prev = m.state
            prev_bytes = sum(int(x.nbytes) for x in _device_buffers(prev))
            gc.collect()
            b0, n0 = _live_bytes()
            in_use0 = dev.memory_stats().get("bytes_in_use") if stats_available else None
            m.run(1)  # the caller still holds `prev`; donated buffers are deleted
            b1, n1 = _live_bytes()
            in_use1 = dev.memory_stats().get("bytes_in_use") if stats_available else None
            del prev
            gc.collect()
            b2, n2 = _live_bytes()
            row.update(
                {
                    "state_bytes": prev_bytes,
                    "held_across_call_bytes": b1 - b0 + prev_bytes,
                    "held_across_call_buffers_added": n1 - n0,
                    "steady_bytes": b2 - b0 + prev_bytes,
                    "held_in_states": (b1 - b0 + prev_bytes) / prev_bytes,
                    "steady_in_states": (b2 - b0 + prev_bytes) / prev_bytes,
                    "memory_stats_bytes_in_use_delta": None
                    if in_use0 is None or in_use1 is None
                    else in_use1 - in_use0,
                }
            )
            _log(
                f"  memory {m.label}: held across a call {row['held_in_states']:.2f} states, "
                f"steady {row['steady_in_states']:.2f}"
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            _log(f"  memory {m.label}: FAILED ({row['error'][:300]})")
        rows.append(row)
    return {
        "method": "device memory_stats()"
        if stats_available
        else "jax.live_arrays() total bytes (memory_stats() is unavailable on this backend)",
        "memory_stats_available": stats_available,
        "rows": rows,
    }


def section_compile_memory(
    args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]
) -> dict[str, Any]:
    """Section 4: first-call (compile) time, and memory with and without donation."""
    s = EqxSetup(args.width, args.batch_size, args.image_size)
    batch10 = _repeat(s.batch, 10)

    def flat_body(layout: FlatLayout) -> Callable[..., Any]:
        def body(arrays, batch):
            model, opt_state = layout.rebuild(arrays)
            model, opt_state, loss = eqx_update(model, opt_state, batch)
            return layout.arrays_of((model, opt_state)), loss

        return body

    # Each variant prepares its arguments (untimed) and returns a factory that builds the
    # callable (timed as "make": for autoflat that is the decoration, parsing and codegen).
    Prepared = tuple[Callable[[], Callable[..., Any]], tuple[Any, ...]]
    Make = Callable[[], Prepared]

    def plain(donate: bool) -> Make:
        def make() -> Prepared:
            model, opt_state = s.fresh()
            params, static = eqx.partition(model, eqx.is_array)

            def step(params, opt_state, batch):
                model = eqx.combine(params, static)
                model, opt_state, loss = eqx_update(model, opt_state, batch)
                return eqx.filter(model, eqx.is_array), opt_state, loss

            return (
                lambda: jax.jit(step, donate_argnums=(0, 1) if donate else ()),
                (params, opt_state, s.batch),
            )

        return make

    def filter_jit() -> Prepared:
        return lambda: eqx.filter_jit(eqx_update), (*s.fresh(), s.batch)

    def hand_flat() -> Prepared:
        layout = FlatLayout(s.fresh())
        body = flat_body(layout)
        return lambda: jax.jit(body, donate_argnums=0), (layout.arrays, s.batch)

    def hand_scan() -> Prepared:
        layout = FlatLayout(s.fresh())
        body = flat_body(layout)
        return (
            lambda: jax.jit(lambda a, bs: jax.lax.scan(body, a, bs), donate_argnums=0),
            (layout.arrays, batch10),
        )

    def af(k: int) -> Make:
        def make() -> Prepared:
            batch = s.batch if k == 1 else batch10
            return lambda: autoflat.step(eqx_update, num_steps=k), (*s.fresh(), batch)

        return make

    variants: list[tuple[str, str, Make]] = [
        ("jit", "jax.jit (partition outside)", plain(False)),
        ("jit_donate", "jax.jit + donate", plain(True)),
        ("filter_jit", "eqx.filter_jit", filter_jit),
        ("hand_flat", "hand-written flat leaves (jax.jit + donate)", hand_flat),
        ("autoflat_1", "autoflat num_steps=1", af(1)),
        ("hand_scan_10", "hand-written jax.jit(lax.scan) of 10 steps", hand_scan),
        ("autoflat_10", "autoflat num_steps=10", af(10)),
    ]
    if cfg["quick"]:
        keep = {"jit", "autoflat_1", "autoflat_10"}
        variants = [v for v in variants if v[0] in keep]
    compile_res: dict[str, dict[str, list[float]]] = {
        k: {"make": [], "first": [], "second": []} for k, _, _ in variants
    }
    errors: dict[str, str] = {}
    for _rep in range(cfg["compile_repeats"]):
        for key, label, make in variants:
            if key in errors:
                continue
            try:
                jax.clear_caches()
                autoflat.clear_caches()
                gc.collect()
                factory, call_args = make()
                t0 = perf()
                f = factory()
                t1 = perf()
                out = f(*call_args)
                jax.block_until_ready(out)
                t2 = perf()
                call_args = (*out[:-1], call_args[-1])
                out = f(*call_args)
                jax.block_until_ready(out)
                t3 = perf()
                compile_res[key]["make"].append(t1 - t0)
                compile_res[key]["first"].append(t2 - t1)
                compile_res[key]["second"].append(t3 - t2)
                _log(
                    f"  compile {label}: make {t1 - t0:.2f} s, first call {t2 - t1:.2f} s, "
                    f"second {1e3 * (t3 - t2):.1f} ms"
                )
                del f, factory, out, call_args
            except Exception as e:
                errors[key] = f"{type(e).__name__}: {e}"
                _log(f"  compile {label}: FAILED ({errors[key][:300]})")
    compile_rows = []
    for key, label, _ in variants:
        r = compile_res[key]
        row: dict[str, Any] = {"key": key, "method": label}
        if key in errors or not r["first"]:
            row["error"] = errors.get(key, "not run")
        else:
            row["make_s"] = _summary(r["make"], 1.0)
            row["first_call_s"] = _summary(r["first"], 1.0)
            row["second_call_s"] = _summary(r["second"], 1.0)
        compile_rows.append(row)
    jax.clear_caches()
    autoflat.clear_caches()
    gc.collect()

    # --- memory: section 2's Equinox methods, already compiled; else a few compiled here ---
    memory = done.get("steps", {}).get("equinox", {}).get("memory")
    if memory is not None:
        memory = {**memory, "source": "measured on section 2's Equinox methods, after timing"}
    else:
        methods: list[Method] = [
            EqxPlainJit(s, donate=False),
            EqxPlainJit(s, donate=True),
            EqxHandFlat(s),
            EqxAutoflat(s, 1),
            EqxAutoflat(s, 1, donate=False),
        ]
        _first_calls(methods, s.check_batches[:2], s.batch, cfg["jobs"])
        memory = {**measure_memory(methods), "source": "measured here (section 2 not run)"}
    memory["state_arrays"] = eqx_models.count_leaves((s.model, s.opt_state))["arrays"]
    return {
        "compile": {"repeats": cfg["compile_repeats"], "rows": compile_rows},
        "memory": memory,
    }


# ==========================================================================================
# Environment, Markdown, chart
# ==========================================================================================


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in (
        "jax",
        "jaxlib",
        "equinox",
        "flax",
        "optax",
        "numpy",
        "libcst",
        "matplotlib",
        "autoflat",
    ):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = getattr(sys.modules.get(pkg), "__version__", "not installed")
    repo = _HERE.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "autoflat"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        out["autoflat_commit"] = commit + (" (autoflat/ has uncommitted changes)" if dirty else "")
    except Exception:
        out["autoflat_commit"] = "unknown"
    where = Path(autoflat.__file__).resolve().parent
    # Relative to this checkout when it is this checkout's autoflat (no machine paths in
    # the committed results), else only whether it is an installed copy.
    out["autoflat_path"] = (
        str(where.relative_to(_HERE.parent)) if where.is_relative_to(_HERE.parent) else "installed"
    )
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
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _table(header: list[str], align: str, rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |"]
    out.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _step_table(rows: list[dict[str, Any]], ref_keys: list[tuple[str, str]]) -> list[str]:
    """Markdown for a group of timed methods; ref_keys: (key, column title) for ratios."""
    ok = {r["key"]: r for r in rows if "us_per_step" in r}
    compute = ok.get("compute")
    compute_us = compute["us_per_step"]["median"] if compute else None
    header = ["method", "µs/step (median)", "spread (min–max)", "overhead µs/step"]
    header += [f"× {title}" for _, title in ref_keys]
    header += ["µs/call", "steps/call"]
    body = []
    for r in rows:
        if "us_per_step" not in r:
            err = str(r.get("error", "not run")).splitlines()[0][:160].replace("|", "\\|")
            body.append([r["method"], f"failed: {err}", "", "", *[""] * len(ref_keys), "", ""])
            continue
        med = r["us_per_step"]["median"]
        over = (
            "(compute)"
            if r["key"] == "compute"
            else _fmt(med - compute_us if compute_us is not None else None)
        )
        ratios = []
        for key, _ in ref_keys:
            ratios.append(f"{med / ok[key]['us_per_step']['median']:.2f}" if key in ok else "–")
        body.append(
            [
                r["method"],
                _fmt(med),
                _spread(r["us_per_step"]),
                over,
                *ratios,
                _fmt(r["us_per_call_median"]),
                str(r["steps_per_call"]),
            ]
        )
    return _table(header, "l" + "r" * (len(header) - 1), body)


def _notes_list(rows: list[dict[str, Any]]) -> list[str]:
    return [f"- **{r['method']}**: {r['note']}" for r in rows if r.get("note")]


def _agreement_line(agreement: dict[str, Any]) -> str:
    parts = [
        f"{k} vs {v['reference']} {v['max_rel_diff_compared']:.0e} (first "
        f"{v['compared_steps']}) / {v['max_rel_diff_all_steps']:.0e}"
        for k, v in agreement.items()
        if k != v["reference"]
    ]
    return (
        f"Agreement before timing (max relative loss difference over the compared steps / over "
        f"all {CHECK_STEPS} checked steps; tolerance {RTOL:g}): " + ", ".join(parts) + ". "
        "Loop and scan programs are compared on the first step only (rounding differences "
        "between the two XLA programs grow within a few steps on these narrow models)."
    )


def write_markdown(report: dict[str, Any], path: Path) -> None:
    m, v, cfg = report["machine"], report["versions"], report["config"]
    L: list[str] = []
    L.append("# autoflat benchmark report")
    L.append("")
    L.append(
        f"Generated {report['generated']} by `python benchmarks/report.py"
        f"{' --quick' if cfg['quick'] else ''}` in {report.get('total_seconds', 0):.0f} s."
    )
    L.append("")
    la0 = m.get("load_average_at_start")
    la1 = report.get("load_average_at_end")
    L.append(
        f"- **Machine**: {m['platform']} ({m['processor']}), {m['cpu_count']} CPUs; JAX "
        f"backend {m['jax_backend']} ({m['device']} x{m['n_devices']})"
        + (f"; XLA_FLAGS={m['xla_flags']}" if m["xla_flags"] else "")
    )
    if la0:
        L.append(
            f"- **Load average** (1/5/15 min): {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f} at start"
            + (f", {la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} at end" if la1 else "")
            + (
                " — the machine was busy: absolute timings are noisy"
                if la0[0] > 0.5 * (m["cpu_count"] or 1)
                else ""
            )
        )
    L.append(
        "- **Versions**: "
        + ", ".join(f"{k} {val}" for k, val in v.items() if k not in ("autoflat_path",))
    )
    L.append(
        f"- **Config**: width {cfg['width']}, batch {cfg['batch_size']}, images "
        f"{cfg['image_size']}x{cfg['image_size']}; {cfg['repeats']} repeats of ~"
        f"{cfg['block_s']:g} s blocks (leaves sweep: ~{cfg['sweep_block_s']:g} s)"
        + ("; --quick" if cfg["quick"] else "")
    )
    L.append(
        "- Every timing is the median over repeats, with the spread (min–max) of the repeats. "
        "Raw figures, every repeat: `report.json`."
    )
    L.append("")
    if report.get("errors"):
        L.append("**Errors** (details in report.json):")
        L.append("")
        for sec, err in report["errors"].items():
            L.append(f"- section {sec}: `{err.splitlines()[-1][:300]}`")
        L.append("")

    sec = report["sections"]
    # --- 1 ---
    if "seed" in sec:
        r = sec["seed"]
        L.append("## 1. The seed tutorial's measurement, today")
        L.append("")
        L.append(
            f'PAX\'s "Improve performance" tutorial: {r["iterations"]:,} iterations of '
            "`tree_flatten` + `tree_unflatten` of the state of a ResNet50 with Adam. Here: "
            f"`models.make_model` (ResNet50's structure; {r['model_leaves']['arrays']} arrays "
            f"+ {r['model_leaves']['static']} non-array leaves, the activations), Adam state "
            f"{r['opt_state_leaves']} leaves; (model, opt_state) = "
            f"{r['state_leaves']['leaves']} leaves. {r['repeats']} repeats. The tutorial's own "
            "figures (PAX, full-width ResNet50, its 2021 machine) are for scale only."
        )
        L.append("")
        body = []
        for row in r["rows"]:
            t = row["tutorial_seconds_per_10000"]
            body.append(
                [
                    row["variant"],
                    row["what"],
                    _fmt_s(row["seconds_per_N"]["median"]),
                    f"{_fmt_s(row['seconds_per_N']['min'])}–{_fmt_s(row['seconds_per_N']['max'])}",
                    _fmt(row["us_per_iteration"]["median"]),
                    f"{row['x_naive']:.3f}",
                    "" if t is None else f"{t:g}",
                ]
            )
        L += _table(
            [
                "variant",
                "what is flattened / read",
                f"s per {r['iterations']:,} (median)",
                "spread",
                "µs/iteration",
                "× naive",
                "tutorial s per 10,000",
            ],
            "llrrrrr",
            body,
        )
        L.append("")
        for row in r["rows"]:
            L.append(f"- **{row['variant']}**: {row['how']}.")
        for note in r.get("notes", {}).values():
            L.append(f"- {note}")
        L.append("")
    # --- 2 ---
    if "steps" in sec:
        r = sec["steps"]
        L.append("## 2. Per-step host overhead of a whole training step")
        L.append("")
        e = r["equinox"]
        L.append(
            f"### Equinox: NarrowResNet50 + optax.adam ({e['state_leaves']['arrays']} state "
            f"arrays + {e['state_leaves']['static']} non-array leaves)"
        )
        L.append("")
        L += _step_table(
            e["rows"],
            [
                ("hand_flat", "hand-written"),
                ("single_buffer", "single buffer"),
                ("filter_jit", "filter_jit"),
            ],
        )
        L.append("")
        L.append(_agreement_line(e.get("agreement", {})))
        L.append("")
        L += _notes_list(e["rows"])
        L.append("")
        n = r.get("nnx", {})
        if "rows" in n:
            ok = {x["key"]: x for x in n["rows"] if "us_per_step" in x}
            remedies = [k for k in ("cached_partial", "jit_partial", "split_merge") if k in ok]
            best = min(remedies, key=lambda k: ok[k]["us_per_step"]["median"]) if remedies else ""
            norm = "nnx.BatchNorm" if n["batchnorm"] else "norm without running statistics"
            L.append(
                f"### Flax NNX: NarrowResNet50 + nnx.Optimizer(adam) ({n['leaves']['arrays']} "
                f"state arrays; {norm}; graph mode default: {n.get('graph_mode_default')})"
            )
            L.append("")
            refs = [("nnx_jit", "nnx.jit")]
            if best:
                refs.insert(0, (best, f"best remedy ({ok[best]['method'].split(' (')[0]})"))
            L += _step_table(n["rows"], refs)
            L.append("")
            L.append(
                '"Best remedy": the fastest of the documented manual remedies in this run '
                "(nnx.cached_partial, nnx.jit_partial, the split/merge loop)."
            )
            L.append("")
            L.append(_agreement_line(n.get("agreement", {})))
            L.append("")
            L += _notes_list(n["rows"])
            L.append("")
        elif "error" in n:
            L.append(f"Flax NNX: not run ({n['error']}).")
            L.append("")
        L.append(
            "Per-step time is what a training loop sees (calls back to back, one "
            '`block_until_ready` per block). "Overhead" subtracts the device compute '
            "estimate; where dispatch is asynchronous, host work and compute overlap, so it is "
            "an upper-bound model. The JSON also has the host time before the final "
            "`block_until_ready` (`dispatch_us_per_step`)."
        )
        L.append("")
    # --- 3 ---
    if "leaves" in sec:
        r = sec["leaves"]
        L.append("## 3. Overhead against the number of leaves")
        L.append("")
        L.append(
            "A state of N arrays of 8 f32 each; step `[x * 0.99 + g for x in state]` (`g` a "
            "per-step scalar). µs per step, median (min–max)."
            + (
                f" `pack=True` only up to {cfg.get('sweep_pack_max_leaves')} leaves here (XLA's "
                "compile time for packing grows super-linearly with the leaves)."
                if cfg.get("sweep_pack_max_leaves", max(r["leaves"])) < max(r["leaves"])
                and any(
                    x["key"] == "autoflat_1_pack"
                    for d in r["by_leaves"].values()
                    for x in d.get("rows", [])
                )
                else ""
            )
        )
        L.append("")
        titles = {
            "jit": "jax.jit",
            "jit_donate": "jax.jit + donate",
            "autoflat_1": "autoflat 1",
            "autoflat_10": "autoflat 10",
            "autoflat_1_pack": "autoflat 1, pack=True",
        }
        present = {x["key"] for d in r["by_leaves"].values() for x in d.get("rows", [])}
        kinds = [k for k in titles if k in present]
        body = []
        for n_leaves in r["leaves"]:
            rows = {x["key"]: x for x in r["by_leaves"].get(str(n_leaves), {}).get("rows", [])}
            cells = [str(n_leaves)]
            for k in kinds:
                x = rows.get(k)
                if x is None or "us_per_step" not in x:
                    cells.append("failed" if x is not None else "–")
                else:
                    cells.append(
                        f"{_fmt(x['us_per_step']['median'])} ({_spread(x['us_per_step'])})"
                    )
            j, a1 = rows.get("jit"), rows.get("autoflat_1")
            if j and a1 and "us_per_step" in j and "us_per_step" in a1:
                cells.append(f"{j['us_per_step']['median'] / a1['us_per_step']['median']:.2f}")
            else:
                cells.append("–")
            body.append(cells)
        L += _table(
            ["leaves", *[titles[k] for k in kinds], "jax.jit ÷ autoflat 1"],
            "r" * (len(kinds) + 2),
            body,
        )
        L.append("")
        fails = [
            (n_leaves, x["method"], x.get("error", ""))
            for n_leaves, d in r["by_leaves"].items()
            for x in d.get("rows", [])
            if "us_per_step" not in x
        ]
        for n_leaves, meth, err in fails:
            L.append(f"- {n_leaves} leaves, {meth}: failed: `{str(err).splitlines()[0][:200]}`")
        if fails:
            L.append("")
    # --- 4 ---
    if "compile" in sec:
        r = sec["compile"]
        c = r["compile"]
        L.append("## 4. Compile time and memory")
        L.append("")
        L.append(
            f"First call of the Equinox step of section 2 from fresh function objects after "
            f"`jax.clear_caches()` + `autoflat.clear_caches()`, persistent compilation cache "
            f'off; {c["repeats"]} repeat(s). "Make" is building the callable (for autoflat: '
            f'decoration, which parses the source and generates code); "first call" is trace '
            f'+ compile + one call; "second call" is a warm call, for scale.'
        )
        L.append("")
        body = []
        jit_first = next(
            (
                x["first_call_s"]["median"]
                for x in c["rows"]
                if x["key"] == "jit" and "first_call_s" in x
            ),
            None,
        )
        for x in c["rows"]:
            if "first_call_s" not in x:
                body.append([x["method"], "failed", "", "", "", ""])
                continue
            body.append(
                [
                    x["method"],
                    _fmt(x["make_s"]["median"] * 1e3),
                    f"{x['first_call_s']['median']:.2f}",
                    f"{x['first_call_s']['min']:.2f}–{x['first_call_s']['max']:.2f}",
                    f"{x['second_call_s']['median'] * 1e3:.1f}",
                    f"{x['first_call_s']['median'] / jit_first:.2f}" if jit_first else "–",
                ]
            )
        L += _table(
            ["method", "make ms", "first call s (median)", "spread", "second call ms", "× jax.jit"],
            "lrrrrr",
            body,
        )
        L.append("")
        mem = r["memory"]
        L.append(
            f'Memory ({mem.get("source", "")}): measured with {mem["method"]}. "Held across a '
            "call\": the state's live bytes right after one call while the caller still holds "
            "the previous state (donated buffers are deleted and do not count), i.e. what a "
            'step needs at its peak besides temporaries; "steady": after the previous state '
            "is dropped. In multiples of the state's size (about 2 without donation, 1 with)."
        )
        L.append("")
        body = []
        for x in mem["rows"]:
            if "error" in x:
                body.append([x["method"], "failed", "", "", ""])
                continue
            body.append(
                [
                    x["method"],
                    f"{x['held_in_states']:.2f}",
                    f"{x['held_across_call_bytes']:,}",
                    f"{x['steady_in_states']:.2f}",
                    f"{x['state_bytes']:,}",
                ]
            )
        L += _table(
            ["method", "held across a call (states)", "bytes", "steady (states)", "state bytes"],
            "lrrrr",
            body,
        )
        L.append("")
    L.append("![charts](report.png)")
    L.append("")
    path.write_text("\n".join(L))


def write_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sec = report["sections"]
    fig, axes = plt.subplots(3, 2, figsize=(15, 16))
    ax_seed, ax_sweep = axes[0]
    ax_eqx, ax_nnx = axes[1]
    ax_comp, ax_mem = axes[2]
    load = report["machine"].get("load_average_at_start")
    fig.suptitle(
        f"autoflat benchmark report{' (--quick)' if report['config']['quick'] else ''}: "
        f"{report['machine']['cpu_count']} CPUs, {report['machine']['jax_backend']}, "
        f"jax {report['versions'].get('jax')}"
        + (f", load average {load[0]:.1f} at start" if load else ""),
        fontsize=13,
    )

    def not_run(ax: Any, title: str) -> None:
        ax.set_title(title)
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()

    def hbars(
        ax: Any,
        labels: list[str],
        med: list[float],
        lo: list[float],
        hi: list[float],
        color: Any,
        title: str,
        xlabel: str,
        log: bool = True,
    ) -> None:
        y = np.arange(len(labels))
        err = np.array([np.subtract(med, lo), np.subtract(hi, med)])
        ax.barh(y, med, xerr=err, color=color, capsize=3, alpha=0.85)
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", which="both", alpha=0.3)
        for yi, v, h in zip(y, med, hi, strict=True):
            ax.text(h, yi, f"  {_fmt(v)}", va="center", fontsize=7)
        ax.margins(x=0.12)

    # 1. seed
    if "seed" in sec:
        rows = sec["seed"]["rows"]
        hbars(
            ax_seed,
            [r["variant"] for r in rows],
            [r["us_per_iteration"]["median"] for r in rows],
            [r["us_per_iteration"]["min"] for r in rows],
            [r["us_per_iteration"]["max"] for r in rows],
            "tab:purple",
            f"1. flatten + unflatten of (model, adam state): µs per iteration "
            f"({sec['seed']['state_leaves']['leaves']} leaves)",
            "µs per iteration (log)",
        )
    else:
        not_run(ax_seed, "1. seed tutorial")

    # 3. sweep
    if "leaves" in sec:
        r = sec["leaves"]
        styles = {
            "jit": ("jax.jit", "tab:red", "o-"),
            "jit_donate": ("jax.jit + donate", "tab:orange", "s-"),
            "autoflat_1": ("autoflat num_steps=1", "tab:blue", "^-"),
            "autoflat_10": ("autoflat num_steps=10", "tab:green", "v-"),
            "autoflat_1_pack": ("autoflat num_steps=1, pack=True", "tab:purple", "D--"),
        }
        for k, (label, color, fmt) in styles.items():
            xs, med, lo, hi = [], [], [], []
            for n_leaves in r["leaves"]:
                rows = {x["key"]: x for x in r["by_leaves"].get(str(n_leaves), {}).get("rows", [])}
                x = rows.get(k)
                if x is None or "us_per_step" not in x:
                    continue
                xs.append(n_leaves)
                med.append(x["us_per_step"]["median"])
                lo.append(x["us_per_step"]["min"])
                hi.append(x["us_per_step"]["max"])
            if xs:
                ax_sweep.errorbar(
                    xs,
                    med,
                    yerr=[np.subtract(med, lo), np.subtract(hi, med)],
                    fmt=fmt,
                    color=color,
                    label=label,
                    capsize=3,
                    markersize=5,
                )
        ax_sweep.set_xscale("log")
        ax_sweep.set_yscale("log")
        ax_sweep.set_xlabel("leaves in the state (arrays of 8 f32)")
        ax_sweep.set_ylabel("µs per step (median, min–max)")
        ax_sweep.set_title("3. overhead vs leaves: x*0.99+g on every leaf", fontsize=10)
        ax_sweep.grid(which="both", alpha=0.3)
        ax_sweep.legend(fontsize=8)
    else:
        not_run(ax_sweep, "3. overhead vs leaves")

    # 2. per-step bars
    def step_bars(ax: Any, group: dict[str, Any] | None, title: str) -> None:
        if not group or "rows" not in group:
            not_run(ax, title)
            return
        rows = [x for x in group["rows"] if "us_per_step" in x]
        if not rows:
            not_run(ax, title)
            return
        colors = [
            "tab:green"
            if x["key"] == "compute"
            else "tab:blue"
            if x["key"].startswith("autoflat")
            else "tab:gray"
            if x["key"] == "single_buffer"
            else "tab:red"
            for x in rows
        ]
        hbars(
            ax,
            [x["method"] for x in rows],
            [x["us_per_step"]["median"] for x in rows],
            [x["us_per_step"]["min"] for x in rows],
            [x["us_per_step"]["max"] for x in rows],
            colors,
            title,
            "µs per step (log; median, min–max)",
        )
        comp = next((x for x in rows if x["key"] == "compute"), None)
        if comp:
            ax.axvline(comp["us_per_step"]["median"], color="tab:green", ls="--", lw=1)

    if "steps" in sec:
        step_bars(ax_eqx, sec["steps"].get("equinox"), "2. Equinox NarrowResNet50 + adam: per step")
        step_bars(ax_nnx, sec["steps"].get("nnx"), "2. Flax NNX NarrowResNet50 + adam: per step")
    else:
        not_run(ax_eqx, "2. Equinox")
        not_run(ax_nnx, "2. Flax NNX")

    # 4. compile + memory
    if "compile" in sec:
        rows = [x for x in sec["compile"]["compile"]["rows"] if "first_call_s" in x]
        if rows:
            hbars(
                ax_comp,
                [x["method"] for x in rows],
                [x["first_call_s"]["median"] for x in rows],
                [x["first_call_s"]["min"] for x in rows],
                [x["first_call_s"]["max"] for x in rows],
                ["tab:blue" if x["key"].startswith("autoflat") else "tab:red" for x in rows],
                "4. first call (trace + compile + 1 call), s",
                "seconds",
                log=False,
            )
        else:
            not_run(ax_comp, "4. compile")
        mrows = [x for x in sec["compile"]["memory"]["rows"] if "held_in_states" in x]
        if mrows:
            y = np.arange(len(mrows))
            ax_mem.barh(
                y - 0.2,
                [x["held_in_states"] for x in mrows],
                height=0.4,
                label="held across a call",
                color="tab:orange",
            )
            ax_mem.barh(
                y + 0.2,
                [x["steady_in_states"] for x in mrows],
                height=0.4,
                label="steady",
                color="tab:cyan",
            )
            ax_mem.set_yticks(y, [x["method"] for x in mrows], fontsize=8)
            ax_mem.invert_yaxis()
            ax_mem.set_xlabel("live device bytes / state bytes")
            ax_mem.set_title("4. memory (jax.live_arrays), in state sizes", fontsize=10)
            ax_mem.legend(fontsize=8)
            ax_mem.grid(axis="x", alpha=0.3)
        else:
            not_run(ax_mem, "4. memory")
    else:
        not_run(ax_comp, "4. compile")
        not_run(ax_mem, "4. memory")

    fig.tight_layout(rect=(0, 0, 1, 0.97))
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def _write_json(report: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


SECTIONS = {
    "1": ("seed", "the seed tutorial's measurement", section_seed),
    "2": ("steps", "per-step host overhead of a whole training step", section_steps),
    "3": ("leaves", "overhead against the number of leaves", section_leaves),
    "4": ("compile", "compile time and memory", section_compile_memory),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="autoflat benchmark report (sections: 1 seed, 2 steps, 3 leaves, 4 compile)"
    )
    ap.add_argument("--quick", action="store_true", help="short blocks, few repeats")
    ap.add_argument("--out", default=str(_HERE / "results"), help="output folder")
    ap.add_argument("--sections", default="1,2,3,4", help="comma-separated subset of 1,2,3,4")
    ap.add_argument("--repeats", type=int, default=None, help="timed blocks per method")
    ap.add_argument("--block-seconds", type=float, default=None, help="target seconds a block")
    ap.add_argument("--iterations", type=int, default=None, help="section 1 iterations")
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--nnx-batchnorm", action="store_true", help="nnx.BatchNorm in the NNX model")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="first calls (compiles) run this many at a time, before any timing (default: "
        "min(2, CPUs)); timing is always serial",
    )
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite report.md and report.png from the report.json in --out; run nothing",
    )
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    if args.render_only:
        report = json.loads((out_dir / "report.json").read_text())
        write_markdown(report, out_dir / "report.md")
        write_chart(report, out_dir / "report.png")
        _log(f"rendered {out_dir / 'report.md'} and {out_dir / 'report.png'}")
        return 0

    quick = args.quick
    block_s = args.block_seconds or (0.1 if quick else 1.0)
    cfg = {
        "quick": quick,
        "repeats": args.repeats or (3 if quick else 7),
        "block_s": block_s,
        "sweep_block_s": block_s / 2,
        "iterations": args.iterations or (300 if quick else 10_000),
        "seed_repeats": 3 if quick else 5,
        "compile_repeats": 1 if quick else 3,
        "sweep_leaves": SWEEP_LEAVES,
        # XLA takes super-linear time to compile thousands of slices into one buffer (about
        # 2 min at 3000 leaves on 2 cores), so --quick packs only the small states.
        "sweep_pack_max_leaves": 300 if quick else max(SWEEP_LEAVES),
        "width": args.width,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "nnx_batchnorm": args.nnx_batchnorm,
        "jobs": max(1, args.jobs or min(2, os.cpu_count() or 1)),
    }
    wanted = [x.strip() for x in args.sections.split(",") if x.strip()]
    for w in wanted:
        if w not in SECTIONS:
            ap.error(f"unknown section {w!r}: choose from 1, 2, 3, 4")
    out_dir.mkdir(parents=True, exist_ok=True)

    t_start = perf()
    report: dict[str, Any] = {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": _machine(),
        "versions": _versions(),
        "config": cfg,
        "sections": {},
        "errors": {},
    }
    m, v = report["machine"], report["versions"]
    _log("# autoflat benchmark report" + (" (--quick)" if quick else ""))
    _log(
        f"machine: {m['platform']}, {m['cpu_count']} CPUs, JAX {m['jax_backend']}; load average "
        f"{m['load_average_at_start']}"
    )
    _log("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    _log(f"output: {out_dir.resolve()}")
    json_path = out_dir / "report.json"
    for i, w in enumerate(wanted):
        name, title, fn = SECTIONS[w]
        _log(f"[{i + 1}/{len(wanted)}] section {w}: {title} ({perf() - t_start:.0f} s elapsed)")
        t0 = perf()
        try:
            report["sections"][name] = fn(args, cfg, report["sections"])
            report["sections"][name]["seconds"] = perf() - t0
        except Exception:
            report["errors"][w] = traceback.format_exc()
            _log(f"  section {w} FAILED:\n{report['errors'][w]}")
        gc.collect()
        report["total_seconds"] = perf() - t_start
        report["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        _write_json(report, json_path)

    report["total_seconds"] = perf() - t_start
    _write_json(report, json_path)
    for what, writer, p in (
        ("report.md", write_markdown, out_dir / "report.md"),
        ("report.png", write_chart, out_dir / "report.png"),
    ):
        try:
            writer(report, p)
        except Exception:
            report["errors"][what] = traceback.format_exc()
            _log(f"writing {what} FAILED:\n{report['errors'][what]}")
    _write_json(report, json_path)
    failed = _count_failures(report)
    _log(
        f"done in {report['total_seconds']:.0f} s: {out_dir / 'report.md'}, {json_path}, "
        f"{out_dir / 'report.png'}" + (f"; {failed} failure(s), see the report" if failed else "")
    )
    return 1 if failed else 0


def _count_failures(report: dict[str, Any]) -> int:
    n = len(report["errors"])

    def walk(x: Any) -> None:
        nonlocal n
        if isinstance(x, dict):
            if "error" in x and ("method" in x or "key" in x):
                n += 1
            for val in x.values():
                walk(val)
        elif isinstance(x, list):
            for val in x:
                walk(val)

    walk(report["sections"])
    return n


if __name__ == "__main__":
    sys.exit(main())
