"""The autoflat benchmark report: four sections, side by side in one process.

    python benchmarks/report.py                 # the full run (about 10-20 min on 2 CPU cores)
    python benchmarks/report.py --quick         # short blocks, few repeats (a few minutes)
    python benchmarks/report.py --out DIR       # default: benchmarks/results/
    python benchmarks/report.py --sections 2,3  # a subset (1 seed, 2 steps, 3 leaves, 4 compile)

Writes `report.md` (Markdown tables), `report.json` (every figure, every repeat) and
`report.png` (charts) into the output folder. `report.json` is rewritten after every section,
so a crash late in the run keeps what came before; a section that fails is reported (with its
traceback in the JSON) and the others still run; the exit status is then 1. Timing, agreement
checks, the machine and version header, tables and charts are `harness.py`'s (its docstring
says how methods are timed); the models and the ways of running their steps are in
`models.py` (Equinox) and `nnx_models.py` (Flax NNX).

Sections
--------

1. **The seed tutorial's measurement today** (PAX's "Improve performance" tutorial): N
   iterations (default 10,000; `--quick` 300) of `tree_flatten` + `tree_unflatten` of the
   narrow ResNet50 and its `optax.adam` state: naive `(model, opt_state)`; "optimizer
   flattened" (the model tree plus the optimizer's leaf list, PAX's `flatten=True`); "model
   flattened" (two leaf lists); autoflat's handle round trip (what the fast path reads from
   each returned handle, and a new handle around it); and the whole Python call path of
   `autoflat.step`, its compiled call stubbed out (JAX's dispatch is not in it), for a step
   with a trivial body and a real one's roles and state. Flax is imported, as in section 2.

2. **Per-step host overhead of a whole training step**, narrow ResNet50s with Adam. Equinox
   (`models.methods`): plain `jax.jit` (partition outside, combine inside) without and with
   donation, `eqx.filter_jit`, Equinox's "Low-overhead training loops" recipe, the
   hand-written flat-leaves recipe, the single-buffer floor (every leaf packed into one f32
   buffer), autoflat `num_steps` 1 (also `donate=False` and `pack=True`), 10 and 100. Flax NNX
   (`nnx_models.methods`): `nnx.jit` in graph and tree mode, `nnx.cached_partial`,
   `nnx.jit_partial`, the split/merge loop of Flax's performance guide, autoflat 1 and 10 on
   the mutation-style step and on the functional one. Each group has the device compute per
   step, estimated by a jitted `lax.scan` of 100 steps; "overhead" is step time minus that.

3. **Overhead against the number of leaves** (10 ... 3000): a state of that many f32 arrays
   of 8 elements with the update `x * 0.99 + g`: `jax.jit` without and with donation against
   autoflat `num_steps` 1 and 10 and 1 with `pack=True` (with `--quick` only up to 300
   leaves: XLA's compile time for packing thousands of leaves grows super-linearly).

4. **Compile time and memory.** First-call wall time (trace + compile + one step; building
   the callable timed apart) of the Equinox step under `jax.jit`, `jax.jit` + donation,
   `eqx.filter_jit`, the hand-written flat leaves, autoflat 1 and 10, and a hand-written
   `jax.jit` of a 10-step `lax.scan` (`--quick`: `jax.jit`, autoflat 1 and 10, once), with
   the persistent compilation cache off (`harness.time_compiles`). Memory: section 2's
   Equinox methods after their timing (else five compiled here), `harness.measure_memory`.

Other options: `--repeats`, `--block-seconds`, `--iterations` (section 1), `--width`,
`--batch-size`, `--image-size`, `--nnx-batchnorm` (the NNX model with `nnx.BatchNorm`),
`--jobs` (first calls, which compile, run this many at a time; default 2), `--render-only`
(rewrite report.md and report.png from the report.json in `--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import autoflat  # noqa: E402
from benchmarks import harness, models  # noqa: E402
from benchmarks.harness import Method, Plan, fmt, log, perf, table  # noqa: E402

try:
    from flax import nnx

    from benchmarks import nnx_models

    _NNX_ERROR = ""
except Exception as e:  # pragma: no cover - Flax missing or broken
    nnx = nnx_models = None  # type: ignore[assignment]
    _NNX_ERROR = f"{type(e).__name__}: {e}"

warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"flax(\..*)?")
for _name, _value in (("jax_enable_compilation_cache", False), ("jax_compilation_cache_dir", None)):
    with contextlib.suppress(Exception):
        jax.config.update(_name, _value)

SWEEP_LEAVES = (10, 30, 100, 300, 1000, 3000)
EQX_KEYS = (
    "jit jit_donate filter_jit eqx_recipe hand_flat single_buffer autoflat_1 "
    "autoflat_1_nodonate autoflat_1_pack autoflat_1_auto autoflat_10 autoflat_10_auto "
    "autoflat_100 compute"
).split()
NNX_KEYS = (
    "nnx_jit nnx_jit_tree cached_partial jit_partial split_merge autoflat_mut_1 "
    "autoflat_mut_10 autoflat_fn_1 autoflat_fn_10 compute"
).split()
MEMORY_KEYS = "jit jit_donate hand_flat autoflat_1 autoflat_1_nodonate".split()
COMPILE_KEYS = "jit jit_donate filter_jit hand_flat autoflat_1 compute autoflat_10".split()
TUTORIAL_S = {"naive": 40.00, "optimizer_flattened": 8.34, "model_flattened": 0.63}


def passthrough(model, opt_state, batch):
    """A step with a trivial body and the roles of `models.update` (section 1's call path)."""
    loss = jnp.zeros(())
    return model, opt_state, loss


# ==========================================================================================
# 1. The seed tutorial's measurement
# ==========================================================================================


def _autoflat_loops(s: models.Setup) -> dict[str, Callable[[int], float]]:
    """Section 1's autoflat rows, from real handles of a trivial-body step's real calls."""
    private = harness.PRIVATE
    step = autoflat.step(passthrough, pack=False)
    m_h, o_h, _ = step(*s.fresh(), *s.args)
    m_h, o_h, _ = step(m_h, o_h, *s.args)
    if not (autoflat.is_handle(m_h) and autoflat.is_handle(o_h)):
        raise RuntimeError("autoflat did not return lazy handles")
    handle_roundtrip = private.handle_roundtrip([m_h, o_h])
    handle_roundtrip(2)  # the private layout is as expected

    # The whole call path, with the compiled call stubbed out.
    current = private.stub_compiled_call(step, m_h, o_h, *s.args)[:2]  # the latest handles
    jax.block_until_ready(harness.device_buffers(current))
    batch = s.args[0]

    def call_path(n: int) -> float:
        nonlocal current
        m, o = current
        before = autoflat.stats(step)
        t0 = perf()
        for _ in range(n):
            m, o, _loss = step(m, o, batch)
        dt = perf() - t0
        current = (m, o)
        after = autoflat.stats(step)
        if after.flattens != before.flattens or after.fast_path - before.fast_path != 2 * n:
            raise AssertionError(f"the stubbed calls left the fast path: {before} -> {after}")
        return dt

    call_path(2)
    return {"autoflat_handles": handle_roundtrip, "autoflat_call_path": call_path}


SEED_ROWS = {  # key: (label, what is flattened or read, how)
    "naive": (
        "naive: (model, opt_state)",
        "{state} leaves, full trees",
        "tree_flatten((model, opt_state)) + tree_unflatten",
    ),
    "optimizer_flattened": (
        "optimizer flattened: (model, opt leaf list)",
        "{model} model leaves in a tree + {opt} in a list",
        "the model tree plus the optimizer state as a list of leaves (PAX flatten=True)",
    ),
    "model_flattened": (
        "model flattened: (model leaf list, opt leaf list)",
        "{model} + {opt} leaves in two lists",
        "two leaf lists only (the tutorial's flatten_update loop)",
    ),
    "autoflat_handles": (
        "autoflat handles: read leaf lists + wrap new handles",
        "2 handles (structure + leaf list each); no tree traversal",
        "per state argument: read the handle's interned structure, leaf list and placement "
        "(what the fast path reads); per state output: a new LazyHandle around the leaf list",
    ),
    "autoflat_call_path": (
        "autoflat.step call path (compiled call stubbed)",
        "2 handles in, 2 out, plus the batch",
        "the whole Python of Step.__call__ for (model handle, opt handle, batch) with the "
        "jitted call replaced by a stub returning the previous outputs: binding, fast path, "
        "spec lookup, Flax checks, new handles, counters. JAX's own dispatch (per-buffer work "
        "in C++) is not included",
    ),
}


def section_seed(args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]) -> Any:
    """Section 1: the PAX tutorial's flatten/unflatten measurement, today."""
    n_iter = cfg["iterations"]
    s = models.Setup(args.width, args.batch_size, args.image_size)
    net, opt = s.model, s.opt_state
    counts = models.count_leaves(net), models.count_leaves((net, opt))
    net_leaves, opt_leaves = jax.tree_util.tree_leaves(net), jax.tree_util.tree_leaves(opt)
    loops = {
        "naive": harness.roundtrip((net, opt)),
        "optimizer_flattened": harness.roundtrip((net, opt_leaves)),
        "model_flattened": harness.roundtrip((net_leaves, opt_leaves)),
    }
    notes: dict[str, str] = {}
    try:
        loops |= _autoflat_loops(s)
    except Exception as e:
        notes["autoflat"] = f"autoflat rows skipped: {type(e).__name__}: {e}"
        log(f"  {notes['autoflat']}")
    times = harness.time_loops(loops, n_iter, cfg["seed_repeats"])
    sizes = {"state": counts[1]["leaves"], "model": len(net_leaves), "opt": len(opt_leaves)}
    rows = []
    for key, secs in times.items():
        label, what, how = SEED_ROWS[key]
        rows.append(
            {
                "key": key,
                "variant": label,
                "what": what.format(**sizes),
                "how": how,
                "iterations": n_iter,
                "seconds_per_N": harness.summary(secs, 1.0),
                "us_per_iteration": harness.summary([x / n_iter for x in secs]),
                "x_naive": statistics.median(secs) / statistics.median(times["naive"]),
                "tutorial_seconds_per_10000": TUTORIAL_S.get(key),
            }
        )
    return {
        "model_leaves": counts[0],
        "state_leaves": counts[1],
        "opt_state_leaves": len(opt_leaves),
        "iterations": n_iter,
        "repeats": cfg["seed_repeats"],
        "rows": rows,
        "notes": notes,
    }


