"""`autoflat.profile`: where a step's time goes, measured on the caller's own arguments.

`profile(step, *args, **kwargs)` runs the step on copies of the arguments (the caller's state
and handles are not touched, and the step's counters and identity caches are as they were
afterwards) and measures, on this machine:

- the host time of a call, from its entry to the return of the dispatch (the outputs of the
  previous call awaited first, so nothing else is in it), and of that the launch: the
  dispatch of the compiled program alone;
- the device time of one step, divided by `num_steps` from a call's: the compiled program
  alone, its outputs awaited, less the same for a program computing nothing on the same
  buffers (on an accelerator, awaiting any program takes a round trip to the device); on
  an accelerator, where the program's calls back to back take clearly longer than one takes
  to launch, they wait on the device, and a call's time among them is the device's; where
  they take about as long, the device's time hides behind the host's, and the most it can
  be is reported beside it. JAX's dispatch of the buffers, host work, is that program's
  call to its return, or the launch where that returns sooner (on a TPU, an empty program
  giving back hundreds of buffers took longer to return than the step's own);
- from those two, the share of each step's wall time that is host work at the step's
  `num_steps` (host and device taking turns, as on a CPU, or on an accelerator whose queue
  runs dry), and the smallest `num_steps` at which that share falls under 5%, with the memory
  one call's stacked per-step inputs would then take;
- the time of a step in a loop of calls back to back, as a training loop makes them, and
  the share of it beyond the device time: where the device runs while the host prepares the
  next call (an accelerator's queue), the host's work hides behind it, which the share
  above, counting host and device in turns, does not see;
- what else costs time: flattens, copies and rebuilds per call in a loop that feeds the
  returned state back (with the lines where the step's handles were rebuilt over its life),
  and the step's recompiles with their causes.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .._handles.lazy import _UNBUILT, LazyHandle, new_handle
from .._handles.nnx import take_graph_cache
from .call import prepare
from .finish import finish, hand_over
from .launch import launch, runner

HOST_SHARE_TARGET = 0.05
MAX_SUGGESTED = 1000  # past this, "more steps a call than that": per-step inputs grow with k
DEVICE_BOUND = 1.2  # calls back to back this much slower than one call's launch: device-bound
HIDDEN = 1.25  # a most this much above the device time is reported beside it


@dataclasses.dataclass(frozen=True)
class Profile:
    """Where one step's time goes (`autoflat.profile`); `str()` is a short report.

    Times are seconds, medians over the measured calls."""

    step: str  # the step's `__qualname__`
    where: str  # its file:line
    num_steps: int
    calls: int  # calls measured
    autoflat_s: float  # autoflat's own host time per call, before and after the launch
    launch_s: float  # the launch: the compiled program's dispatch, to its return
    dispatch_s: float  # JAX's dispatch of the call's buffers: a program computing nothing on
    # them, to the return of its call (or the launch, where that returns sooner)
    roundtrip_s: float  # that program launched and its outputs awaited
    device_s: float  # one step: the program alone, its outputs awaited, less the round trip
    # (on an accelerator, its calls back to back where they wait on the device)
    device_max_s: float  # the most it can be: more than `device_s` where, on an accelerator,
    # the device's time hides behind the host's (calls back to back as long as a launch)
    loop_s: float  # one call in a loop of calls back to back, awaited at its end
    step_input_bytes: int  # one step's per-step inputs
    flattens_per_call: float  # in the measured loop, which feeds the returned state back
    copies_per_call: float
    rebuilds_per_call: float
    history: dict[str, int]  # the step's own counters before profiling (`autoflat.stats`)
    rebuilt_at: tuple[tuple[str, int], ...]  # where its handles were rebuilt (line, times)
    recompiles: tuple[str, ...]  # why the step was traced again, per trace after the first

    @property
    def host_s(self) -> float:
        """Host work per call that more steps a call would share: autoflat's own and JAX's
        dispatch of the buffers."""
        return self.autoflat_s + self.dispatch_s

    @property
    def loop_overhead(self) -> float:
        """The share of each step's time in a loop of calls back to back that is not the
        device's (host work that the device's did not hide)."""
        if self.loop_s <= 0:
            return 0.0
        return max(self.loop_s - self.num_steps * self.device_s, 0.0) / self.loop_s

    @property
    def host_share(self) -> float:
        """The share of each step's wall time that is host work, at `num_steps`."""
        return share(self.host_s, self.device_s, self.num_steps)

    @property
    def host_bound(self) -> bool:
        """Whether a call spends more time on the host than its steps on the device."""
        return self.host_s > self.num_steps * self.device_s

    @property
    def suggested_num_steps(self) -> int:
        """The smallest `num_steps` at which the host share would be under 5%, from
        `host_s` and `device_s` (at most 1000)."""
        return smallest_num_steps(self.host_s, self.device_s, HOST_SHARE_TARGET)

    @property
    def suggested_input_bytes(self) -> int:
        """One call's stacked per-step inputs at `suggested_num_steps`."""
        return self.step_input_bytes * self.suggested_num_steps

    def __str__(self) -> str:
        return report(self)


