"""Keras 3 on the JAX backend against autoflat: the same MLP, time per training step, end to end.

    python benchmarks/bench_keras.py [--quick] [--repeats N] [--block-seconds S] [--out DIR]
                                     [--sizes 512:128,64:32] [--batches 50]

The model: an MLP 784 -> H -> H -> 10 with ReLU, softmax cross entropy on integer labels, Adam
at learning rate 1e-3, batches of B drawn from a synthetic data set of `--batches` batches
(default 50, a multiple of 10) held on the host as NumPy arrays: Gaussian inputs, labels from
a fixed random linear teacher (so the loss can fall). `--sizes` lists the (H, B) pairs, each
timed on its own: by default H=512, B=128 (670k parameters, where the device compute of a
step dominates on a CPU) and H=64, B=32 (55k parameters, where the per-step host work of the
framework shows). Every method starts from the same initial weights (`bench_transport.mlp_params`)
and trains on the same batches in the same order, epoch after epoch:

- Keras 3 (`KERAS_BACKEND=jax`): a `keras.Sequential` of `Dense` layers, compiled with
  `keras.optimizers.Adam(1e-3)`, `SparseCategoricalCrossentropy(from_logits=True)`,
  `jit_compile=True` and `steps_per_execution` 1 or 10, trained by
  `model.fit(x, y, batch_size, epochs=n, shuffle=False, verbose=0)` on the NumPy arrays: one
  timed block is one `fit` call of n whole epochs (n calibrated once, so a block has a fixed
  number of steps, a multiple of 10), after a warm-up `fit` of one epoch that compiles;
- autoflat: the same MLP as a plain JAX step on a list of `{"w", "b"}` dicts with
  `optax.adam(1e-3, eps=1e-7)` (Keras's epsilon), `autoflat.step(num_steps=k, pack=...)` for k
  in 1 and 10 and pack in False and "auto" (explicit, so the rows do not depend on the
  library's default); each call takes the next NumPy batch (k=1) or the next NumPy stack of
  10 batches (k=10, a view of the data set reshaped once), the returned handles passed back;
- a reference: `jax.jit(step, donate_argnums=(0, 1))` of the same step, fed the same way.

Timing is `harness.time_methods`: each method warmed up and its calls per block calibrated to
about `--block-seconds`, then round-robin blocks over all methods (the order rotating every
repeat), each method continuing from its own state and its own place in the data, a
`gc.collect()` before each block and one `jax.block_until_ready` at its end (Keras's `fit`
has synchronised by then); nothing is subtracted. Reported: the median time per step over
the blocks, its spread (min-max), and the ratio to each Keras row.

Checks before timing (cheap): the JAX rows run the same first 10 steps from the same state
and must agree (`harness.agree`: the one-step rows against `jax.jit`, the 10-step rows against
each other and their first loss against `jax.jit`'s); the Keras model's loss on the first
batch before training must equal the JAX step's first loss (same weights, same function);
and Keras's epoch loss must fall from the warm-up epoch to the last timed block.

Writes `keras.md` and `keras.json` to `--out` (default benchmarks/results). Needs `keras>=3`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ["KERAS_BACKEND"] = "jax"  # before keras is imported (here and by anything else)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat

import keras  # noqa: E402

from benchmarks import bench_transport, harness  # noqa: E402
from benchmarks.harness import Method, Plan  # noqa: E402

IN, CLASSES, LR, EPS = 784, 10, 1e-3, 1e-7
K = 10  # steps per call of the multi-step rows; Keras's larger steps_per_execution
PACKAGES = ("jax", "jaxlib", "keras", "optax", "numpy")

# ==========================================================================================
# The model, as a plain JAX step
# ==========================================================================================


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


tx = optax.adam(LR, eps=EPS)


def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def dataset(batches: int, batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays (batches * batch_size, IN) float32 and (batches * batch_size,) int32."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * batch_size, IN)).astype(np.float32)
    teacher = rng.normal(size=(IN, CLASSES)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int32)


# ==========================================================================================
# Methods
# ==========================================================================================


class HostFed(Method):
    """`of` fed from the host: call i takes NumPy batch (or stack of k batches) i, cycling
    over the data set; its own position in the data carries over from block to block."""

    def __init__(self, of: Method, data: tuple[np.ndarray, np.ndarray], batch_size: int):
        k = of.steps_per_call
        fed = "the next NumPy batch" if k == 1 else f"the next NumPy stack of {k} batches"
        super().__init__(
            of.key, of.label, of.make, steps_per_call=k, note=f"{of.note}; each call {fed}"
        )
        x, y = data
        lead = (-1, k) if k > 1 else (-1,)
        self.xs = x.reshape(*lead, batch_size, IN)
        self.ys = y.reshape(*lead, batch_size)
        self.pos = 0

    def setup(self, args: tuple[Any, ...]) -> None:
        super().setup(())  # inputs come from the data set, not from `args`

    def _loop(self, n: int, args: tuple[Any, ...]) -> Any:
        f, xs, ys, pos, out = self.fn, self.xs, self.ys, self.pos, None
        params, opt_state = self.state
        for _ in range(n):
            params, opt_state, out = f(params, opt_state, xs[pos], ys[pos])
            pos = (pos + 1) % len(xs)
        self.state, self.pos = (params, opt_state), pos
        return out


class KerasFit(Method):
    """Keras 3 `model.fit` on host NumPy arrays: a call is one epoch of the data set; `n`
    calls are ONE `fit` of n epochs (a block is a single `fit` call)."""

    def __init__(
        self,
        spe: int,
        params: list[dict[str, Any]],
        data: tuple[np.ndarray, np.ndarray],
        batch_size: int,
    ):
        self.data, self.batch_size, self.params = data, batch_size, params
        self.model: Any = None
        batches = len(data[0]) // batch_size
        note = (
            f"keras.Sequential of Dense layers; compile(Adam({LR:g}), "
            "SparseCategoricalCrossentropy(from_logits=True), jit_compile=True, "
            f"steps_per_execution={spe}); a block is ONE model.fit(x, y, batch_size, "
            "epochs=n, shuffle=False, verbose=0) of n epochs (a call in this table: one "
            "epoch) on the host NumPy arrays"
        )
        label = f"Keras 3 model.fit, steps_per_execution={spe}"
        super().__init__(
            f"keras_{spe}",
            label,
            lambda: Plan(lambda: self.build(spe)),
            steps_per_call=batches,
            note=note,
        )

    def build(self, spe: int) -> Any:
        hidden = self.params[0]["w"].shape[1]
        self.model = keras.Sequential(
            [
                keras.Input((IN,)),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        self.model.set_weights([np.asarray(a) for p in self.params for a in (p["w"], p["b"])])
        self.model.compile(
            optimizer=keras.optimizers.Adam(learning_rate=LR),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
            steps_per_execution=spe,
        )
        return self.model.fit

    def setup(self, args: tuple[Any, ...]) -> None:
        super().setup(())

    def _loop(self, n: int, args: tuple[Any, ...]) -> Any:
        x, y = self.data
        history = self.fn(x, y, batch_size=self.batch_size, epochs=n, shuffle=False, verbose=0)
        self.extra.setdefault("epoch_loss_after_each_fit", []).append(history.history["loss"][-1])
        return history

    def ready(self, out: Any) -> None:
        jax.block_until_ready([v.value for v in self.model.variables])

    def first_loss(self) -> float:
        """The untrained model's loss on the first batch (same weights as the JAX step's)."""
        x, y = (a[: self.batch_size] for a in self.data)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return float(loss(y, self.model(x)))

    def warm_up(self) -> None:
        """One epoch by `fit` (traces and compiles); its epoch loss is the first recorded."""
        t0 = harness.perf()
        self.ready(self._loop(1, ()))
        self.first_call_s = harness.perf() - t0


def jax_methods(
    params: list[dict[str, Any]], data: tuple[np.ndarray, np.ndarray], batch_size: int
) -> list[HostFed]:
    state = lambda: harness.fresh((params, tx.init(params)))  # noqa: E731
    jit = Method(
        "jit_donate",
        "jax.jit + donate (reference)",
        lambda: Plan(lambda: jax.jit(train_step, donate_argnums=(0, 1)), state()),
        note="jax.jit(train_step, donate_argnums=(0, 1)) on (params, opt_state) trees",
    )
    keys = ["autoflat_1", "autoflat_1_auto", f"autoflat_{K}", f"autoflat_{K}_auto"]
    return [
        HostFed(m, data, batch_size)
        for m in [jit, *(harness.autoflat_method(key, train_step, state) for key in keys)]
    ]


# ==========================================================================================
# Results
# ==========================================================================================


def keras_spe_is_host_loop() -> bool:
    """Whether this Keras's JAX trainer runs `steps_per_execution` as a host loop of calls of
    its one-step jitted function (as 3.15 does) rather than one program of that many steps."""
    import inspect

    from keras.src.backend.jax import trainer

    source = inspect.getsource(trainer.JAXTrainer._make_function)
    return "range(self.steps_per_execution - 1)" in source


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """autoflat's per-step time over Keras's, at 1 and at 10 steps per call."""
    ok = {r["key"]: r["us_per_step"]["median"] for r in rows if "us_per_step" in r}
    out = []
    for k in (1, K):
        keras_key = f"keras_{k}"
        for key, pack in ((f"autoflat_{k}", "False"), (f"autoflat_{k}_auto", '"auto"')):
            if key in ok and keras_key in ok:
                out.append(
                    f"- autoflat num_steps={k}, pack={pack} / Keras steps_per_execution={k}: "
                    f"**{ok[key] / ok[keras_key]:.2f}** ({harness.fmt(ok[key])} vs "
                    f"{harness.fmt(ok[keras_key])} µs/step)"
                )
    return out


def run_model(hidden: int, batch_size: int, batches: int, repeats: int, block_s: float) -> Any:
    """Check and time every method on the MLP of `hidden` units a layer, batch `batch_size`."""
    data = dataset(batches, batch_size)
    params = bench_transport.mlp_params(jax.random.key(0), [IN, hidden, hidden, CLASSES])
    n_params = sum(int(a.size) for a in jax.tree.leaves(params))
    name = f"MLP {IN}-{hidden}-{hidden}-{CLASSES}, batch {batch_size}"
    harness.log(f"{name} ({n_params:,} parameters), {batches} batches a data set (epoch)")

    # the JAX rows: compile and check the first steps, from the same state, same batches
    jaxm = jax_methods(params, data, batch_size)
    n_check = harness.CHECK_STEPS  # one call of the 10-step rows
    x, y = data
    checks = [
        (x[i * batch_size : (i + 1) * batch_size], y[i * batch_size : (i + 1) * batch_size])
        for i in range(n_check)
    ]
    harness.first_calls(jaxm, checks[0], checks)
    agreement = harness.agree(jaxm, n_check)
    for m in jaxm:  # each continues from its checked state, and in the data after it
        m.pos = (n_check // m.steps_per_call) % len(m.xs)
    reference = jaxm[0].check_losses
    if reference is None or jaxm[0].error is not None:
        raise SystemExit(f"the jax.jit reference failed: {jaxm[0].error}")

    # Keras: same initial weights; its first loss must be the JAX step's
    kerasm = [KerasFit(spe, params, data, batch_size) for spe in (1, K)]
    keras_checks: dict[str, Any] = {}
    for m in kerasm:
        m.setup(())
        first, ref = m.first_loss(), float(reference[0])
        rel = abs(first - ref) / abs(ref)
        m.warm_up()
        warm = m.extra["epoch_loss_after_each_fit"][0]
        keras_checks[m.key] = {"first_batch_loss": first, "jax_first_loss": ref, "rel": rel}
        harness.log(
            f"  {m.label}: first-batch loss {first:.6f} (jax.jit {ref:.6f}, rel. diff "
            f"{rel:.1e}); warm-up fit (compiles) {m.first_call_s:.1f} s, epoch loss {warm:.4f}"
        )
        if rel > harness.rtol():
            harness.fail(m, AssertionError(f"first loss {first} vs jax.jit {ref}"), "")

    methods = [*kerasm, *jaxm]
    harness.time_methods(methods, repeats, block_s, title=name)
    for m in kerasm:
        losses = m.extra.get("epoch_loss_after_each_fit", [])
        keras_checks[m.key] |= {
            "epoch_loss_warm_up": losses[0],
            "epoch_loss_last_block": losses[-1],
            "loss_fell": len(losses) > 1 and losses[-1] < losses[0],
        }
        fell = "" if keras_checks[m.key]["loss_fell"] else " (WARNING: it did not fall)"
        harness.log(f"  {m.label}: epoch loss {losses[0]:.4f} (warm-up) -> {losses[-1]:.4f}{fell}")
    rows = harness.method_rows(methods)
    return {
        "model": name,
        "hidden": hidden,
        "batch_size": batch_size,
        "batches": batches,
        "params": n_params,
        "agreement": agreement,
        "keras_checks": keras_checks,
        "rows": rows,
    }


def section(res: dict[str, Any]) -> list[str]:
    """Markdown for one model: the table, the ratios, the checks."""
    refs = [("keras_1", "Keras spe=1"), (f"keras_{K}", f"Keras spe={K}")]
    keras_text = "; ".join(
        f"{k}: first-batch loss {c['first_batch_loss']:.6f} vs jax.jit's "
        f"{c['jax_first_loss']:.6f}, epoch loss {c['epoch_loss_warm_up']:.4f} (warm-up) -> "
        f"{c['epoch_loss_last_block']:.4f} (last block)"
        for k, c in res["keras_checks"].items()
        if "epoch_loss_last_block" in c
    )
    agreement = res["agreement"]
    return [
        f"## {res['model']} ({res['params']:,} parameters)",
        "",
        *harness.step_table(res["rows"], refs),
        "",
        "autoflat / Keras, per step (median; below 1: autoflat faster):",
        "",
        *ratio_lines(res["rows"]),
        "",
        "Checks: "
        + (harness.agreement_line(agreement) if agreement else "JAX rows not checked.")
        + " Keras: "
        + keras_text
        + ".",
        "",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__doc__.splitlines()[0], batches=50)
    ap.add_argument(
        "--sizes",
        default="512:128,64:32",
        help="models as HIDDEN:BATCH, comma-separated (default: 512:128,64:32)",
    )
    ap.add_argument("--out", default=str(harness.ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.batches % K or args.batches < 2 * K:
        ap.error(f"--batches must be a multiple of {K}, at least {2 * K}")
    sizes = [tuple(int(v) for v in size.split(":")) for size in args.sizes.split(",")]
    repeats = args.repeats or (3 if args.quick else 9)
    block_s = args.block_seconds or (0.3 if args.quick else 1.5)
    machine, versions = harness.machine(), harness.versions(PACKAGES)
    harness.log("\n".join(harness.environment_lines(machine, versions)))
    results = [run_model(h, b, args.batches, repeats, block_s) for h, b in sizes]
    end_load = harness.load_average()

    command = harness.command("benchmarks/bench_keras.py", sys.argv[1:] if argv is None else argv)
    lines = [
        "# Keras 3 (JAX backend) vs autoflat: the same MLP, per training step",
        "",
        f"`{command.strip()}`",
        "",
        *harness.environment_lines(machine, versions, end_load),
        f"- **Models**: MLP {IN}-H-H-{CLASSES}, ReLU, softmax cross entropy, Adam lr {LR:g}; "
        f"data: {args.batches} batches on the host as NumPy arrays, the same order for every "
        "method",
        f"- **Timing**: {repeats} round-robin blocks of about {block_s:g} s per method, each "
        "continuing from its own state; a Keras block is one `model.fit` of whole epochs",
        "",
    ]
    for res in results:
        lines += section(res)
        print("", *section(res)[:-3], sep="\n")
    if keras_spe_is_host_loop():
        lines += [
            f"Note: keras {keras.__version__}'s JAX trainer runs steps_per_execution={K} as a "
            f"Python loop of {K} calls of its jitted one-step function (`JAXTrainer."
            "_make_function`), not as one compiled program of 10 steps: it saves the "
            "per-step callback and state work of `fit`, not the per-step launch.",
            "",
        ]
    lines += [
        *harness.notes_list(results[0]["rows"]),
        "",
        "Reproduce: `python benchmarks/bench_keras.py` (see its docstring for the method).",
    ]
    result = {
        "machine": machine,
        "versions": versions,
        "load_average_at_end": end_load,
        "config": {"repeats": repeats, "block_s": block_s, "lr": LR, "eps": EPS, "k": K},
        "models": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness.write_json(result, out / "keras.json")
    (out / "keras.md").write_text("\n".join(lines) + "\n")
    harness.log(f"written to {out / 'keras.md'} and .json")
    return result


if __name__ == "__main__":
    main()