# ==========================================================================================
# 2. Per-step host overhead; 3. leaves; 4. compile and memory
# ==========================================================================================


def _group(title: str, methods: list[Method], setup: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    log(f"  {title}:")
    res = harness.check_and_time(
        title, methods, setup.args, setup.checks, cfg["repeats"], cfg["block_s"], cfg["jobs"]
    )
    return {"rows": harness.method_rows(methods), **res}


def section_steps(args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]) -> Any:
    """Section 2: per-step time of a whole training step, Equinox and Flax NNX."""
    s = models.Setup(args.width, args.batch_size, args.image_size)
    methods = models.methods(s, EQX_KEYS)
    out: dict[str, Any] = {"equinox": _group("Equinox", methods, s, cfg)}
    out["equinox"] |= {
        "model_leaves": models.count_leaves(s.model),
        "state_leaves": models.count_leaves((s.model, s.opt_state)),
        "memory": harness.measure_memory(methods),
    }
    del methods, s
    gc.collect()
    if nnx is None:
        out["nnx"] = {"error": f"Flax NNX unavailable: {_NNX_ERROR}"}
        return out
    ns = nnx_models.Setup(args.width, args.batch_size, args.image_size, args.nnx_batchnorm)
    out["nnx"] = _group("Flax NNX", nnx_models.methods(ns, NNX_KEYS), ns, cfg)
    m0, o0 = ns.fresh()
    out["nnx"] |= {
        "leaves": nnx_models.count_leaves(m0, o0),
        "model_leaves": nnx_models.count_leaves(m0),
        "batchnorm": args.nnx_batchnorm,
        "graph_mode_default": bool(nnx.set_graph_mode.current_value())
        if hasattr(nnx, "set_graph_mode")
        else None,
    }
    return out