def share(host_s: float, device_s: float, num_steps: int) -> float:
    """Host time over wall time, for a call of `num_steps` steps."""
    total = host_s + num_steps * device_s
    return host_s / total if total > 0 else 0.0


def smallest_num_steps(host_s: float, device_s: float, target: float) -> int:
    """The smallest k with host / (host + k * device) < target, at most `MAX_SUGGESTED`."""
    if host_s <= 0:
        return 1
    if device_s <= 0:
        return MAX_SUGGESTED
    k = int(host_s * (1 - target) / (target * device_s)) + 1
    return min(max(k, 1), MAX_SUGGESTED)


def report(p: Profile) -> str:
    """The short readable report of a `Profile`."""
    verdict = "host-bound" if p.host_bound else "device-bound"
    lines = [
        f"autoflat.profile: `{p.step}` ({os.path.basename(p.where)}), "
        f"num_steps={p.num_steps}, {p.calls} calls",
        f"  host per call   {_t(p.host_s)}  (autoflat {_t(p.autoflat_s).strip()}, JAX's "
        f"dispatch of the buffers {_t(p.dispatch_s).strip()}; launch returns after "
        f"{_t(p.launch_s).strip()})",
        f"  device per step {_t(p.device_s)}"
        + (
            f"  (up to {_t(p.device_max_s).strip()}: the program's calls back to back take "
            "about as long as its launch, which hides the device's time)"
        )
        * (p.device_max_s > HIDDEN * p.device_s),
        f"  host share      {p.host_share:.0%} of each step's time: {verdict}",
    ]
    k = p.suggested_num_steps
    if k <= p.num_steps:
        lines.append(f"  num_steps={p.num_steps} keeps host work under 5%")
    elif k >= MAX_SUGGESTED:
        lines.append(
            f"  host work stays over 5% up to num_steps={MAX_SUGGESTED} (the device time of a "
            "step is too small to tell from the dispatch): take as many steps a call as the "
            f"per-step inputs allow ({_bytes(p.step_input_bytes)} a step)"
        )
    else:
        lines.append(
            f"  num_steps={k} would bring it under 5% (stacked per-step inputs: "
            f"{_bytes(p.suggested_input_bytes)} a call)"
        )
    lines.append(
        f"  in a loop       {_t(p.loop_s / p.num_steps)} a step, {p.loop_overhead:.0%} of it "
        "beyond the device time (host work the device's did not hide)"
    )
    per = (p.flattens_per_call, p.copies_per_call, p.rebuilds_per_call)
    lines.append("  per call        {:.1f} flattens, {:.1f} copies, {:.1f} rebuilds".format(*per))
    h = p.history
    if h.get("rebuilds") or h.get("copies"):
        lines.append(
            f"  before this, over {h['calls']} calls: {h['rebuilds']} rebuilds, "
            f"{h['copies']} copies"
            + (" (rebuilt at " + ", ".join(f"{w} x{n}" for w, n in p.rebuilt_at) + ")")
            * bool(p.rebuilt_at)
            + ": return what you read from the step, or read it inside a jitted function"
        )
    recompiles = max(h.get("traces", 0) - 1, len(p.recompiles))
    if recompiles:
        shown = "; ".join(p.recompiles[-3:]) or "a shorter final chunk, or lower()"
        lines.append(f"  recompiled {recompiles} times, last: {shown}")
    return "\n".join(lines)


