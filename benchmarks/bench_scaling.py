"""Per-step time of the narrow ResNet50 step, data parallel over 1 to 8 devices and 2 processes.

    python benchmarks/bench_scaling.py [--quick] [--repeats N] [--block-seconds S]
        [--devices 1,2,4,8] [--no-processes] [--process-repeats N] [--batch-size 16]
        [--timeout S] [--out PREFIX]

`--quick` (3 blocks of about 0.2 s per variant; 2 with 2 processes) took 10 minutes on
a busy 2-core machine, most of it compiling (4 variants x 5 configurations, 15-40 s each) and
the 2-process configuration, where a step takes about a second; the default is 5 blocks of
about 0.4 s.

The step is the benchmarks' Equinox training step (`benchmarks/models.py`: `update` of the
narrow ResNet50, width 2, with Adam; 484 state arrays) under `autoflat.step`, in four
variants:

- `k=1 flat`: `num_steps=1, pack=False`, one buffer per state leaf;
- `k=1 packed`: `num_steps=1, pack=True`, the leaves packed into one buffer per dtype where
  packing applies (see below);
- `k=10 flat` and `k=10 packed`: the same with `num_steps=10`, ten steps per call in a
  `lax.scan`, inputs with a leading axis of 10.

Each variant runs data parallel on a one-axis mesh `data` of the configuration's devices:
the model and the Adam state replicated (`NamedSharding(mesh, P())`), each step's batch split
over `data` (`P("data")`; a chunk of 10 steps is made by `autoflat.chunks(...,
sharding=NamedSharding(mesh, P("data")))`, which leaves the steps axis unsplit). The global
batch is fixed (16 images of 16x16 by default), so the work per device shrinks as devices
are added: 16 images on 1 device, 2 on 8.

Configurations, each in its own subprocess(es) of this script (the device count of a CPU
process, `XLA_FLAGS=--xla_force_host_platform_device_count=N`, is fixed when JAX starts):

- 1, 2, 4 and 8 host CPU devices in one process;
- 2 processes x 2 devices on this machine (loopback): `jax.distributed.initialize` on
  127.0.0.1 and a free port, gloo CPU collectives; each process feeds its own half of every
  batch (`jax.make_array_from_process_local_data`, and `autoflat.chunks` for chunks). The
  processes are started together and waited for with one deadline (`--timeout`); when one
  fails or runs past it, the others are killed (they would wait in a collective).

Within a configuration the four variants are checked and timed side by side in one process,
as `benchmarks/harness.py` times methods: first every variant runs 10 steps from the same
initial state on the same 10 distinct batches, and variants whose losses disagree are left
out (`harness.agree`: the k=1 variants against k=1 flat, k=10 packed against k=10 flat over
3 steps, k=10 flat against k=1 flat on the first step). Then each is warmed up, its calls per
block calibrated to about `--block-seconds`, and blocks run round-robin (the order rotating
every repeat), `--repeats` rounds, every block continuing from the state the variant's
previous block returned, one `jax.block_until_ready` at its end; the step must stay on
autoflat's fast path (no flatten, no trace) while timed. A block is at least 2 calls, so with
2 processes a k=10 block is 20 steps of about a second: that configuration runs
`--process-repeats` blocks (default 2). With 2 processes every decision of
the calibration and every block time is process 0's, broadcast to the other
(`multihost_utils.broadcast_one_to_all`, outside the timed calls), so both run the same calls.

Figures:

- **µs/step**: the median over the blocks of (block time / steps in the block), with its
  spread (min-max over the blocks). For k=10, a tenth of the time of one call.
- **× k=1 flat**: the variant's median over k=1 flat's median *of the same configuration*
  (same process, interleaved blocks): the figure to compare across variants.
- Across configurations only the absolute medians can be compared, and they come from
  separate processes run one after the other, so a change in the machine's load between them
  shows up there and not in the ratios.
- **buffers**: state buffers the compiled program takes per call (`Lowered.args`): packing
  never packs a leaf whose sharding spans several devices, so with replicated state packing
  applies on 1 device only.

Written to `--out`.md and `--out`.json (default `benchmarks/results/scaling`), with the load
average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks`, this autoflat

# The parent process never computes: jax is imported here (by the harness) with whatever
# device count; each configuration runs in a child started with its own XLA_FLAGS.
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autoflat  # noqa: E402
from benchmarks import harness, models  # noqa: E402
from benchmarks.harness import Method, Plan  # noqa: E402

K = 10
VARIANTS = (  # key, label, num_steps, pack
    ("k1_flat", "k=1 flat", 1, False),
    ("k1_pack", "k=1 packed", 1, True),
    ("k10_flat", f"k={K} flat", K, False),
    ("k10_pack", f"k={K} packed", K, True),
)
REFERENCE = "k1_flat"


# ==========================================================================================
# One configuration: the child process(es)
# ==========================================================================================


class SyncedMethod(Method):
    """A variant whose block times are process 0's in every process of a multi-process run,
    so `harness.calibrate` and `harness.time_methods` make the same decisions (calls per
    probe, calls per block) everywhere, and every process launches the same programs."""

    def run(self, n: int) -> tuple[float, float]:
        dispatch, total = super().run(n)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            dispatch, total = multihost_utils.broadcast_one_to_all(np.array([dispatch, total]))
        return float(dispatch), float(total)


def to_host(x: Any) -> np.ndarray:
    """A replicated (possibly global) array's value."""
    return np.asarray(x.addressable_data(0))


