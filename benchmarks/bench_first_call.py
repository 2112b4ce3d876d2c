"""First calls on the model zoo: autoflat at its defaults against `jax.jit`, side by side.

    python benchmarks/bench_first_call.py [--quick] [--models abcde] [--repeats N] [--out DIR]

For each model of `bench_zoo.py` (a-e), four first calls (trace, compile and one call, until
its results are ready), each in a fresh Python process (nothing traced, compiled or cached by
an earlier sample, JAX's persistent compilation cache off), the processes taking turns
round-robin, the order rotating every repeat:

- `jit`: `jax.jit` of the step, one step a call (Equinox: the model partitioned into arrays and
  the rest once, outside; Flax NNX: `nnx.split` once, `nnx.merge` inside, as Flax's
  performance guide writes it), no donation;
- `autoflat_1`: `autoflat.step(update)` at its defaults (one step a call, `pack="auto"`,
  donation);
- `scan`: `jax.jit` of a hand-written `lax.scan` of the same step over 10 batches;
- `autoflat_10`: `autoflat.step(update, num_steps=10)`, the same 10 batches;
- `flat_1`, `flat_10` (only when `--methods` names them): as `autoflat_1` and `autoflat_10`
  with `pack=False`, one buffer per leaf.

Reported: per model and method the median first call and its spread, the ratios autoflat
`num_steps=1` / `jax.jit` and autoflat `num_steps=10` / the scan, and where each first call's
time goes, from JAX's own monitoring events and autoflat's role inference: "roles" (the first
call's role inference, less the traces it makes), "trace" (tracing to jaxprs: the step's
program, and an abstract evaluation of the step where the roles make one), "lower" (to
StableHLO), "compile" (XLA) and "rest" (everything else: the call's Python, the transport,
the step run once); "traces" counts the traces. Time spans are merged, so a trace
nested in another (a `jax.jit` helper) counts once. "make" is building the callable (for
autoflat the decoration: the source read and the code generated), not in the first call.

`--compare NAME=DIR` (repeatable) also runs the autoflat methods with the autoflat package
found in DIR (a copy of another version: `DIR/autoflat/`), in the same round-robin, as
columns NAME: before/after figures measured side by side.

Writes `first_call.md` and `first_call.json` to `--out` (default benchmarks/results).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat
# A sample of `--compare NAME=DIR`: the autoflat package in DIR instead of this one.
if os.environ.get(_COMPARE := "AUTOFLAT_FIRST_CALL_FROM"):
    sys.path.insert(0, os.environ[_COMPARE])

from benchmarks import harness  # noqa: E402

METHODS = ("jit", "autoflat_1", "scan", "autoflat_10")
FLAT = ("flat_1", "flat_10")  # (`--methods` only)
LABELS = {
    "flat_1": "autoflat num_steps=1, pack=False",
    "flat_10": "autoflat num_steps=10, pack=False",
    "jit": "jax.jit, 1 step",
    "autoflat_1": "autoflat num_steps=1",
    "scan": "jax.jit(lax.scan), 10 steps",
    "autoflat_10": "autoflat num_steps=10",
}
SCAN_STEPS = 10
PHASES = ("roles", "trace", "lower", "compile", "rest")
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


# ==========================================================================================
# One sample (in its own process)
# ==========================================================================================


def _steps(method: str) -> int:
    return SCAN_STEPS if method in ("scan", "autoflat_10", "flat_10") else 1


def _is_autoflat(method: str) -> bool:
    return method.startswith(("autoflat", "flat"))


def _equinox_callable(key: str, method: str) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """(a function building the callable, state, one call's batch args) of an Equinox-style
    model (a-d)."""
    import equinox as eqx

    import autoflat
    from benchmarks import bench_zoo, models

    model, batch, loss_fn = bench_zoo.CASES[key][1](False)
    update = models.make_update(loss_fn)
    opt_state = models.tx.init(eqx.filter(model, eqx.is_array))
    k = _steps(method)
    batches = (batch,) if k == 1 else (harness.repeat(batch, k),)
    if _is_autoflat(method):
        pack: Any = "auto" if method.startswith("autoflat") else False
        return lambda: autoflat.step(update, num_steps=k, pack=pack), (model, opt_state), batches
    # `jax.jit` of the step: a model with non-array leaves (activations) split once, outside.
    params, static = eqx.partition(model, eqx.is_array)

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        model, opt_state, loss = update(eqx.combine(params, static), opt_state, batch)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    if method == "jit":
        return lambda: jax.jit(step), (params, opt_state), batches

    def scan(params: Any, opt_state: Any, batches: Any) -> Any:
        def body(carry: Any, batch: Any) -> Any:
            params, opt_state, loss = step(*carry, batch)
            return (params, opt_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), batches)
        return params, opt_state, losses

    return lambda: jax.jit(scan), (params, opt_state), batches


def _nnx_callable(method: str) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """(a function building the callable, state or fixed objects, one call's (x, y)) of the
    NNX model (e)."""
    from flax import nnx

    import autoflat
    from benchmarks import nnx_models

    s = nnx_models.Setup(width=2, batch_size=4, image_size=16, batchnorm=False)
    k = _steps(method)
    xy = s.args if k == 1 else harness.repeat(s.args, k)
    model, optimizer = s.fresh()
    if _is_autoflat(method):
        pack: Any = "auto" if method.startswith("autoflat") else False
        step = lambda: autoflat.step(nnx_models.train_step, num_steps=k, pack=pack)  # noqa: E731
        return step, (model, optimizer), xy
    graphdef, state = nnx.split((model, optimizer))

    def step(state: Any, x: Any, y: Any) -> Any:
        model, optimizer = nnx.merge(graphdef, state)
        loss = nnx_models.train_step(model, optimizer, x, y)
        return nnx.state((model, optimizer)), loss

    if method == "jit":
        return lambda: jax.jit(step), (state,), xy

    def scan(state: Any, xs: Any, ys: Any) -> Any:
        return jax.lax.scan(lambda c, b: step(c, *b), state, (xs, ys))

    return lambda: jax.jit(scan), (state,), xy


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(
    spans: list[tuple[float, float]], minus: list[tuple[float, float]] | None = None
) -> float:
    """The time the merged `spans` cover, less what they share with the merged `minus`."""
    total = 0.0
    cut = _merged(minus or [])
    for a, b in _merged(spans):
        total += b - a
        for c, d in cut:
            total -= max(0.0, min(b, d) - max(a, c))
    return total


def sample(key: str, method: str) -> dict[str, Any]:
    """One first call of `method` on model `key`, in this (fresh) process."""
    jax.config.update("jax_enable_compilation_cache", False)
    spans: dict[str, list[tuple[float, float]]] = {p: [] for p in _EVENTS.values()}
    roles = harness.PRIVATE.roles_clock()

    def listener(event: str, seconds: float, **_: Any) -> None:
        if event in _EVENTS:
            end = time.perf_counter()
            spans[_EVENTS[event]].append((end - seconds, end))

    build, state, batch = _nnx_callable(method) if key == "e" else _equinox_callable(key, method)
    t0 = time.perf_counter()
    fn = build()
    make_s = time.perf_counter() - t0
    jax.block_until_ready((state, batch))
    jax.monitoring.register_event_duration_secs_listener(listener)
    for found in spans.values():
        found.clear()
    t1 = time.perf_counter()
    out = fn(*state, *batch)
    jax.block_until_ready(out)
    total = time.perf_counter() - t1
    phases = {"roles": _length(roles, spans["trace"])}
    phases["trace"] = _length(spans["trace"])
    phases["lower"] = _length(spans["lower"])
    phases["compile"] = _length(spans["compile"])
    phases["rest"] = total - sum(phases.values())
    return {
        "key": key,
        "method": method,
        "first_call_s": total,
        "make_s": make_s,
        "phases_s": phases,
        "traces": len(spans["trace"]),
        "compiles": len(spans["compile"]),
    }


# ==========================================================================================
# The round-robin over processes, and the report
# ==========================================================================================


def _run_child(key: str, method: str, compare: dict[str, str]) -> dict[str, Any]:
    """One sample in a fresh process; `method@NAME` with `compare[NAME]`'s autoflat."""
    env = dict(os.environ)
    env.pop(_COMPARE, None)
    base, _, name = method.partition("@")
    if name:
        env[_COMPARE] = compare[name]
    cmd = [sys.executable, __file__, "--child", key, base]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"key": key, "method": method, "error": done.stderr[-2000:]}
    return json.loads(lines[-1]) | {"method": method}  # type: ignore[no-any-return]


def run_model(
    key: str, methods: tuple[str, ...], repeats: int, compare: dict[str, str]
) -> dict[str, list[Any]]:
    """`repeats` samples of each method, each in a fresh process, round-robin."""
    found: dict[str, list[Any]] = {m: [] for m in methods}
    for rep, order in harness.rotations(methods, repeats):
        for method in order:
            r = _run_child(key, method, compare)
            found[method].append(r)
            if "error" in r:
                harness.log(f"  {key} {method} (repeat {rep + 1}): FAILED\n{r['error']}")
                continue
            ph = ", ".join(f"{p} {r['phases_s'][p]:.2f}" for p in PHASES)
            harness.log(
                f"  {key} {method} (repeat {rep + 1}): {r['first_call_s']:.2f} s ({ph}; "
                f"{r['traces']} traces, {r['compiles']} compiles)"
            )
    return found


def _reference(method: str) -> str:
    """What an autoflat method is compared with: `jit` at one step, `scan` at ten."""
    return "jit" if method.partition("@")[0] in ("autoflat_1", "flat_1") else "scan"


def summarize(key: str, found: dict[str, list[Any]]) -> dict[str, Any]:
    """Per method: the median first call and its spread, median phases, the ratio to its
    reference (`_reference`)."""
    import statistics

    from benchmarks import bench_zoo

    rows: dict[str, Any] = {}
    for method, samples in found.items():
        failed = [s["error"] for s in samples if "error" in s]
        if failed or not samples:
            rows[method] = {"error": failed[0] if failed else "no samples"}
            continue
        rows[method] = {
            "first_call_s": harness.summary([s["first_call_s"] for s in samples], 1.0),
            "make_s": statistics.median(s["make_s"] for s in samples),
            "phases_s": {p: statistics.median(s["phases_s"][p] for s in samples) for p in PHASES},
            "traces": statistics.median(s["traces"] for s in samples),
            "compiles": statistics.median(s["compiles"] for s in samples),
        }
    for method, row in rows.items():
        ref = rows.get(_reference(method), {})
        if _is_autoflat(method) and "first_call_s" in row and "first_call_s" in ref:
            row["ratio"] = row["first_call_s"]["median"] / ref["first_call_s"]["median"]
    return {"model": f"{key}. {bench_zoo.CASES[key][0]}", "rows": rows}


def _cell(res: dict[str, Any], method: str) -> str:
    r = res["rows"].get(method, {})
    if "first_call_s" not in r:
        return "failed" if r else "–"
    s = r["first_call_s"]
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def _ratio(res: dict[str, Any], method: str) -> str:
    r = res["rows"].get(method, {})
    return f"{r['ratio']:.2f}" if "ratio" in r else "–"


def render(results: list[dict[str, Any]], env: list[str], command: str, names: list[str]) -> str:
    lines = ["# First calls: autoflat against jax.jit", "", f"`{command}`", "", *env, ""]
    # extra column pairs: (label, the method of a row's autoflat method)
    extra = [(name, lambda mine, name=name: f"{mine}@{name}") for name in names]
    if any(m in FLAT for res in results for m in res["rows"]):
        extra.append(("pack=False", lambda mine: mine.replace("autoflat", "flat")))
    header = ["model", "steps a call", "jax.jit s", "autoflat s", "× jax.jit"]
    for label, _ in extra:
        header += [f"{label} s", "× jax.jit"]
    body = []
    for res in results:
        for k, ref, mine in ((1, "jit", "autoflat_1"), (10, "scan", "autoflat_10")):
            if not any(m.partition("@")[0] in (ref, mine) for m in res["rows"]):
                continue
            body.append([res["model"], str(k), _cell(res, ref), _cell(res, mine)])
            body[-1] += [_ratio(res, mine)]
            for _, method_of in extra:
                body[-1] += [_cell(res, method_of(mine)), _ratio(res, method_of(mine))]
    lines += harness.table(header, "lrrrr" + "rr" * len(extra), body)
    lines += [
        "",
        "At 10 steps a call, `jax.jit` is of a hand-written `lax.scan` of the step.",
        "",
        "Where a first call's time goes (medians, seconds):",
        "",
    ]
    header = ["model", "method", "first call", *PHASES, "traces", "make"]
    body = []
    for res in results:
        for m, r in res["rows"].items():
            if "first_call_s" not in r:
                continue
            base, _, name = m.partition("@")
            label = LABELS[base] + (f" ({name})" if name else "")
            body.append([res["model"], label, f"{r['first_call_s']['median']:.2f}"])
            body[-1] += [f"{r['phases_s'][p]:.2f}" for p in PHASES]
            body[-1] += [f"{r['traces']:g}", f"{r['make_s']:.2f}"]
    lines += harness.table(header, "llrrrrrrrr", body)
    return "\n".join(lines) + "\n"


def parser(ap: Any) -> Any:
    """This benchmark's options on `ap` (`bench_zoo.py --first-call` shares them)."""
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    ap.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also run the autoflat methods with the autoflat package in DIR (repeatable)",
    )
    return ap


