"""Soak: does a long run keep memory and live arrays flat? (issue 13; a benchmark, not a test)

    python benchmarks/bench_soak.py                     # 100,000 calls, 1,000 steps
    python benchmarks/bench_soak.py --calls 10000 --steps 100 --out DIR

Two phases, each measured before and after (RSS from /proc/self/statm, `len(jax.live_arrays())`,
after `gc.collect()`):

1. **Calls.** One step (dict state of 12 leaves with Adam-like moments, a per-step input, a
   broadcast scale), called `--calls` times with the returned handles passed back, as a
   training loop does; RSS and live arrays after a warm-up of 1,000 calls and at the end, and
   at every tenth of the run (the JSON keeps the curve).
2. **Steps created and dropped.** `--steps` new `autoflat.step`s of a fresh function (each
   generated, compiled and called twice with its own broadcast array), then dropped; RSS and
   live arrays before and after, and how many `Step` objects are still alive (weak refs).
3. **For scale:** the same number of plain `jax.jit` functions of a fresh function (a
   hand-written loop of the two steps), compiled, called twice and dropped.

Writes `soak.md` and `soak.json` into `--out` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoflat  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def snapshot() -> dict[str, float]:
    gc.collect()
    return {"rss_mb": round(rss_mb(), 1), "live_arrays": len(jax.live_arrays())}


def update(state, x, scale):
    grads = {k: jnp.tanh(v) * x * scale for k, v in state["params"].items()}
    mu = {k: 0.9 * state["mu"][k] + 0.1 * g for k, g in grads.items()}
    params = {k: v - 1e-3 * mu[k] for k, v in state["params"].items()}
    state = {"params": params, "mu": mu, "count": state["count"] + 1}
    return state, jnp.sum(x)


def phase_calls(n_calls: int) -> dict[str, object]:
    step = autoflat.step(update, num_steps=1, broadcast="scale")
    state = {
        "params": {f"w{i}": jnp.ones((16, 16)) for i in range(6)},
        "mu": {f"w{i}": jnp.zeros((16, 16)) for i in range(6)},
        "count": jnp.zeros((), jnp.int32),
    }
    x, scale = jnp.ones(()), jnp.float32(0.5)
    warmup = min(1000, n_calls // 10)
    for _ in range(warmup):
        state, loss = step(state, x, scale)
    jax.block_until_ready(loss)
    start = snapshot()
    curve = []
    t0 = time.perf_counter()
    tenth = max(1, (n_calls - warmup) // 10)
    for i in range(n_calls - warmup):
        state, loss = step(state, x, scale)
        if (i + 1) % tenth == 0:
            jax.block_until_ready(loss)
            curve.append({"calls": warmup + i + 1, **snapshot()})
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - t0
    end = snapshot()
    stats = autoflat.stats(step)
    return {
        "calls": n_calls,
        "after_warmup": start,
        "end": end,
        "curve": curve,
        "seconds": round(seconds, 1),
        "traces": stats.traces,
        "fast_path": stats.fast_path,
    }


def phase_steps(n_steps: int) -> dict[str, object]:
    before = snapshot()
    refs = []
    for i in range(n_steps):
        # A fresh function object each time (as a notebook re-running a cell does).
        def fresh(p, x, w):
            p = p + x * w
            return p

        step = autoflat.step(fresh, num_steps=2, broadcast="w")
        w = jnp.full((64,), float(i))
        p = step(jnp.zeros(64), jnp.ones((2, 64)), w)
        p = step(p, jnp.ones((2, 64)), w)
        jax.block_until_ready(p)
        refs.append(weakref.ref(step))
        del step, w, p, fresh
    after = snapshot()
    return {
        "steps": n_steps,
        "before": before,
        "after": after,
        "steps_alive": sum(r() is not None for r in refs),
    }


def phase_jit_functions(n_steps: int) -> dict[str, object]:
    """The same as `phase_steps` with plain `jax.jit` of a fresh function each time: what
    JAX itself keeps per compiled function, for scale."""
    before = snapshot()
    for i in range(n_steps):

        def fresh(p, xs, w):
            for x in xs:
                p = p + x * w
            return p

        f = jax.jit(fresh)
        w = jnp.full((64,), float(i))
        p = f(jnp.zeros(64), jnp.ones((2, 64)), w)
        p = f(p, jnp.ones((2, 64)), w)
        jax.block_until_ready(p)
        del f, w, p, fresh
    return {"steps": n_steps, "before": before, "after": snapshot()}


def render(result: dict[str, object]) -> str:
    c, s, j = result["calls"], result["steps"], result["jit"]
    lines = [
        "# Soak: memory and live arrays over a long run",
        "",
        f"JAX {jax.__version__}, backend {jax.default_backend()}; "
        f"`python benchmarks/bench_soak.py --calls {c['calls']} --steps {s['steps']}`.",
        "",
        "| phase | RSS before (MB) | RSS after (MB) | live arrays before | live arrays after |",
        "|---|---|---|---|---|",
        f"| {c['calls']:,} calls, handles passed back (from call 1,000) | "
        f"{c['after_warmup']['rss_mb']} | {c['end']['rss_mb']} | "
        f"{c['after_warmup']['live_arrays']} | {c['end']['live_arrays']} |",
        f"| {s['steps']:,} steps created, called twice, dropped | {s['before']['rss_mb']} | "
        f"{s['after']['rss_mb']} | {s['before']['live_arrays']} | {s['after']['live_arrays']} |",
        f"| for scale: {j['steps']:,} plain `jax.jit` functions, called twice, dropped | "
        f"{j['before']['rss_mb']} | {j['after']['rss_mb']} | {j['before']['live_arrays']} | "
        f"{j['after']['live_arrays']} |",
        "",
        f"Calls phase: {c['seconds']} s, {c['traces']} trace(s), {c['fast_path']} fast-path "
        f"state intakes. Steps still alive after the steps phase: {s['steps_alive']} of "
        f"{s['steps']}.",
        "",
        f"Phases in this order: calls, {result['order']}.",
        "",
        "RSS along the calls phase (MB): " + ", ".join(f"{p['rss_mb']}" for p in c["curve"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=1_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--jit-first", action="store_true", help="the jax.jit phase first")
    args = parser.parse_args()
    # RSS does not shrink when memory is freed: a later phase reuses what an earlier one
    # freed. `--jit-first` runs the plain jax.jit phase before the steps phase.
    result: dict[str, Any] = {"calls": phase_calls(args.calls)}
    if args.jit_first:
        result["jit"] = phase_jit_functions(args.steps)
    result["steps"] = phase_steps(args.steps)
    if not args.jit_first:
        result["jit"] = phase_jit_functions(args.steps)
    result["order"] = "jit first" if args.jit_first else "steps first"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (args.out / "soak.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
