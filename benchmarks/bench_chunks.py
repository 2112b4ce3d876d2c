"""End-to-end throughput of the flagship example's training loop, fed three ways.

    python benchmarks/bench_chunks.py [--quick] [--repeats N] [--block-seconds S] [--out PREFIX]

The flagship example (`examples/train_digits.py`: a residual MLP of 8 blocks of width 64 with
AdamW, batches of 32 of scikit-learn's digits, `autoflat.step(update, num_steps=10)`) trains
epoch after epoch, each epoch reshuffled, with its data fed:

a. by hand, as the example did before `autoflat.chunks`: the epoch gathered into arrays of
   shape (steps, 32, ...), copied to the device at once, and sliced 10 steps per call;
b. by `autoflat.chunks(epoch_batches, 10, prefetch=0)`: per-step NumPy batches stacked into
   chunks and copied to the device on the loop's thread, each when the loop asks for it;
c. by `autoflat.chunks(epoch_batches, 10, prefetch=2)`: the same on a background thread, up to
   two chunks ahead of the step running.

An epoch is 44 steps: four calls of 10 steps and one of 4. Each timed unit is whole epochs of
the loop, data preparation included (the shuffle, the gathers, stacking, transfers, the
steps), which is what a user's training loop pays per step.

Before timing, every method trains one epoch from the same initial state on the same shuffle,
and the per-step losses must be equal bit for bit (the chunks hold the same values, and the
step is the same program). Then the methods are timed as `harness.py` times them: each is
warmed up and its epochs per block calibrated to about `--block-seconds`, then blocks run
round-robin (the order rotating every repeat), `--repeats` rounds, each method continuing from
its own state and its own data order, with `jax.block_until_ready` at the end of each block;
the step must stay on autoflat's fast path with no new compile while timed. Reported: the
median time per step over the blocks (spread min-max), the same as steps per second, and the
ratio of throughput to (a). Written to `--out`.md and `--out`.json.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks`, this autoflat
sys.path.insert(0, str(ROOT / "examples"))  # the flagship example, imported as a module

import train_digits as flagship  # noqa: E402

import autoflat  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.harness import Method, Plan  # noqa: E402

K = flagship.NUM_STEPS
Feed = Callable[[np.random.Generator, np.ndarray, np.ndarray], Iterable[tuple[Any, Any]]]


def hand_sliced(rng: np.random.Generator, x: np.ndarray, y: np.ndarray) -> Iterator[Any]:
    """The example's feeding before `autoflat.chunks`, as it was written there."""
    order = rng.permutation(len(x))
    steps = len(x) // flagship.BATCH
    idx = order[: steps * flagship.BATCH].reshape(steps, flagship.BATCH)
    xs, ys = jnp.asarray(x[idx]), jnp.asarray(y[idx])
    for start in range(0, steps, K):
        stop = min(start + K, steps)
        yield xs[start:stop], ys[start:stop]


def chunked(prefetch: int) -> Feed:
    """The example's feeding now: per-step NumPy batches through `autoflat.chunks`."""

    def feed(rng: np.random.Generator, x: np.ndarray, y: np.ndarray) -> Iterable[Any]:
        return autoflat.chunks(flagship.epoch_batches(rng, x, y), K, prefetch=prefetch)

    return feed


class EpochMethod(Method):
    """A method whose call is one epoch of the flagship's training loop, fed by `feed`: the
    state is (params, opt_state), the output the epoch's last per-step losses."""

    def __init__(self, key: str, label: str, feed: Feed, data: tuple[Any, Any], note: str):
        def make() -> Plan:
            params = flagship.init_params(jax.random.key(0))
            return Plan(
                lambda: autoflat.step(flagship.update, num_steps=K),
                (params, flagship.tx.init(params)),
            )

        steps = len(data[0]) // flagship.BATCH
        super().__init__(key, label, make, steps_per_call=steps, note=note)
        self.feed, self.data = feed, data
        self.rng = np.random.default_rng(0)

    def setup(self, args: tuple[Any, ...]) -> None:
        super().setup(())
        self.args = ()

    def _loop(self, n: int, args: tuple[Any, ...]) -> Any:
        params, opt_state = self.state
        step, losses = self.fn, None
        for _ in range(n):
            for xs, ys in self.feed(self.rng, *self.data):
                params, opt_state, losses = step(params, opt_state, xs, ys)
        self.state = (params, opt_state)
        return losses

    def first_epoch(self) -> np.ndarray:
        """The per-step losses of one epoch from the initial state on the first shuffle
        (this compiles the step for full chunks and for the shorter last one)."""
        params, opt_state = self.state
        losses = []
        for xs, ys in self.feed(np.random.default_rng(0), *self.data):
            params, opt_state, loss = self.fn(params, opt_state, xs, ys)
            losses.append(np.asarray(loss))
        self.state = (params, opt_state)
        return np.concatenate(losses)