def child(args: argparse.Namespace) -> None:
    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    machine = harness.machine()
    n_proc, rank = jax.process_count(), jax.process_index()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))
    if args.batch_size % len(devices):
        raise SystemExit(f"batch {args.batch_size} does not split over {len(devices)} devices")
    per_process = args.batch_size // n_proc
    mine = slice(rank * per_process, (rank + 1) * per_process)

    setup = models.Setup(args.width, args.batch_size, args.image_size)
    host_state = jax.tree_util.tree_map(
        lambda x: np.asarray(x) if eqx.is_array(x) else x, (setup.model, setup.opt_state)
    )
    to_numpy = lambda batch: jax.tree_util.tree_map(np.asarray, batch)  # noqa: E731
    timed_batch = to_numpy(setup.args[0])
    check_batches = [to_numpy(b[0]) for b in setup.checks]

    def place_state() -> tuple[Any, Any]:
        """Fresh replicated buffers of the initial state, made in every process from its own
        copy (no transfer between processes)."""

        def place(x: Any) -> Any:
            if not isinstance(x, np.ndarray):
                return x
            return jax.make_array_from_callback(x.shape, replicated, lambda index: x[index])

        return jax.tree_util.tree_map(place, host_state)

    def local(batch: Any) -> Any:
        return jax.tree_util.tree_map(lambda a: a[mine], batch)

    def place_step(batch: Any) -> Any:
        """One step's global batch, built from this process's rows."""
        return jax.tree_util.tree_map(
            lambda a, g: jax.make_array_from_process_local_data(batch_sharding, a, g.shape),
            local(batch),
            batch,
        )

    def place_chunk(batches: list[Any]) -> Any:
        """A chunk of len(batches) steps, as a training loop would get it from chunks."""
        it = autoflat.chunks(
            [local(b) for b in batches], len(batches), sharding=batch_sharding, prefetch=0
        )
        return next(iter(it))

    methods: list[Method] = []
    for key, label, k, pack in VARIANTS:

        def make(k: int = k, pack: bool = pack) -> Plan:
            return Plan(lambda: autoflat.step(models.update, num_steps=k, pack=pack), place_state())

        note = f"autoflat.step(update, num_steps={k}, pack={pack}); returned handles passed back"
        methods.append(SyncedMethod(key, label, make, steps_per_call=k, note=note))

    harness.log(
        f"[{args.name}] {n_proc} process(es) x {jax.local_device_count()} devices, mesh "
        f"{dict(mesh.shape)}, global batch {args.batch_size} ({args.batch_size // len(devices)} "
        f"per device)"
    )
    t0 = harness.perf()
    for m in methods:  # serially, in the same order in every process
        try:
            m.setup(())
            m.args = (
                (place_step(timed_batch),)
                if m.steps_per_call == 1
                else (place_chunk([timed_batch] * m.steps_per_call),)
            )
            t1 = harness.perf()
            if m.steps_per_call == 1:
                losses = [to_host(m.call(place_step(b))) for b in check_batches]
            else:
                losses = [to_host(m.call(place_chunk(check_batches)))]
            m.check_losses = np.concatenate([np.reshape(x, (-1,)) for x in losses])
            m.first_call_s = harness.perf() - t1
        except Exception as e:
            harness.fail(m, e, " in its first calls")
    harness.log(f"  [{args.name}] first calls (compiles) done in {harness.perf() - t0:.0f} s")
    agreement = harness.agree(methods, len(check_batches))
    harness.time_methods(methods, args.repeats, args.block_seconds, title=args.name)

    rows = harness.method_rows(methods)
    for m, row in zip(methods, rows, strict=True):
        row["label"] = m.label
        if m.error is None:
            try:  # after timing: `lower` reads the handles the last block returned
                lowered = m.fn.lower(*m.state, *m.args)
                row["state_buffers"] = sum(len(s) for s in lowered.args[0])
            except Exception as e:
                row["state_buffers"] = f"{type(e).__name__}: {e}"
    ok = {r["key"]: r for r in rows if "us_per_step" in r}
    for r in ok.values():
        if REFERENCE in ok:
            r["ratio_to_k1_flat"] = (
                r["us_per_step"]["median"] / (ok[REFERENCE]["us_per_step"]["median"])
            )
    result = {
        "name": args.name,
        "processes": n_proc,
        "devices_per_process": jax.local_device_count(),
        "devices": len(devices),
        "global_batch": args.batch_size,
        "per_device_batch": args.batch_size // len(devices),
        "machine": machine,
        "load_average_at_end": harness.load_average(),
        "state_arrays": models.count_leaves(host_state)["arrays"],
        "agreement": agreement,
        "rows": rows,
    }
    if rank == 0:
        harness.write_json(result, args.result)
    for r in rows:
        if "us_per_step" in r:
            harness.log(
                f"  [{args.name}] {r['label']}: {harness.fmt(r['us_per_step']['median'])} "
                f"µs/step ({harness.spread(r['us_per_step'])}), "
                f"× k=1 flat {r.get('ratio_to_k1_flat', float('nan')):.2f}, "
                f"{r.get('state_buffers')} buffers"
            )
        else:
            harness.log(f"  [{args.name}] {r['label']}: {r.get('error')}")


