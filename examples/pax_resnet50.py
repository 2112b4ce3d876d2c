"""PAX's "Improve performance" tutorial, retold with Equinox and autoflat: ResNet50 + Adam.

The PAX tutorial (PAX needs an old JAX, so the model here is Equinox) measures the host-side
cost of calling a jitted `update(model, optimizer, inputs)`: every call flattens the model and
optimizer state and rebuilds them (`tree_flatten`/`tree_unflatten`), 40 s per 10,000 calls for
its ResNet50. Its remedies are manual: hold the leaves flat, run several steps per call in a
scan, rebuild the model only when needed. autoflat applies them to the unchanged step:

    @autoflat.step(num_steps=10)
    def update(model, opt_state, batch):
        ...
        return model, opt_state, loss

The script trains the tutorial's setup, a ResNet50 with 3 input channels and 10 classes on
batches of one 64x64x3 image, with Adam, for ten calls of ten steps, on scikit-learn's digits
(upsampled, repeated over three channels). The ResNet50 is written out below, with every
channel count scaled by `--width / 64`: the default, 16, keeps the 161 parameter arrays and a
quarter of the channels; `--width 64` is the standard ResNet50 (23.5M parameters), slow on a
CPU, whose convolutions are slow on the 2x2 maps of the last stage. Then it prints:

1. the time per step of plain `eqx.filter_jit(update)` against autoflat `num_steps=1` and
   `num_steps=10`, measured here from the same initial state on the same batches;
2. the tutorial's measurement, 10,000 iterations of `tree_flatten` + `tree_unflatten` of
   `(model, opt_state)` (its cost depends on the number of arrays, not their size), next to
   the host work autoflat leaves (flat lists of arrays).

    python examples/pax_resnet50.py               # width 16 (a few minutes on 2 CPU cores)
    python examples/pax_resnet50.py --width 2 --image-size 16   # compute tiny: host work shows
    python examples/pax_resnet50.py --smoke       # one block per stage, tiny sizes (CI)

Where the compute of a step is large, host work is a small part of it, as the tutorial notes
("usually less than 1%"); narrow widths and small images show the host work. On a CPU,
`num_steps=10` can compute slower than single steps for this model: XLA:CPU runs convolution
gradients much slower inside a loop body such as `lax.scan` (jax-ml/jax#12868), the more so
for larger batches (`--batch 8`, where the loss visibly falls within the 100 steps).

The norms use the statistics of the batch they are given and keep no running averages, so the
step stays a pure `(model, opt_state, batch) -> (model, opt_state, loss)`, the tutorial's
functional style (PAX's ResNet50 also tracks batch-norm averages; `equinox_batchnorm.py` shows
Equinox's `(model, state)` pattern under autoflat).
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import autoflat

NUM_STEPS = 10
STAGE_BLOCKS = (3, 4, 6, 3)  # ResNet50 (--smoke: one block per stage, to compile quickly)
STAGE_STRIDES = (1, 2, 2, 2)
EXPANSION = 4


# --- the model: ResNet50, width-scalable -------------------------------------------------


class Conv(eqx.Module):
    """A bias-free 2D convolution on a batch of NHWC images (ResNet convolutions have no
    bias: a norm follows each one). NHWC is the layout XLA's CPU convolutions prefer."""

    weight: jax.Array
    stride: int = eqx.field(static=True)

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, rng: np.random.Generator):
        shape = (kernel, kernel, cin, cout)
        self.weight = jnp.asarray(rng.normal(0, np.sqrt(2 / (cin * kernel**2)), shape), "float32")
        self.stride = stride

    def __call__(self, x: jax.Array) -> jax.Array:
        pad = self.weight.shape[0] // 2
        return jax.lax.conv_general_dilated(
            x,
            self.weight,
            window_strides=(self.stride, self.stride),
            padding=((pad, pad), (pad, pad)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )


class Norm(eqx.Module):
    """Batch norm with batch statistics (training mode) and a learnable scale and bias."""

    scale: jax.Array
    bias: jax.Array

    def __init__(self, channels: int, scale: float = 1.0):
        # an explicit dtype: `jnp.full(shape, 1.0)` alone is weakly typed, and the updated
        # arrays that come back are not, so the second call would compile again
        self.scale = jnp.full((channels,), scale, dtype=jnp.float32)
        self.bias = jnp.zeros((channels,))

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(axis=(0, 1, 2))
        var = x.var(axis=(0, 1, 2))
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale + self.bias


class Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self, n_in: int, n_out: int, rng: np.random.Generator):
        self.weight = jnp.asarray(rng.normal(0, np.sqrt(1 / n_in), (n_in, n_out)), "float32")
        self.bias = jnp.zeros((n_out,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight + self.bias


class Bottleneck(eqx.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, plus a projection shortcut where shapes change."""

    conv1: Conv
    norm1: Norm
    conv2: Conv
    norm2: Norm
    conv3: Conv
    norm3: Norm
    shortcut: tuple[Conv, Norm] | None

    def __init__(self, cin: int, width: int, stride: int, rng: np.random.Generator):
        cout = width * EXPANSION
        self.conv1, self.norm1 = Conv(cin, width, 1, 1, rng), Norm(width)
        self.conv2, self.norm2 = Conv(width, width, 3, stride, rng), Norm(width)
        # the last norm of each block starts at zero: each block starts as the identity
        self.conv3, self.norm3 = Conv(width, cout, 1, 1, rng), Norm(cout, scale=0.0)
        if stride != 1 or cin != cout:
            self.shortcut = (Conv(cin, cout, 1, stride, rng), Norm(cout))
        else:
            self.shortcut = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.norm1(self.conv1(x)))
        y = jax.nn.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        if self.shortcut is not None:
            conv, norm = self.shortcut
            x = norm(conv(x))
        return jax.nn.relu(x + y)


class ResNet50(eqx.Module):
    """ResNet50: a 7x7 stem and max pool, stages of [3, 4, 6, 3] bottlenecks of widths
    `width * (1, 2, 4, 8)` (expanded four times), global average pool, a linear classifier.
    `width=64` is the standard ResNet50; any width has its 161 parameter arrays."""

    stem: Conv
    stem_norm: Norm
    stages: tuple[tuple[Bottleneck, ...], ...]
    head: Linear

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        width: int = 64,
        blocks: tuple[int, ...] = STAGE_BLOCKS,
        *,
        seed: int = 0,
    ):
        # initialised with NumPy: each new shape drawn with jax.random would compile its own
        # small XLA program, seconds in all for ResNet50's many shapes
        rng = np.random.default_rng(seed)
        self.stem, self.stem_norm = Conv(in_channels, width, 7, 2, rng), Norm(width)
        cin, stages = width, []
        for i, (n, stride) in enumerate(zip(blocks, STAGE_STRIDES, strict=True)):
            w = width * 2**i
            stage = []
            for j in range(n):
                stage.append(Bottleneck(cin, w, stride if j == 0 else 1, rng))
                cin = w * EXPANSION
            stages.append(tuple(stage))
        self.stages = tuple(stages)
        self.head = Linear(cin, num_classes, rng)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits for a batch of NHWC images."""
        x = jax.nn.relu(self.stem_norm(self.stem(x)))
        x = jax.lax.reduce_window(
            x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0))
        )
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.head(x.mean(axis=(1, 2)))


# --- the step, as the tutorial writes it (functional style) -------------------------------

tx = optax.adam(1e-3)


def loss_fn(model: ResNet50, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    images, labels = batch
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def update(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


train_step = autoflat.step(update, num_steps=NUM_STEPS)


# --- data -----------------------------------------------------------------------------------


def digit_batches(steps: int, batch: int, image_size: int, seed: int = 0):
    """`steps` batches of digits as (steps, batch, image_size, image_size, 3) images (nearest
    upsampling of the 8x8 originals, repeated over three channels) and (steps, batch) labels."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(digits.target), size=(steps, batch))
    reps = -(-image_size // 8)
    images = (digits.images[idx] / 16.0 - 0.3).astype(np.float32)
    images = images.repeat(reps, axis=-2).repeat(reps, axis=-1)[..., :image_size, :image_size]
    images = np.broadcast_to(images[..., None], (steps, batch, image_size, image_size, 3))
    return jnp.asarray(images), jnp.asarray(digits.target[idx].astype(np.int32))


# --- measurements ---------------------------------------------------------------------------


def time_per_step(run, steps: int, repeats: int) -> float:
    """Median seconds per step of `run(steps)`, which must block on its result (run once
    first, to compile)."""
    run(steps)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(steps)
        times.append((time.perf_counter() - start) / steps)
    return float(np.median(times))


def duration(fn, iterations: int) -> float:
    """Seconds for `iterations` calls of `fn`, scaled to 10,000 iterations."""
    fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) * 10_000 / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16, help="64: the standard ResNet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=10, help="training calls of 10 steps")
    parser.add_argument("--iterations", type=int, default=10_000, help="flatten iterations")
    parser.add_argument("--plot", metavar="PATH", help="write the loss curve to a PNG")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CI)")
    args = parser.parse_args()
    blocks = STAGE_BLOCKS
    if args.smoke:
        args.width, args.image_size, args.batch, args.calls, args.iterations = 2, 16, 2, 2, 300
        blocks = (1, 1, 1, 1)

    model = ResNet50(3, 10, width=args.width, blocks=blocks, seed=42)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    n_params = sum(a.size for a in jax.tree.leaves(model))
    n_model, n_opt = len(jax.tree.leaves(model)), len(jax.tree.leaves(opt_state))
    name = "ResNet50" if blocks == STAGE_BLOCKS else f"ResNet, {list(blocks)} blocks"
    print(f"autoflat {autoflat.__version__}, jax {jax.__version__} on {jax.default_backend()}")
    print(
        f"{name}, width {args.width}: {n_params / 1e6:.2f}M parameters in {n_model} arrays, "
        f"Adam state {n_opt} arrays;\nbatches of {args.batch} digit image(s) upsampled to "
        f"{args.image_size}x{args.image_size}x3\n"
    )

    # 1. train, ten steps per call
    steps = args.calls * NUM_STEPS
    images, labels = digit_batches(steps, args.batch, args.image_size)
    losses = []
    with tqdm(total=steps, unit="step", desc="training") as bar:
        for start in range(0, steps, NUM_STEPS):
            batch = (images[start : start + NUM_STEPS], labels[start : start + NUM_STEPS])
            model, opt_state, loss = train_step(model, opt_state, batch)
            losses.extend(np.asarray(loss).tolist())
            bar.update(NUM_STEPS)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    print(
        f"mean loss: {np.mean(losses[:NUM_STEPS]):.3f} over the first {NUM_STEPS} steps, "
        f"{np.mean(losses[-NUM_STEPS:]):.3f} over the last {NUM_STEPS}"
    )
    s = autoflat.stats(train_step)
    print(
        f"autoflat: {s.calls} calls, {s.fast_path} state arguments on the fast path, "
        f"{s.flattens} host flattens, {s.traces} compiles, {s.rebuilds} rebuilds"
    )
    print("The code autoflat runs (first lines of autoflat.show(train_step)):")
    generated = autoflat.show(train_step, print_=False).splitlines()
    print("\n".join("    " + line for line in generated[:6]) + "\n    ...\n")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(np.arange(1, len(losses) + 1), losses)
        ax.set(xlabel="step", ylabel="training loss", title=f"{name}, width {args.width}")
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        print(f"loss curve written to {args.plot}\n")

    # 2. time per step: the same update three ways, from the same state, on the same batches
    timed = NUM_STEPS if args.smoke else 2 * NUM_STEPS
    repeats = 1 if args.smoke else 3
    model0 = ResNet50(3, 10, width=args.width, blocks=blocks, seed=0)
    opt_state0 = tx.init(eqx.filter(model0, eqx.is_array))
    plain = eqx.filter_jit(update)

    def run_plain(n):
        m, o = model0, opt_state0
        for i in range(n):
            m, o, loss = plain(m, o, (images[i], labels[i]))
        jax.block_until_ready(loss)

    def run_autoflat(k):
        # num_steps=10 reuses the training step: same shapes, so no new compile
        step = train_step if k == NUM_STEPS else autoflat.step(update, num_steps=k)

        def run(n):
            m, o = model0, opt_state0  # copied on the way in: autoflat donates only its own
            for i in range(0, n, k):
                if k == 1:
                    m, o, loss = step(m, o, (images[i], labels[i]))
                else:
                    m, o, loss = step(m, o, (images[i : i + k], labels[i : i + k]))
            jax.block_until_ready(loss)

        return run

    rows = [
        ("eqx.filter_jit", time_per_step(run_plain, timed, repeats)),
        ("autoflat num_steps=1", time_per_step(run_autoflat(1), timed, repeats)),
        ("autoflat num_steps=10", time_per_step(run_autoflat(NUM_STEPS), timed, repeats)),
    ]
    print("| method | time per step | speed-up vs eqx.filter_jit |\n|---|---:|---:|")
    for method, t in rows:
        print(f"| {method} | {t * 1e3:9.2f} ms | {rows[0][1] / t:5.2f}x |")
    if rows[2][1] > rows[1][1] and jax.default_backend() == "cpu":
        print(
            "num_steps=10 is slower per step than num_steps=1 here: on XLA:CPU, convolution\n"
            "gradients run much slower inside a loop body (the lax.scan) than outside one\n"
            "(jax-ml/jax#12868; a hand-written lax.scan is as slow). That is compute, not host\n"
            "work: num_steps=1 keeps autoflat's host savings without the loop."
        )
    print()

    # 3. the tutorial's measurement: host flatten/unflatten work, 10,000 iterations
    n = args.iterations
    handles = (model, opt_state)  # lazy handles, as the last training call returned them
    real = autoflat.unwrap(handles)  # the Equinox model and the optax state themselves
    leaves = jax.tree_util.tree_leaves(real)

    def naive():
        flat, treedef = jax.tree_util.tree_flatten(real)
        return jax.tree_util.tree_unflatten(treedef, flat)

    def flat_list():
        flat, treedef = jax.tree_util.tree_flatten(leaves)
        return jax.tree_util.tree_unflatten(treedef, flat)

    rows = [
        ("tree_flatten + tree_unflatten of (model, opt_state)  [tutorial: 40 s with PAX]", naive),
        ("tree_flatten of the model alone", lambda: jax.tree_util.tree_flatten(real[0])),
        (
            "tree_flatten of the two autoflat handles (no rebuild)",
            lambda: jax.tree_util.tree_flatten(handles),
        ),
        (f"tree_flatten + tree_unflatten of a flat list of the {len(leaves)} arrays", flat_list),
    ]
    print(f"Host time per 10,000 iterations (measured over {n:,}):")
    for what, fn in rows:
        print(f"  {duration(fn, n):7.3f} s  {what}")
    print(
        "On its call path autoflat flattens no handle: it reads each handle's cached structure\n"
        "and array list, and jax.jit flattens those lists (about the last row). The counters\n"
        f"say so: {s.flattens} host flattens in {s.calls} training calls (the first call's)."
    )


if __name__ == "__main__":
    main()