def run(args: Any, script: str) -> None:
    """The benchmark for parsed `args` (`--models`, `--repeats`, `--quick`, `--methods`,
    `--compare`, `--out`); `script` is the command line's script, for the results."""
    repeats = args.repeats or (3 if args.quick else 7)
    methods = tuple(m for m in args.methods.split(",") if m)
    compare = dict(c.split("=", 1) for c in args.compare)
    autoflats = [m for m in methods if _is_autoflat(m)]
    methods += tuple(f"{m}@{name}" for name in compare for m in autoflats)
    machine, versions = harness.machine(), harness.versions()
    harness.log("\n".join(harness.environment_lines(machine, versions)))
    results = []
    for key in args.models:
        harness.log(f"model {key} ...")
        results.append(summarize(key, run_model(key, methods, repeats, compare)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = harness.environment_lines(machine, versions, end_load=os.getloadavg())
    # `--compare NAME=DIR`: the directory is a path of this machine.
    argv = [re.sub(r"^(\w+)=.*", r"\1=DIR", a) if "=" in a else a for a in sys.argv[1:]]
    command = harness.command(script, argv)
    text = render(results, env, command.strip(), list(compare))
    (out / "first_call.md").write_text(text)
    harness.write_json({"environment": env, "results": results}, out / "first_call.json")
    print(text)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(sample(sys.argv[2], sys.argv[3])))
        return
    ap = parser(harness.parser(__doc__.splitlines()[0]))
    ap.add_argument("--models", default="abcde", help="which of the models a-e (default: all)")
    ap.add_argument("--out", default=str(harness.ROOT / "benchmarks" / "results"))
    run(ap.parse_args(), "benchmarks/bench_first_call.py")


if __name__ == "__main__":
    main()