# ==========================================================================================
# The parent: one child per configuration, then the report
# ==========================================================================================


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices_per_process: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
    env["XLA_FLAGS"] = env["XLA_FLAGS"].strip()
    return env


def run_configuration(
    name: str, processes: int, devices: int, options: list[str], timeout: float, tmp: Path
) -> dict[str, Any]:
    """Start the configuration's process(es), wait for all with one deadline; if one fails or
    the deadline passes, kill the others. Process 0's output goes to this one's; the others'
    to files, shown on failure. Returns process 0's result, or the error."""
    result = tmp / f"{name.replace(' ', '_')}.json"
    port = free_port()
    procs, logs = [], []
    for rank in range(processes):
        cmd = [
            sys.executable,
            __file__,
            *options,
            "--child",
            f"--name={name}",
            f"--result={result}",
            f"--process-id={rank}",
            f"--num-processes={processes}",
            f"--port={port}",
        ]
        out = None
        if rank > 0:
            logs.append(tmp / f"{name.replace(' ', '_')}-{rank}.log")
            out = logs[-1].open("wb")
        procs.append(
            subprocess.Popen(
                cmd, env=child_env(devices), stdout=out, stderr=subprocess.STDOUT if out else None
            )
        )
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    codes = [p.returncode for p in procs]
    if timed_out or any(codes) or not result.exists():
        what = f"ran past {timeout:.0f} s" if timed_out else f"exit codes {codes}"
        for path in logs:
            harness.log(f"--- {path.name} ---\n" + path.read_text(errors="replace")[-3000:])
        return {"name": name, "processes": processes, "error": f"failed ({what})"}
    return json.loads(result.read_text())


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    if "us_per_step" not in row:
        return "failed"
    return f"{harness.fmt(row['us_per_step']['median'])} ({harness.spread(row['us_per_step'])})"