def training_data() -> tuple[np.ndarray, np.ndarray]:
    """The example's training split of the digits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, _, y_train, _ = train_test_split(x, y, test_size=0.2, random_state=0)
    return x_train, y_train


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "chunks"),
        help="write PREFIX.md and PREFIX.json (default: benchmarks/results/chunks)",
    )
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    block_s = args.block_seconds or (0.3 if args.quick else 1.0)
    machine, versions = harness.machine(), harness.versions()
    env = harness.environment_lines(machine, versions)
    harness.log("\n".join(env))

    data = training_data()
    methods = [
        EpochMethod(
            "hand",
            "a. hand slicing (the example before chunks)",
            hand_sliced,
            data,
            "the epoch gathered and copied to the device at once, then sliced per call",
        ),
        EpochMethod(
            "chunks_0",
            "b. autoflat.chunks, prefetch=0",
            chunked(0),
            data,
            "per-step NumPy batches stacked and copied on the loop's thread",
        ),
        EpochMethod(
            "chunks_2",
            "c. autoflat.chunks, prefetch=2",
            chunked(2),
            data,
            "the same on a background thread, two chunks ahead",
        ),
    ]
    steps = methods[0].steps_per_call
    harness.log(f"flagship loop: {steps} steps per epoch, num_steps={K}, batch {flagship.BATCH}")
    reference = None
    for m in methods:
        m.setup(())
        t0 = harness.perf()
        m.check_losses = m.first_epoch()
        m.first_call_s = harness.perf() - t0
        if reference is None:
            reference = m.check_losses
        elif not np.array_equal(m.check_losses, reference):
            raise AssertionError(f"{m.label}: the first epoch's losses differ from (a)'s")
        harness.log(f"  {m.label}: first epoch (compiles) in {m.first_call_s:.1f} s")
    harness.log("  the first epoch's losses are equal bit for bit across the three")

    harness.time_methods(methods, repeats, block_s, title="epochs")
    rows = harness.method_rows(methods)
    ok = {r["key"]: r for r in rows if "us_per_step" in r}
    for r in ok.values():
        us = r["us_per_step"]
        r["steps_per_s"] = harness.summary([1 / (u / harness.US) for u in us["all"]], 1.0)
        if "hand" in ok:
            r["throughput_vs_hand"] = ok["hand"]["us_per_step"]["median"] / us["median"]
    body = []
    for r in rows:
        if "us_per_step" not in r:
            body.append([r["method"], f"failed: {r.get('error', '')[:120]}", "", "", "", ""])
            continue
        us, sps = r["us_per_step"], r["steps_per_s"]
        vs = r.get("throughput_vs_hand")
        body.append(
            [
                r["method"],
                harness.fmt(sps["median"]),
                harness.spread(sps),
                harness.fmt(us["median"]),
                harness.spread(us),
                "–" if vs is None else f"{vs:.2f}",
            ]
        )
    header = [
        "feeding",
        "steps/s (median)",
        "spread",
        "µs/step (median)",
        "spread",
        "throughput × (a)",
    ]
    table = harness.table(header, "lrrrrr", body)
    end_load = harness.load_average()
    lines = [
        "# autoflat.chunks: the flagship example's training loop, end to end",
        "",
        *harness.environment_lines(machine, versions, end_load),
        f"- **Loop**: examples/train_digits.py, {steps} steps per epoch (calls of {K} steps, "
        f"the last of {steps % K or K}), batch {flagship.BATCH}; {repeats} round-robin blocks "
        f"of about {block_s:g} s per method, whole epochs, data preparation included",
        "",
        *table,
        "",
        *harness.notes_list(rows),
        "",
        "Reproduce: `python benchmarks/bench_chunks.py` (see its docstring for the method).",
    ]
    print("", *table, sep="\n")
    result = {
        "machine": machine,
        "versions": versions,
        "load_average_at_end": end_load,
        "config": {"repeats": repeats, "block_s": block_s, "steps_per_epoch": steps, "k": K},
        "first_epoch_losses": None if reference is None else reference.tolist(),
        "rows": rows,
    }
    out = Path(args.out)
    harness.write_json(result, out.with_suffix(".json"))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    harness.log(f"written to {out.with_suffix('.md')} and .json")
    return result


if __name__ == "__main__":
    main()
