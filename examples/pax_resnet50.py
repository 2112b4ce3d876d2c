"""PAX's "Improve performance" tutorial, retold with Equinox and autoflat: a ResNet50 + Adam step.

The PAX tutorial (PAX needs an old JAX, so the model here is Equinox) measures the host-side
cost of calling a jitted `update(model, optimizer, inputs)`: every call flattens the model and
optimizer state and rebuilds them (`tree_flatten`/`tree_unflatten`), 40 s per 10,000 calls for
its ResNet50. Its remedies are all manual: hold the leaves flat, run several steps per call
in a scan, rebuild the model only when needed. autoflat applies them to the unchanged step:

    @autoflat.step(num_steps=10)
    def update(model, opt_state, batch):
        ...
        return model, opt_state, loss

This script trains a ResNet50 (Equinox, self-contained below; `--width 64` is the real
ResNet50, 23.5M parameters) with Adam for a few calls of ten steps on scikit-learn's digits
(upsampled to `--image-size` pixels, three channels), then prints:

1. the time per step of plain `eqx.filter_jit(update)` against autoflat `num_steps=1` and
   `num_steps=10`, measured here, from the same initial state;
2. the tutorial's own measurement, 10,000 iterations of `tree_flatten` + `tree_unflatten` of
   `(model, opt_state)`, next to the work left when the state is held as flat leaves, which is
   what autoflat passes to `jax.jit` (its handles are never flattened on the call path).

    python examples/pax_resnet50.py                 # width 16 (a few minutes on 2 CPU cores)
    python examples/pax_resnet50.py --width 64      # the real ResNet50 (slow on a CPU)
    python examples/pax_resnet50.py --smoke         # tiny width and images, for CI

The norms normalise with the statistics of the batch they are given and keep no running
averages, so the step stays a pure `(model, opt_state, batch) -> (model, opt_state, loss)`
as in the tutorial's functional style (PAX's ResNet50 also updates batch-norm statistics; see
`equinox_batchnorm.py` for Equinox's `(model, state)` pattern under autoflat).
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
STAGE_BLOCKS = (3, 4, 6, 3)  # ResNet50
STAGE_STRIDES = (1, 2, 2, 2)
EXPANSION = 4


# --- the model: ResNet50, width-scalable -------------------------------------------------


class Conv(eqx.Module):
    """A bias-free 2D convolution on a batch of NCHW images (ResNet convolutions have no
    bias: a norm follows each one)."""

    weight: jax.Array
    stride: int = eqx.field(static=True)

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, *, key: jax.Array):
        fan_in = cin * kernel * kernel
        self.weight = jax.random.normal(key, (cout, cin, kernel, kernel)) * np.sqrt(2 / fan_in)
        self.stride = stride

    def __call__(self, x: jax.Array) -> jax.Array:
        pad = self.weight.shape[-1] // 2
        return jax.lax.conv_general_dilated(
            x,
            self.weight,
            window_strides=(self.stride, self.stride),
            padding=((pad, pad), (pad, pad)),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )


class Norm(eqx.Module):
    """Batch norm with batch statistics (training mode) and a learnable scale and bias."""

    scale: jax.Array
    bias: jax.Array

    def __init__(self, channels: int, scale: float = 1.0):
        self.scale = jnp.full((channels,), scale)
        self.bias = jnp.zeros((channels,))

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(axis=(0, 2, 3), keepdims=True)
        var = x.var(axis=(0, 2, 3), keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + 1e-5)
        return x * self.scale[:, None, None] + self.bias[:, None, None]


class Bottleneck(eqx.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, plus a projection shortcut where shapes change."""

    conv1: Conv
    norm1: Norm
    conv2: Conv
    norm2: Norm
    conv3: Conv
    norm3: Norm
    shortcut: tuple[Conv, Norm] | None

    def __init__(self, cin: int, width: int, stride: int, *, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        cout = width * EXPANSION
        self.conv1, self.norm1 = Conv(cin, width, 1, key=k1), Norm(width)
        self.conv2, self.norm2 = Conv(width, width, 3, stride, key=k2), Norm(width)
        # the last norm of each block starts at zero: each block starts as the identity
        self.conv3, self.norm3 = Conv(width, cout, 1, key=k3), Norm(cout, scale=0.0)
        if stride != 1 or cin != cout:
            self.shortcut = (Conv(cin, cout, 1, stride, key=k4), Norm(cout))
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
    head: eqx.nn.Linear

    def __init__(self, in_channels: int, num_classes: int, width: int = 64, *, key: jax.Array):
        k_stem, k_head, *k_stages = jax.random.split(key, 2 + len(STAGE_BLOCKS))
        self.stem, self.stem_norm = Conv(in_channels, width, 7, 2, key=k_stem), Norm(width)
        cin, stages = width, []
        for i, (n, stride, k) in enumerate(zip(STAGE_BLOCKS, STAGE_STRIDES, k_stages, strict=True)):
            w = width * 2**i
            keys = jax.random.split(k, n)
            stages.append(
                tuple(Bottleneck(w * EXPANSION if j else cin, w, stride if j == 0 else 1, key=keys[j]) for j in range(n))
            )
            cin = w * EXPANSION
        self.stages = tuple(stages)
        self.head = eqx.nn.Linear(cin, num_classes, key=k_head)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits for a batch of NCHW images."""
        x = jax.nn.relu(self.stem_norm(self.stem(x)))
        x = jax.lax.reduce_window(
            x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1))
        )
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return jax.vmap(self.head)(x.mean(axis=(2, 3)))


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
    """`steps` batches of digits as (steps, batch, 3, image_size, image_size) images (nearest
    upsampling of the 8x8 originals, repeated over three channels) and (steps, batch) labels."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(digits.target), size=(steps, batch))
    reps = -(-image_size // 8)
    images = (digits.images[idx] / 16.0 - 0.3).astype(np.float32)
    images = images.repeat(reps, axis=-2).repeat(reps, axis=-1)[..., :image_size, :image_size]
    images = np.broadcast_to(images[:, :, None], (steps, batch, 3, image_size, image_size))
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
    parser.add_argument("--width", type=int, default=16, help="64: the real ResNet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=10, help="training calls of 10 steps")
    parser.add_argument("--iterations", type=int, default=10_000, help="flatten iterations")
    parser.add_argument("--plot", metavar="PATH", help="write the loss curve to a PNG")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.width, args.image_size, args.batch, args.calls, args.iterations = 2, 16, 2, 2, 300

    model = ResNet50(3, 10, width=args.width, key=jax.random.key(42))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    params = eqx.filter(model, eqx.is_array)
    n_params = sum(a.size for a in jax.tree.leaves(params))
    n_model, n_opt = len(jax.tree.leaves(model)), len(jax.tree.leaves(opt_state))
    print(f"autoflat {autoflat.__version__}, jax {jax.__version__}, devices: {jax.devices()}")
    print(
        f"ResNet50 width {args.width}: {n_params / 1e6:.2f}M parameters in {n_model} arrays; "
        f"Adam state {n_opt} arrays; batches of {args.batch} images 3x{args.image_size}x"
        f"{args.image_size}\n"
    )

    # 1. train: num_steps=10 steps per call
    steps = args.calls * NUM_STEPS
    images, labels = digit_batches(steps, args.batch, args.image_size)
    losses = []
    with tqdm(total=steps, unit="step", desc="training") as bar:
        for start in range(0, steps, NUM_STEPS):
            chunk = (images[start : start + NUM_STEPS], labels[start : start + NUM_STEPS])
            model, opt_state, loss = train_step(model, opt_state, chunk)
            losses.extend(np.asarray(loss).tolist())
            bar.update(NUM_STEPS)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    print(
        f"loss: {np.mean(losses[:NUM_STEPS]):.3f} over the first {NUM_STEPS} steps, "
        f"{np.mean(losses[-NUM_STEPS:]):.3f} over the last {NUM_STEPS}"
    )
    s = autoflat.stats(train_step)
    print(
        f"autoflat: {s.calls} calls, {s.fast_path} state arguments on the fast path, "
        f"{s.flattens} host flattens, {s.traces} compiles, {s.rebuilds} rebuilds"
    )
    print("The code autoflat runs (first lines of autoflat.show(train_step)):")
    generated = autoflat.show(train_step, print_=False).splitlines()
    print("\n".join("    " + line for line in generated[:9]) + "\n    ...\n")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(np.arange(1, len(losses) + 1), losses)
        ax.set(xlabel="step", ylabel="training loss", title=f"ResNet50 (width {args.width})")
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
        print(f"loss curve written to {args.plot}\n")

    # 2. time per step, from the same initial state, on the same batches
    timed = 10 if args.smoke else 20
    repeats = 2 if args.smoke else 3
    fresh = ResNet50(3, 10, width=args.width, key=jax.random.key(0))
    batches = (images[:timed], labels[:timed])
    plain = eqx.filter_jit(update)

    def run_plain(n):
        m, o = fresh, tx.init(eqx.filter(fresh, eqx.is_array))
        for i in range(n):
            m, o, loss = plain(m, o, (batches[0][i], batches[1][i]))
        jax.block_until_ready(loss)

    def run_autoflat(k):
        step = train_step if k == NUM_STEPS else autoflat.step(update, num_steps=k)

        def run(n):
            m, o = fresh, tx.init(eqx.filter(fresh, eqx.is_array))
            for i in range(0, n, k):
                chunk = (batches[0][i], batches[1][i]) if k == 1 else jax.tree.map(
                    lambda a, i=i: a[i : i + k], batches
                )
                m, o, loss = step(m, o, chunk)
            jax.block_until_ready(loss)

        return run

    rows = [
        ("eqx.filter_jit", time_per_step(run_plain, timed, repeats)),
        ("autoflat num_steps=1", time_per_step(run_autoflat(1), timed, repeats)),
        ("autoflat num_steps=10", time_per_step(run_autoflat(10), timed, repeats)),
    ]
    print("| method | time per step | speed-up vs eqx.filter_jit |\n|---|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {t * 1e3:9.2f} ms | {rows[0][1] / t:5.2f}x |")

    # 3. the tutorial's measurement: host flatten/unflatten work per call
    n = args.iterations
    state = (model, opt_state)  # lazy handles, as the last call returned them
    real = autoflat.unwrap(state)  # the real Equinox model and optax state
    flat, treedef = jax.tree_util.tree_flatten(real)
    arrays = [x for x in flat if eqx.is_array(x)]
    print(f"\nHost time per 10,000 iterations (measured over {n:,}):")

    def naive():
        leaves, tdef = jax.tree_util.tree_flatten(real)
        return jax.tree_util.tree_unflatten(tdef, leaves)

    def flat_leaves():
        leaves, tdef = jax.tree_util.tree_flatten(arrays)
        return jax.tree_util.tree_unflatten(tdef, leaves)

    rows = [
        ("tree_flatten + tree_unflatten of (model, opt_state) [the tutorial's 40 s]", naive),
        ("tree_flatten of the model alone", lambda: jax.tree_util.tree_flatten(real[0])),
        ("tree_flatten of the autoflat handles (public pytree API)", lambda: jax.tree_util.tree_flatten(state)),
        (f"tree_flatten + tree_unflatten of the flat list of {len(arrays)} arrays", flat_leaves),
    ]
    for name, fn in rows:
        print(f"  {duration(fn, n):7.3f} s  {name}")
    print(
        "autoflat's call path never flattens a handle: it reads the handle's cached structure\n"
        "and array list (O(1)), and jax.jit flattens that flat list, as in the last row.\n"
        f"So after the first call, `flattens` stays at {s.flattens} (one per state argument)."
    )


if __name__ == "__main__":
    main()