def report(
    results: list[dict[str, Any]],
    machine: dict[str, Any],
    versions: dict[str, str],
    end_load: Any,
    config: dict[str, Any],
) -> list[str]:
    labels = [label for _, label, _, _ in VARIANTS]
    ratio_rows, abs_rows, buffer_rows = [], [], []
    for r in results:
        name = r["name"]
        if "error" in r:
            ratio_rows.append([name, "–", "–", f"failed: {r['error']}", "", "", ""])
            abs_rows.append([name, *["failed"] * len(VARIANTS), str(r.get("repeats")), "–"])
            continue
        by = {x["key"]: x for x in r["rows"]}
        ref = by.get(REFERENCE, {})
        ratios = [
            f"{by[k]['ratio_to_k1_flat']:.2f}" if "ratio_to_k1_flat" in by.get(k, {}) else "–"
            for k, _, _, _ in VARIANTS[1:]
        ]
        ratio_rows.append(
            [
                name,
                str(r["devices"]),
                str(r["per_device_batch"]),
                harness.fmt(ref["us_per_step"]["median"]) if "us_per_step" in ref else "–",
                *ratios,
            ]
        )
        load = (r.get("load_average_at_end") or ["?"])[0]
        abs_rows.append(
            [
                name,
                *[cell(by.get(k)) for k, _, _, _ in VARIANTS],
                str(r["repeats"]),
                f"{load:.1f}" if isinstance(load, float) else str(load),
            ]
        )
        buffer_rows.append(
            [name, *[str(by.get(k, {}).get("state_buffers", "–")) for k, *_ in VARIANTS]]
        )
    la0 = machine.get("load_average_at_start") or [0, 0, 0]
    busy = max(la0[0], (end_load or [0])[0]) > 0.5 * (machine.get("cpu_count") or 1)
    m = dict(machine, n_devices="1-8 (per configuration)", xla_flags="")
    return [
        "# Data parallel scaling: the narrow ResNet50 step on 1-8 devices and 2 processes",
        "",
        *harness.environment_lines(m, versions, end_load),
        f"- **Step**: benchmarks/models.py `update` (narrow ResNet50, width {config['width']}, "
        f"Adam, {results[0].get('state_arrays', '?')} state arrays), state replicated, batch "
        f"split over a `data` mesh axis; global batch {config['batch_size']} images of "
        f"{config['image_size']}x{config['image_size']}, fixed, so the work per device shrinks "
        "as devices are added",
        f"- **Timing**: per configuration, {config['repeats']} round-robin blocks (2 "
        f"processes: {config['process_repeats']}) of about {config['block_s']:g} s per "
        "variant, at least 2 calls each, the four variants interleaved in one process "
        "(process 0's times with 2 processes); median µs per step, spread min-max",
        "",
        *(
            [
                "**These figures were taken on a busy machine** (another job running "
                "benchmarks on the same 2 cores; load average above): the ratios within a "
                "configuration come from interleaved blocks and are the figures to read; the "
                "absolute times are noisy.",
                "",
            ]
            if busy
            else []
        ),
        "Ratios within each configuration (same process, interleaved blocks): each variant's "
        "median µs/step over k=1 flat's.",
        "",
        *harness.table(
            [
                "configuration",
                "devices",
                "batch/device",
                "k=1 flat µs/step",
                *[f"{x} ×" for x in labels[1:]],
            ],
            "lrrrrrr",
            ratio_rows,
        ),
        "",
        "Absolute µs/step, median (min-max over blocks). Each row is a separate process (or "
        "pair of processes), run one after the other: compare rows with care. The devices are "
        f"host CPU devices that share this machine's {machine.get('cpu_count')} cores, so "
        "adding devices adds no compute: the rows mostly show what the collectives between "
        "devices (and, with 2 processes, gloo over loopback) cost here, not a speedup to "
        "expect on real hardware.",
        "",
        *harness.table(
            ["configuration", *labels, "blocks", "load (1 min) at its end"],
            "l" + "r" * (len(labels) + 2),
            abs_rows,
        ),
        "",
        "State buffers per call (`Lowered.args`): packing never packs a leaf placed on "
        "several devices, so with replicated state `pack=True` packs on one device only. "
        "Where packed and flat take the same buffers, their ratio above shows the noise "
        "between variants timed side by side, not an effect of packing.",
        "",
        *harness.table(["configuration", *labels], "l" + "r" * len(labels), buffer_rows),
        "",
        "Reproduce: `python benchmarks/bench_scaling.py` (`--quick` for short blocks); its "
        "docstring says how each figure is made.",
    ]


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__.splitlines()[0], width=2, batch_size=16, image_size=16)
    ap.add_argument("--devices", default="1,2,4,8", help="device counts in one process")
    ap.add_argument("--no-processes", action="store_true", help="skip 2 processes x 2 devices")
    ap.add_argument(
        "--process-repeats",
        type=int,
        default=2,
        help="timed blocks per variant with 2 processes (a step takes about a second there, "
        "and a block is at least 2 calls: 20 steps at k=10)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    ap.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "scaling"),
        help="write PREFIX.md and PREFIX.json (default: benchmarks/results/scaling)",
    )
    for hidden in ("--name", "--result", "--port"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.block_seconds = args.block_seconds or (0.2 if args.quick else 0.4)
    if args.child:
        return child(args)

    machine, versions = harness.machine(), harness.versions()
    harness.log("\n".join(harness.environment_lines(machine, versions)))
    options = [
        f"--block-seconds={args.block_seconds}",
        f"--width={args.width}",
        f"--batch-size={args.batch_size}",
        f"--image-size={args.image_size}",
    ]
    configs = [(f"{n} device{'s' * (n > 1)}", 1, n) for n in map(int, args.devices.split(","))]
    if not args.no_processes:
        configs.append(("2 processes x 2 devices", 2, 2))
    repeats = {name: args.repeats for name, _, _ in configs}
    repeats["2 processes x 2 devices"] = min(args.repeats, args.process_repeats)
    t0 = harness.perf()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, processes, devices in configs:
            t1 = harness.perf()
            results.append(
                run_configuration(
                    name,
                    processes,
                    devices,
                    [*options, f"--repeats={repeats[name]}"],
                    args.timeout,
                    Path(tmp),
                )
            )
            results[-1] |= {"wall_s": harness.perf() - t1, "repeats": repeats[name]}
            harness.log(f"[{name}] done in {results[-1]['wall_s']:.0f} s")
    end_load = harness.load_average()
    config = {
        "repeats": args.repeats,
        "process_repeats": min(args.repeats, args.process_repeats),
        "block_s": args.block_seconds,
        "width": args.width,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "num_steps": [1, K],
    }
    lines = report(results, machine, versions, end_load, config)
    out = Path(args.out)
    harness.write_json(
        {
            "machine": machine,
            "versions": versions,
            "load_average_at_end": end_load,
            "total_wall_s": harness.perf() - t0,
            "config": config,
            "note": "each configuration ran in its own process(es), one after the other; "
            "ratios are within a configuration, absolute times across them",
            "configurations": results,
        },
        out.with_suffix(".json"),
    )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("", *lines, sep="\n")
    harness.log(f"written to {out.with_suffix('.md')} and .json in {harness.perf() - t0:.0f} s")


if __name__ == "__main__":
    main()
