"""The replay path against the general call path, side by side in one process.

    python benchmarks/bench_replay.py [--models ab] [--repeats N] [--json PATH]

A call that passes back only the handles the previous call returned, with the same static
and broadcast objects, takes the replay path (`Stats.replays`): a few identity checks, then
the compiled call. This benchmark runs the same training loop twice per configuration, once
as usual and once with the replay path switched off (every call takes the general path:
argument binding, the per-argument fast path, the spec lookup), on the models of
`bench_transport.py`: (a) the narrow ResNet50-structured model and (b) the MLP of 50 4x4
layers, both with Adam, for `pack` in False and "auto" and `num_steps` in 1 and 10.

Reported, as in `bench_transport.py`: the host time of a call with the device idle at its
start (mean over the calls of a block, median over blocks), the CPU time the calling thread
spends in it (`time.thread_time`), and general ÷ replay for both. The two loops alternate
block by block, so slow spells of the machine fall on both.

`--hot` measures autoflat's own work per call alone: the same loops at `num_steps=1` with
the compiled call replaced by one that returns a real call's outputs at once, so nothing
waits for the device and the caches stay warm (best of 5 runs of 20,000 calls).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_transport as bt  # noqa: E402

import autoflat  # noqa: E402


def _general_path_only(step: Any) -> None:
    """Switch the replay path off for this step: every call takes the general path, and no
    replay record is made, as before the replay path existed."""
    step._use_replay = False


def run(name: str, case: Any, repeats: int, n_calls: int) -> list[dict[str, Any]]:
    model, batch, loss_fn = case(False)
    update = bt.make_update(loss_fn)
    opt_state = bt.tx.init(eqx.filter(model, eqx.is_array))
    rows = []
    for k in (1, 10):
        batches = jax.tree.map(lambda x, k=k: jnp.stack([x] * k), batch) if k > 1 else batch
        for pack in (False, "auto"):
            loops = {}
            for path in ("replay", "general"):
                step = autoflat.step(update, num_steps=k, pack=pack)
                if path == "general":
                    _general_path_only(step)
                state = step(model, opt_state, batches)  # compile
                state = step(*state[:2], batches)
                jax.block_until_ready(state[2])
                loops[path] = [step, state]
            wall: dict[str, list[float]] = {p: [] for p in loops}
            cpu: dict[str, list[float]] = {p: [] for p in loops}
            for r in range(repeats):
                order = list(loops) if r % 2 == 0 else list(loops)[::-1]
                for path in order:
                    lp = loops[path]
                    in_calls = cpu_in_calls = 0.0
                    for _ in range(n_calls):
                        # the device idle at the start of each call (raw buffers: blocking on a
                        # packed handle would unpack it)
                        jax.block_until_ready([h._af_arrays for h in lp[1][:2]])
                        c0 = time.perf_counter()
                        t0 = time.thread_time()
                        lp[1] = lp[0](*lp[1][:2], batches)
                        cpu_in_calls += time.thread_time() - t0
                        in_calls += time.perf_counter() - c0
                    jax.block_until_ready(lp[1])
                    wall[path].append(in_calls / n_calls)
                    cpu[path].append(cpu_in_calls / n_calls)
            stats = {p: autoflat.stats(loops[p][0]) for p in loops}
            assert stats["general"].replays == 0 and stats["replay"].replays > 0
            w = {p: float(np.median(wall[p])) * 1e6 for p in loops}
            c = {p: float(np.median(cpu[p])) * 1e6 for p in loops}
            rows.append(
                {
                    "model": name,
                    "num_steps": k,
                    "pack": str(pack),
                    "replay_us": w["replay"],
                    "general_us": w["general"],
                    "wall_ratio": w["general"] / w["replay"],
                    "replay_cpu_us": c["replay"],
                    "general_cpu_us": c["general"],
                    "cpu_ratio": c["general"] / c["replay"],
                }
            )
            print(
                f"  num_steps={k} pack={pack!s}: replay {w['replay']:.0f} µs "
                f"(CPU {c['replay']:.0f}), general {w['general']:.0f} µs (CPU {c['general']:.0f})",
                flush=True,
            )
    return rows


def run_hot(name: str, case: Any, n_calls: int = 20_000) -> list[dict[str, Any]]:
    """autoflat's own work per call, caches warm: the compiled call is replaced by one that
    returns the outputs of a real call at once, and the loop never waits for the device."""
    model, batch, loss_fn = case(False)
    update = bt.make_update(loss_fn)
    opt_state = bt.tx.init(eqx.filter(model, eqx.is_array))
    set_consumed = vars(autoflat.LazyHandle)["_af_consumed_by"].__set__
    rows = []
    for pack in (False, "auto"):
        us = {}
        for path in ("replay", "general"):
            step = autoflat.step(update, pack=pack)
            if path == "general":
                _general_path_only(step)
            state = step(model, opt_state, batch)
            state = step(*state[:2], batch)
            (spec,) = step._specs.values()
            out = step._jit(spec, tuple(h._af_arrays for h in state[:2]), (batch,), ())
            jax.block_until_ready(out)
            step._jit = lambda *args, out=out: out
            handles = state[:2]
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    set_consumed(handles[0], 0)  # the stub donates nothing: reuse the handles
                    set_consumed(handles[1], 0)
                    step(*handles, batch)
                best = min(best, (time.perf_counter() - t0) / n_calls)
            us[path] = best * 1e6
        rows.append(
            {
                "model": name,
                "pack": str(pack),
                "replay_us": us["replay"],
                "general_us": us["general"],
            }
        )
        print(f"  pack={pack!s}: replay {us['replay']:.1f} µs, general {us['general']:.1f} µs")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ab", help="which of the models a, b to run")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200, help="calls per block")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--hot",
        action="store_true",
        help="only autoflat's own work per call, with the compiled call stubbed out",
    )
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs")
    rows = []
    for key, name, case in (
        ("a", "a. narrow ResNet50 + adam", bt.resnet_case),
        ("b", "b. tiny MLP (~300 leaves) + adam", bt.tiny_mlp_case),
    ):
        if key in args.models:
            print(f"running {name} ...", flush=True)
            if args.hot:
                rows += run_hot(name, case)
            else:
                rows += run(name, case, args.repeats, args.calls)
    if args.hot:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    print()
    print(
        "| model | num_steps | pack | replay µs/call | general µs/call | general ÷ replay "
        "| replay CPU µs | general CPU µs | CPU general ÷ replay |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['num_steps']} | {r['pack']} | {r['replay_us']:,.0f} | "
            f"{r['general_us']:,.0f} | {r['wall_ratio']:.2f} | {r['replay_cpu_us']:,.0f} | "
            f"{r['general_cpu_us']:,.0f} | {r['cpu_ratio']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