def sweep_update(state, g):
    """Section 3: a trivial update of every leaf."""
    state = [x * 0.99 + g for x in state]
    return state


class Sweep(Method):
    """A state of small arrays; the loop is `s = f(s, g)`. Compared on the final state."""

    def _loop(self, n: int, args: tuple[Any, ...]) -> Any:
        f, (s,) = self.fn, self.state
        for _ in range(n):
            s = f(s, *args)
        self.state = (s,)

    def check(self, batches: Any, pad: Any) -> np.ndarray:
        k = self.steps_per_call
        for i in range(0, len(batches), k):
            self._loop(1, batches[i] if k == 1 else harness.stack(batches[i : i + k]))
        leaves = jax.tree_util.tree_leaves(self.state)
        # One number that depends on every leaf: the "loss" compared across methods.
        return np.asarray([sum(float(x[0]) for x in leaves[:: max(1, len(leaves) // 50)])])


def sweep_methods(n_leaves: int, pack: bool) -> list[Method]:
    state = lambda: ([jnp.arange(8, dtype=jnp.float32) / 8 + i for i in range(n_leaves)],)  # noqa: E731
    kinds: dict[str, tuple[str, Callable[[], Any], int]] = {
        "jit": ("jax.jit", lambda: jax.jit(sweep_update), 1),
        "jit_donate": ("jax.jit + donate", lambda: jax.jit(sweep_update, donate_argnums=0), 1),
        "autoflat_1": ("autoflat num_steps=1", lambda: autoflat.step(sweep_update, pack=False), 1),
        "autoflat_10": (
            "autoflat num_steps=10",
            lambda: autoflat.step(sweep_update, num_steps=10, pack=False),
            10,
        ),
        "autoflat_1_pack": (
            "autoflat num_steps=1, pack=True",
            lambda: autoflat.step(sweep_update, pack=True),
            1,
        ),
    }
    if not pack:
        del kinds["autoflat_1_pack"]
    return [
        Sweep(key, label, lambda b=build: Plan(b, state()), steps_per_call=k)
        for key, (label, build, k) in kinds.items()
    ]


def section_leaves(args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]) -> Any:
    """Section 3: overhead against the number of leaves."""
    out: dict[str, Any] = {"leaves": list(cfg["sweep_leaves"]), "by_leaves": {}}
    checks = [(jnp.asarray(0.01 * (i + 1), jnp.float32),) for i in range(harness.CHECK_STEPS)]
    for n in cfg["sweep_leaves"]:
        log(f"  {n} leaves:")
        methods = sweep_methods(n, pack=n <= cfg["sweep_pack_max_leaves"])
        g = (jnp.asarray(0.01, jnp.float32),)
        res = harness.check_and_time(
            f"{n} leaves", methods, g, checks, cfg["repeats"], cfg["sweep_block_s"], cfg["jobs"]
        )
        out["by_leaves"][str(n)] = {"rows": harness.method_rows(methods), **res}
        del methods
        gc.collect()
    return out


def section_compile_memory(
    args: argparse.Namespace, cfg: dict[str, Any], done: dict[str, Any]
) -> Any:
    """Section 4: first-call (compile) time, and memory with and without donation."""
    s = models.Setup(args.width, args.batch_size, args.image_size)
    variants = ("jit", "autoflat_1", "autoflat_10") if cfg["quick"] else COMPILE_KEYS
    labels = {
        "jit_donate": "jax.jit + donate",
        "compute": "hand-written jax.jit(lax.scan) of 10 steps",
    }

    def method(key: str) -> Method:
        (m,) = models.methods(s, [key], compute_steps=10)
        m.label = labels.get(key, m.label)
        return m

    rows = harness.time_compiles(method, variants, cfg["compile_repeats"], s.args)
    memory = done.get("steps", {}).get("equinox", {}).get("memory")
    if memory is not None:
        memory = {**memory, "source": "measured on section 2's Equinox methods, after timing"}
    else:
        methods = models.methods(s, MEMORY_KEYS)
        harness.first_calls(methods, s.args, s.checks[:2], cfg["jobs"])
        memory = {**harness.measure_memory(methods), "source": "measured here (section 2 not run)"}
    memory["state_arrays"] = models.count_leaves((s.model, s.opt_state))["arrays"]
    return {"compile": {"repeats": cfg["compile_repeats"], "rows": rows}, "memory": memory}


# ==========================================================================================
# Markdown and chart
# ==========================================================================================


def _markdown_seed(r: dict[str, Any]) -> list[str]:
    L = [
        "## 1. The seed tutorial's measurement, today",
        "",
        f'PAX\'s "Improve performance" tutorial: {r["iterations"]:,} iterations of '
        "`tree_flatten` + `tree_unflatten` of the state of a ResNet50 with Adam. Here: "
        f"`models.make_model` (ResNet50's structure; {r['model_leaves']['arrays']} arrays "
        f"+ {r['model_leaves']['static']} non-array leaves, the activations), Adam state "
        f"{r['opt_state_leaves']} leaves; (model, opt_state) = "
        f"{r['state_leaves']['leaves']} leaves. {r['repeats']} repeats. The tutorial's own "
        "figures (PAX, full-width ResNet50, its 2021 machine) are for scale only.",
        "",
    ]
    s3 = lambda x: f"{x:.3g}" if x < 100 else f"{x:.0f}"  # noqa: E731
    body = [
        [
            row["variant"],
            row["what"],
            s3(row["seconds_per_N"]["median"]),
            f"{s3(row['seconds_per_N']['min'])}–{s3(row['seconds_per_N']['max'])}",
            fmt(row["us_per_iteration"]["median"]),
            f"{row['x_naive']:.3f}",
            ""
            if row["tutorial_seconds_per_10000"] is None
            else f"{row['tutorial_seconds_per_10000']:g}",
        ]
        for row in r["rows"]
    ]
    L += table(
        ["variant", "what is flattened / read", f"s per {r['iterations']:,} (median)", "spread"]
        + ["µs/iteration", "× naive", "tutorial s per 10,000"],
        "llrrrrr",
        body,
    )
    L += ["", *(f"- **{row['variant']}**: {row['how']}." for row in r["rows"])]
    return [*L, *(f"- {note}" for note in r.get("notes", {}).values()), ""]


def _markdown_steps(r: dict[str, Any]) -> list[str]:
    e = r["equinox"]
    L = [
        "## 2. Per-step host overhead of a whole training step",
        "",
        f"### Equinox: narrow ResNet50 + optax.adam ({e['state_leaves']['arrays']} state "
        f"arrays + {e['state_leaves']['static']} non-array leaves)",
        "",
        *harness.step_table(
            e["rows"],
            [
                ("hand_flat", "hand-written"),
                ("single_buffer", "single buffer"),
                ("filter_jit", "filter_jit"),
            ],
        ),
        "",
        harness.agreement_line(e.get("agreement", {})),
        "",
        *harness.notes_list(e["rows"]),
        "",
    ]
    n = r.get("nnx", {})
    if "rows" in n:
        ok = {x["key"]: x for x in n["rows"] if "us_per_step" in x}
        remedies = [k for k in ("cached_partial", "jit_partial", "split_merge") if k in ok]
        best = min(remedies, key=lambda k: ok[k]["us_per_step"]["median"]) if remedies else ""
        norm = "nnx.BatchNorm" if n["batchnorm"] else "norm without running statistics"
        refs = [(best, f"best remedy ({ok[best]['method'].split(' (')[0]})")] if best else []
        L += [
            f"### Flax NNX: narrow ResNet50 + nnx.Optimizer(adam) ({n['leaves']['arrays']} "
            f"state arrays; {norm}; graph mode default: {n.get('graph_mode_default')})",
            "",
            *harness.step_table(n["rows"], [*refs, ("nnx_jit", "nnx.jit")]),
            "",
            '"Best remedy": the fastest of the documented manual remedies in this run '
            "(nnx.cached_partial, nnx.jit_partial, the split/merge loop).",
            "",
            harness.agreement_line(n.get("agreement", {})),
            "",
            *harness.notes_list(n["rows"]),
            "",
        ]
    elif "error" in n:
        L += [f"Flax NNX: not run ({n['error']}).", ""]
    return L + [
        "Per-step time is what a training loop sees (calls back to back, one "
        '`block_until_ready` per block). "Overhead" subtracts the device compute estimate; '
        "where dispatch is asynchronous, host work and compute overlap, so it is an "
        "upper-bound model. The JSON also has the host time before the final "
        "`block_until_ready` (`dispatch_us_per_step`).",
        "",
    ]


SWEEP_STYLES = {  # key: (title, chart label, color, line style)
    "jit": ("jax.jit", "jax.jit", "tab:red", "o-"),
    "jit_donate": ("jax.jit + donate", "jax.jit + donate", "tab:orange", "s-"),
    "autoflat_1": ("autoflat 1", "autoflat num_steps=1", "tab:blue", "^-"),
    "autoflat_10": ("autoflat 10", "autoflat num_steps=10", "tab:green", "v-"),
    "autoflat_1_pack": (
        "autoflat 1, pack=True",
        "autoflat num_steps=1, pack=True",
        "tab:purple",
        "D--",
    ),
}


def _sweep_rows(r: dict[str, Any], n_leaves: int) -> dict[str, Any]:
    return {x["key"]: x for x in r["by_leaves"].get(str(n_leaves), {}).get("rows", [])}


def _markdown_leaves(r: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    present = {k for n in r["leaves"] for k in _sweep_rows(r, n)}
    kinds = [k for k in SWEEP_STYLES if k in present]
    body = []
    for n in r["leaves"]:
        rows = _sweep_rows(r, n)
        cells = [str(n)]
        for k in kinds:
            x = rows.get(k)
            ok = x is not None and "us_per_step" in x
            cells.append(
                f"{fmt(x['us_per_step']['median'])} ({harness.spread(x['us_per_step'])})"
                if ok
                else ("failed" if x is not None else "–")
            )
        j, a = rows.get("jit", {}), rows.get("autoflat_1", {})
        ok = "us_per_step" in j and "us_per_step" in a
        cells.append(
            f"{j['us_per_step']['median'] / a['us_per_step']['median']:.2f}" if ok else "–"
        )
        body.append(cells)
    pack_max = cfg.get("sweep_pack_max_leaves", max(r["leaves"]))
    L = [
        "## 3. Overhead against the number of leaves",
        "",
        "A state of N arrays of 8 f32 each; step `[x * 0.99 + g for x in state]` (`g` a "
        "per-step scalar). µs per step, median (min–max)."
        + (
            f" `pack=True` only up to {pack_max} leaves here (XLA's compile time for packing "
            "grows super-linearly with the leaves)."
            if pack_max < max(r["leaves"]) and "autoflat_1_pack" in present
            else ""
        ),
        "",
        *table(
            ["leaves", *[SWEEP_STYLES[k][0] for k in kinds], "jax.jit ÷ autoflat 1"],
            "r" * (len(kinds) + 2),
            body,
        ),
        "",
    ]
    fails = [
        f"- {n} leaves, {x['method']}: failed: `{str(x.get('error', '')).splitlines()[0][:200]}`"
        for n in r["leaves"]
        for x in _sweep_rows(r, n).values()
        if "us_per_step" not in x
    ]
    return L + fails + ([""] if fails else [])


def _markdown_compile(r: dict[str, Any]) -> list[str]:
    c, mem = r["compile"], r["memory"]
    ok = [x for x in c["rows"] if "first_call_s" in x]
    jit_first = next((x["first_call_s"]["median"] for x in ok if x["key"] == "jit"), None)
    body = [
        [
            x["method"],
            fmt(x["make_s"]["median"] * 1e3),
            f"{x['first_call_s']['median']:.2f}",
            f"{x['first_call_s']['min']:.2f}–{x['first_call_s']['max']:.2f}",
            f"{x['second_call_s']['median'] * 1e3:.1f}",
            f"{x['first_call_s']['median'] / jit_first:.2f}" if jit_first else "–",
        ]
        if "first_call_s" in x
        else [x["method"], "failed", "", "", "", ""]
        for x in c["rows"]
    ]
    return [
        "## 4. Compile time and memory",
        "",
        f"First call of the Equinox step of section 2 from fresh function objects after "
        f"`jax.clear_caches()` + `autoflat.clear_caches()`, persistent compilation cache "
        f'off; {c["repeats"]} repeat(s). "Make" is building the callable (for autoflat: '
        f'decoration, which parses the source and generates code); "first call" is trace '
        f'+ compile + one call; "second call" is a warm call, for scale.',
        "",
        *table(
            ["method", "make ms", "first call s (median)", "spread", "second call ms", "× jax.jit"],
            "lrrrrr",
            body,
        ),
        "",
        *harness.memory_table(mem),
        "",
    ]


def write_markdown(report: dict[str, Any], path: Path) -> None:
    m, cfg, sec = report["machine"], report["config"], report["sections"]
    L = [
        "# autoflat benchmark report",
        "",
        f"Generated {report['generated']} by `python benchmarks/report.py"
        f"{' --quick' if cfg['quick'] else ''}` in {report.get('total_seconds', 0):.0f} s.",
        "",
        *harness.environment_lines(m, report["versions"], report.get("load_average_at_end")),
        f"- **Config**: width {cfg['width']}, batch {cfg['batch_size']}, images "
        f"{cfg['image_size']}x{cfg['image_size']}; {cfg['repeats']} repeats of ~"
        f"{cfg['block_s']:g} s blocks (leaves sweep: ~{cfg['sweep_block_s']:g} s)"
        + ("; --quick" if cfg["quick"] else ""),
        "- Every timing is the median over repeats, with the spread (min–max) of the repeats. "
        "Raw figures, every repeat: `report.json`.",
        "",
    ]
    if report.get("errors"):
        L += ["**Errors** (details in report.json):", ""]
        L += [f"- section {s}: `{e.splitlines()[-1][:300]}`" for s, e in report["errors"].items()]
        L.append("")
    L += _markdown_seed(sec["seed"]) if "seed" in sec else []
    L += _markdown_steps(sec["steps"]) if "steps" in sec else []
    L += _markdown_leaves(sec["leaves"], cfg) if "leaves" in sec else []
    L += _markdown_compile(sec["compile"]) if "compile" in sec else []
    path.write_text("\n".join([*L, "![charts](report.png)", ""]))


def write_chart(report: dict[str, Any], path: Path) -> None:
    sec, m = report["sections"], report["machine"]
    load = m.get("load_average_at_start")
    fig, axes = harness.figure(
        3,
        2,
        (15, 16),
        f"autoflat benchmark report{' (--quick)' if report['config']['quick'] else ''}: "
        f"{m['cpu_count']} CPUs, {m['jax_backend']}, jax {report['versions'].get('jax')}"
        + (f", load average {load[0]:.1f} at start" if load else ""),
    )
    (ax_seed, ax_sweep), (ax_eqx, ax_nnx), (ax_comp, ax_mem) = axes
    if "seed" in sec:
        rows = sec["seed"]["rows"]
        harness.hbars(
            ax_seed,
            [r["variant"] for r in rows],
            [r["us_per_iteration"] for r in rows],
            "tab:purple",
            f"1. flatten + unflatten of (model, adam state): µs per iteration "
            f"({sec['seed']['state_leaves']['leaves']} leaves)",
            "µs per iteration (log)",
        )
    else:
        harness.not_run(ax_seed, "1. seed tutorial")
    if "leaves" in sec:
        r, series = sec["leaves"], []
        for k, (_, label, color, style) in SWEEP_STYLES.items():
            pts = [(n, _sweep_rows(r, n).get(k, {})) for n in r["leaves"]]
            pts = [(n, x["us_per_step"]) for n, x in pts if "us_per_step" in x]
            series.append((label, color, style, [n for n, _ in pts], [x for _, x in pts]))
        harness.lines(ax_sweep, series)
        ax_sweep.set(xscale="log", yscale="log", xlabel="leaves in the state (arrays of 8 f32)")
        ax_sweep.set_ylabel("µs per step (median, min–max)")
        ax_sweep.set_title("3. overhead vs leaves: x*0.99+g on every leaf", fontsize=10)
    else:
        harness.not_run(ax_sweep, "3. overhead vs leaves")
    steps = sec.get("steps", {})
    harness.step_bars(ax_eqx, steps.get("equinox"), "2. Equinox narrow ResNet50 + adam: per step")
    harness.step_bars(ax_nnx, steps.get("nnx"), "2. Flax NNX narrow ResNet50 + adam: per step")
    comp = sec.get("compile", {})
    rows = [x for x in comp.get("compile", {}).get("rows", []) if "first_call_s" in x]
    if rows:
        harness.hbars(
            ax_comp,
            [x["method"] for x in rows],
            [x["first_call_s"] for x in rows],
            ["tab:blue" if x["key"].startswith("autoflat") else "tab:red" for x in rows],
            "4. first call (trace + compile + 1 call), s",
            "seconds",
            log=False,
        )
    else:
        harness.not_run(ax_comp, "4. compile")
    mrows = [x for x in comp.get("memory", {}).get("rows", []) if "held_in_states" in x]
    if mrows:
        y = np.arange(len(mrows))
        for dy, what, label, color in (
            (-0.2, "held_in_states", "held across a call", "tab:orange"),
            (0.2, "steady_in_states", "steady", "tab:cyan"),
        ):
            ax_mem.barh(y + dy, [x[what] for x in mrows], height=0.4, label=label, color=color)
        ax_mem.set_yticks(y, [x["method"] for x in mrows], fontsize=8)
        ax_mem.invert_yaxis()
        ax_mem.set_xlabel("live device bytes / state bytes")
        ax_mem.set_title("4. memory (jax.live_arrays), in state sizes", fontsize=10)
        ax_mem.legend(fontsize=8)
        ax_mem.grid(axis="x", alpha=0.3)
    else:
        harness.not_run(ax_mem, "4. memory")
    harness.save(fig, path)


# ==========================================================================================
# Main
# ==========================================================================================

SECTIONS = {
    "1": ("seed", "the seed tutorial's measurement", section_seed),
    "2": ("steps", "per-step host overhead of a whole training step", section_steps),
    "3": ("leaves", "overhead against the number of leaves", section_leaves),
    "4": ("compile", "compile time and memory", section_compile_memory),
}


def _count_failures(x: Any) -> int:
    if isinstance(x, dict):
        own = "error" in x and ("method" in x or "key" in x)
        return own + sum(_count_failures(v) for v in x.values())
    return sum(_count_failures(v) for v in x) if isinstance(x, list) else 0


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(
        "autoflat benchmark report (sections: 1 seed, 2 steps, 3 leaves, 4 compile)",
        width=2,
        batch_size=8,
        image_size=16,
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output folder")
    ap.add_argument("--sections", default="1,2,3,4", help="comma-separated subset of 1,2,3,4")
    ap.add_argument("--iterations", type=int, default=None, help="section 1 iterations")
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
        log(f"rendered {out_dir / 'report.md'} and {out_dir / 'report.png'}")
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
        "command": harness.command("benchmarks/report.py", sys.argv[1:]),
        "machine": harness.machine(),
        "versions": harness.versions(),
        "config": cfg,
        "sections": {},
        "errors": {},
    }
    log("# autoflat benchmark report" + (" (--quick)" if quick else ""))
    log("\n".join(harness.environment_lines(report["machine"], report["versions"])))
    log(f"output: {out_dir.resolve()}")
    json_path = out_dir / "report.json"
    for i, w in enumerate(wanted):
        name, title, fn = SECTIONS[w]
        log(f"[{i + 1}/{len(wanted)}] section {w}: {title} ({perf() - t_start:.0f} s elapsed)")
        t0 = perf()
        try:
            report["sections"][name] = fn(args, cfg, report["sections"])
            report["sections"][name]["seconds"] = perf() - t0
        except Exception:
            report["errors"][w] = traceback.format_exc()
            log(f"  section {w} FAILED:\n{report['errors'][w]}")
        gc.collect()
        report["total_seconds"] = perf() - t_start
        report["load_average_at_end"] = harness.load_average()
        harness.write_json(report, json_path)

    for what, writer in (("report.md", write_markdown), ("report.png", write_chart)):
        try:
            writer(report, out_dir / what)
        except ModuleNotFoundError as e:  # matplotlib, on an accelerator's bare machine
            log(f"{what} not written: {e} (the tables are complete without it)")
        except Exception:
            report["errors"][what] = traceback.format_exc()
            log(f"writing {what} FAILED:\n{report['errors'][what]}")
    harness.write_json(report, json_path)
    failed = len(report["errors"]) + _count_failures(report["sections"])
    log(
        f"done in {report['total_seconds']:.0f} s: {out_dir / 'report.md'}, {json_path}, "
        f"{out_dir / 'report.png'}" + (f"; {failed} failure(s), see the report" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