def _t(s: float) -> str:
    if s >= 1:
        return f"{s:8.2f} s "
    if s >= 1e-3:
        return f"{s * 1e3:8.2f} ms"
    return f"{s * 1e6:8.1f} us"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def measure(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any], calls: int) -> Profile:
    """Where a step's time goes, measured on copies of these arguments (see the module doc)."""
    bound = step._signature.bind(*args, **kwargs)
    before = step.stats.snapshot()
    with _isolated(step) as changes:
        program = prepare(step, bound.args, bound.kwargs).program
        bound = _copy_state(step, program, bound)
        for _ in range(2):  # the first call may trace; the second takes handles
            bound, ran = _call_and_chain(step, program, bound)
        _block(ran)
        accelerator = _on_accelerator(ran)
        medians, counts, step_bytes = _time(step, program, bound, calls)
    device, device_max = _device_per_call(medians, accelerator)
    return Profile(
        step=step.__qualname__,
        where=step._analysis.where,
        num_steps=step.num_steps,
        calls=calls,
        autoflat_s=medians["autoflat"],
        launch_s=medians["launch"],
        dispatch_s=min(medians["dispatch"], medians["launch"]),
        roundtrip_s=medians["roundtrip"],
        device_s=device / step.num_steps,
        device_max_s=device_max / step.num_steps,
        loop_s=medians["loop"],
        step_input_bytes=step_bytes,
        flattens_per_call=counts["flattens"] / calls,
        copies_per_call=counts["copies"] / calls,
        rebuilds_per_call=counts["rebuilds"] / calls,
        history=dataclasses.asdict(before),
        rebuilt_at=tuple(step._origin.rebuilt_at.most_common(3)),
        recompiles=tuple(changes),
    )


def _device_per_call(medians: dict[str, float], accelerator: bool) -> tuple[float, float]:
    """The device time of a call, and the most it can be: the program alone, its outputs
    awaited, less the empty program's round trip; on an accelerator, where the program's
    calls back to back take clearly longer than one takes to launch (`DEVICE_BOUND`), they
    wait on the device, and a call's time among them is the device's.

    On an accelerator the difference can miss most of the device time: on a TPU, awaiting
    the 484 buffers an empty program gave back took 1.2 ms, and a step whose program took
    2.4 ms a call back to back came out as 0.13 ms a call. Where calls back to back take
    about as long as one takes to launch, the device's time is hidden behind the host's: it
    is at most a call's time among them, which the second figure gives (the device's time
    is at most that anywhere). On a CPU the program runs on the host's own cores, and the
    difference stays."""
    found = max(medians["program"] - medians["roundtrip"], 0.0)
    loop = medians.get("program_loop", 0.0)
    if not accelerator or loop <= 0:  # (0: not measured, `_time`)
        return found, found
    if loop <= found or loop >= DEVICE_BOUND * medians["program_launch"]:
        return loop, loop
    return found, loop


_CACHES = ("_last", "_bcast_last", "_in_flight")


@contextlib.contextmanager
def _isolated(step: Any) -> Iterator[list[str]]:
    """Run the block with the step's identity caches fresh, and put its counters, trace
    record and caches back as they were after it. Yields the step's recompile causes so far
    (those of the block added)."""
    stats, diag, origin = step.stats, step._diag, step._origin
    saved_stats = stats.snapshot()
    saved = {n: getattr(step, n) for n in (*_CACHES, "_nnx", "_fed_back")}
    saved_diag = (diag._last_key, diag._warned, diag._pending, list(diag.changes))
    saved_sites = collections.Counter(origin.rebuilt_at)
    step._last, step._bcast_last, step._in_flight = {}, {}, None
    step._nnx = type(step._nnx)()
    step._fed_back = type(step._fed_back)()
    try:
        yield diag.changes
    finally:
        for f in dataclasses.fields(stats):
            setattr(stats, f.name, getattr(saved_stats, f.name))
        for n, v in saved.items():
            setattr(step, n, v)
        diag._last_key, diag._warned, diag._pending, changes = saved_diag
        diag.changes[:] = changes
        origin.rebuilt_at.clear()
        origin.rebuilt_at.update(saved_sites)


def _copy_state(step: Any, program: Any, bound: inspect.BoundArguments) -> inspect.BoundArguments:
    """The arguments with every state argument copied (a call donates it, or writes into
    it): a handle as a handle of copied buffers (still this step's, so the calls take the
    fast path, and the caller's stays unbuilt), anything else deep-copied."""
    out = copy.copy(bound)
    out.arguments = dict(bound.arguments)
    for name in program.roles.state:
        if name not in out.arguments:
            continue
        value = out.arguments[name]
        if type(value) is LazyHandle and object.__getattribute__(value, "_af_obj") is _UNBUILT:
            LazyHandle._af_check(value)
            get = functools.partial(object.__getattribute__, value)
            buffers = [jnp.copy(b) for b in get("_af_arrays")]
            value = new_handle(
                get("_af_structure"),
                buffers,
                get("_af_placement"),
                get("_af_origin"),
                get("_af_param"),
                get("_af_layout"),
            )
        elif type(value) is LazyHandle:
            value = copy.deepcopy(LazyHandle._af_get(value))
        else:
            value = copy.deepcopy(value)
        out.arguments[name] = value
    return out


def _call_and_chain(
    step: Any, program: Any, bound: inspect.BoundArguments, clock: list[float] | None = None
) -> tuple[inspect.BoundArguments, Any]:
    """Call the step as `Step.__call__` does, phase by phase (`clock` gets autoflat's own
    time, before and after the launch, and the launch's). Returns the arguments of the next
    call (the state it returned in place of the state passed; state written back is the
    same object, changed in place) and what to wait for (`_block`): the call's result and
    the program's own outputs, which hold the state written back too (a Flax NNX step that
    returns nothing)."""
    t0 = time.perf_counter()
    take_graph_cache()
    step.stats.calls += 1
    call = prepare(step, bound.args, bound.kwargs)
    step._in_flight = call
    t1 = time.perf_counter()
    state_out, outputs = launch(step, call)
    t2 = time.perf_counter()
    result = hand_over(call, finish(step, call, state_out, outputs))
    if clock is not None:
        clock[:] = [(t1 - t0) + (time.perf_counter() - t2), t2 - t1]
    return _chained(program, bound, result), (result, state_out, outputs)


def _chained(program: Any, bound: inspect.BoundArguments, result: Any) -> inspect.BoundArguments:
    layout = program.roles.layout
    if layout.kind == "none":
        return bound
    for (kind, i), item in zip(layout.entries, layout.positions(result), strict=True):
        if kind == "state":
            bound.arguments[program.roles.state[i]] = item
    return bound


def _block(ran: Any) -> None:
    """Wait for a call (`_call_and_chain`'s)."""
    jax.block_until_ready(_buffers(ran))


def _buffers(ran: Any) -> list[Any]:
    """A call's result's arrays, reading handles' buffers without unpacking them."""
    arrays = []
    for x in jax.tree_util.tree_leaves(ran, is_leaf=lambda y: type(y) is LazyHandle):
        if type(x) is LazyHandle:
            arrays.extend(object.__getattribute__(x, "_af_arrays"))
        elif isinstance(x, jax.Array):
            arrays.append(x)
    return arrays


def _on_accelerator(ran: Any) -> bool:
    """Whether the step ran on an accelerator: where its results are (a step placed on the
    CPU of a machine with a GPU ran on the CPU), else JAX's default backend."""
    for x in _buffers(ran):
        return any(d.platform != "cpu" for d in x.devices())
    return jax.default_backend() != "cpu"


def _time(
    step: Any, program: Any, bound: inspect.BoundArguments, calls: int
) -> tuple[dict[str, float], dict[str, int], int]:
    """Time the step's calls and its compiled program alone, taking turns (this machine's
    speed drifts: alternating keeps both under the same conditions). Returns the medians
    (`autoflat`: a step call's own host work before and after its launch, the previous
    results awaited; `launch`: its launch, to the return of the dispatch; `program`: the
    program alone with its outputs awaited; `dispatch`: a program that computes nothing on
    the same buffers, to the return of its call; `roundtrip`: the same, its outputs awaited:
    on an accelerator, awaiting even an empty program takes a round trip to the device that
    is neither host work nor the step's; `loop`: a call in a loop of calls back to back,
    awaited at its end, over `LOOPS` loops; `program_launch`: the program's call to its
    return; `program_loop`: the time a call of the program alone adds to a loop of calls back
    to back, from loops of half and all of `calls`), the counters the calls moved before the
    loops, and one step's per-step input bytes."""
    before = step.stats.snapshot()
    prepared = prepare(step, bound.args, bound.kwargs)
    jit = runner(step, prepared.spec, prepared.inputs())
    donating = bool(step.donate) and jit is step._jit
    source, xs, bcast = prepared.inputs()
    source = _copied(source)  # kept whole: the step's calls donate the buffers prepared
    state: tuple[list[Any], ...] | None = None  # the program's own, chained while they can be
    noop = jax.jit(_noop, donate_argnums=(0,) if donating else ())
    noop_state = noop(_copied(source), xs, bcast)  # compiled before the timing
    times: dict[str, list[float]] = {k: [] for k in _TIMED}
    clock: list[float] = []
    for _ in range(calls):
        bound, ran = _call_and_chain(step, program, bound, clock)
        times["autoflat"].append(clock[0])
        times["launch"].append(clock[1])
        _block(ran)
        if state is None:
            state = _copied(source)
        t0 = time.perf_counter()
        raw = jit(prepared.spec, state, xs, bcast)
        t1 = time.perf_counter()
        raw = jax.block_until_ready(raw)
        times["program"].append(time.perf_counter() - t0)
        times["program_launch"].append(t1 - t0)
        if donating:
            state = _next_state(raw, state)
        t0 = time.perf_counter()
        noop_state = noop(noop_state, xs, bcast)
        t1 = time.perf_counter()
        noop_state = jax.block_until_ready(noop_state)
        times["dispatch"].append(t1 - t0)
        times["roundtrip"].append(time.perf_counter() - t0)
    counts = {
        f.name: getattr(step.stats, f.name) - getattr(before, f.name)
        for f in dataclasses.fields(before)
    }
    times["loop"] = []
    for _ in range(LOOPS):
        t0 = time.perf_counter()
        for _ in range(calls):  # as a training loop calls it: back to back
            bound, ran = _call_and_chain(step, program, bound)
        _block(ran)
        times["loop"].append((time.perf_counter() - t0) / calls)
    times["program_loop"] = []
    if state is not None:  # (None: a donating program's outputs do not line up with its inputs)
        half = max(calls // 2, 1)
        for _ in range(LOOPS):  # the time a call adds to a loop: its first launch and the
            # round trip awaiting its end cancel out
            state, short = _program_loop(jit, prepared.spec, state, xs, bcast, half)
            state, long = _program_loop(jit, prepared.spec, state, xs, bcast, 2 * half)
            times["program_loop"].append(max(long - short, 0.0) / half)
    xs_bytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree_util.tree_leaves(xs))
    step_bytes = xs_bytes // step.num_steps if step.num_steps > 1 else xs_bytes
    return {k: statistics.median(v) for k, v in times.items() if v}, counts, step_bytes


def _program_loop(
    jit: Any, spec: Any, state: tuple[list[Any], ...], xs: Any, bcast: Any, calls: int
) -> tuple[tuple[list[Any], ...], float]:
    """The compiled program alone, called back to back `calls` times (each call taking the
    state buffers the last gave back, where they line up: `_next_state`, checked once) and
    awaited at the end. Returns the last state and the loop's time."""
    t0 = time.perf_counter()
    raw = jit(spec, state, xs, bcast)
    chained = _next_state(raw, state) is not None
    for _ in range(calls - 1):
        raw = jit(spec, tuple(raw[0]) if chained else state, xs, bcast)
    jax.block_until_ready(raw)
    taken = time.perf_counter() - t0
    return (tuple(list(p) for p in raw[0]) if chained else state), taken


_TIMED = ("autoflat", "launch", "program", "program_launch", "dispatch", "roundtrip")
LOOPS = 3  # loops of calls back to back, each as many as the calls timed one by one


def _noop(state: Any, xs: Any, bcast: Any) -> Any:
    """A program taking what the step's program takes and giving back its state buffers,
    computing nothing: its time is JAX's own dispatch of those buffers, in and out."""
    del xs, bcast
    return state


def _copied(state: tuple[list[Any], ...]) -> tuple[list[Any], ...]:
    copies = tuple([jnp.copy(b) for b in part] for part in state)
    jax.block_until_ready(copies)
    return copies


def _next_state(raw: Any, state: tuple[list[Any], ...]) -> tuple[list[Any], ...] | None:
    """The donating program's next state buffers: its state outputs where they line up with
    its inputs buffer for buffer; else None, for fresh copies (shared Flax NNX Variables
    travel once, so their outputs do not line up)."""
    out = raw[0] if isinstance(raw, list) else None
    if out is not None and [len(p) for p in out] == [len(p) for p in state]:
        if all(
            a.shape == b.shape and a.dtype == b.dtype
            for po, pi in zip(out, state, strict=True)
            for a, b in zip(po, pi, strict=True)
        ):
            return tuple(list(p) for p in out)
    return None
