"""The Equinox ResNet50 of the benchmarks and of `examples/pax_resnet50.py`, its training step,
and the ways of running that step the benchmarks compare.

`ResNet50` has exactly the block and layer structure of ResNet50:

- a stem: 7x7 stride-2 convolution, norm, ReLU, 3x3 stride-2 max pool;
- four stages of bottleneck blocks, [3, 4, 6, 3] blocks, each bottleneck with three
  convolutions (1x1, 3x3, 1x1) and three norms, and a projection shortcut (1x1 convolution
  plus norm) in the first block of every stage;
- global average pooling and a linear classifier.

As in ResNet50 the convolutions have no bias, so the parameter arrays are the same 161 as
torchvision's `resnet50` (53 conv weights, 53 norm scales, 53 norm biases, the linear weight
and bias). With `widen=True` stage i is `width * 2**i` channels wide inside and four times
that outside (`width=64` is the standard ResNet50, 23.5M parameters); `make_model` builds the
benchmarks' narrow one (`widen=False`, every bottleneck `width` channels inside and
`4 * width` outside), whose compute is so small that a training step is dominated by the
per-call host work of whatever runs it. Images are NHWC, the layout XLA's CPU convolutions
prefer.

The "norm" has a learnable per-channel scale and bias but no running statistics: it
normalises over the batch and spatial axes of the batch it is given (batch norm in training
mode, without the state). That keeps the training step a pure
`(model, opt_state, batch) -> (model, opt_state, loss)`. Each bottleneck holds its activation
function (`jax.nn.relu`) as an ordinary field, so the model has non-array leaves, as many real
Equinox models do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoflat
from benchmarks import harness
from benchmarks.harness import Method, Plan

STAGE_BLOCKS = (3, 4, 6, 3)
STAGE_STRIDES = (1, 2, 2, 2)
EXPANSION = 4


class Conv(eqx.Module):
    """A bias-free 2D convolution on a batch of NHWC images (a norm follows each one)."""

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
    activation: Callable[[jax.Array], jax.Array]  # a non-array leaf (static for autoflat)

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
        self.activation = jax.nn.relu

    def __call__(self, x: jax.Array) -> jax.Array:
        act = self.activation
        y = act(self.norm1(self.conv1(x)))
        y = act(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        if self.shortcut is not None:
            conv, norm = self.shortcut
            x = norm(conv(x))
        return act(x + y)


class ResNet50(eqx.Module):
    """ResNet50 (see the module docstring); any width and `blocks` per stage."""

    stem: Conv
    stem_norm: Norm
    stages: tuple[tuple[Bottleneck, ...], ...]
    head: Linear

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 64,
        blocks: tuple[int, ...] = STAGE_BLOCKS,
        *,
        widen: bool = True,
        seed: int = 0,
    ):
        # initialised with NumPy: each new shape drawn with jax.random would compile its own
        # small XLA program, seconds in all for ResNet50's many shapes
        rng = np.random.default_rng(seed)
        self.stem, self.stem_norm = Conv(in_channels, width, 7, 2, rng), Norm(width)
        cin, stages = width, []
        for i, (n, stride) in enumerate(zip(blocks, STAGE_STRIDES, strict=True)):
            w = width * 2**i if widen else width
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


def make_model(seed: int = 0, num_classes: int = 10, width: int = 2) -> ResNet50:
    """The benchmarks' narrow ResNet50: `width` channels inside every bottleneck."""
    return ResNet50(3, num_classes, width, widen=False, seed=seed)


def make_batch(
    key: jax.Array, batch_size: int, image_size: int = 16, num_classes: int = 10
) -> tuple[jax.Array, jax.Array]:
    """A random (images NHWC float32, integer labels) batch."""
    kx, ky = jax.random.split(key)
    images = jax.random.normal(kx, (batch_size, image_size, image_size, 3))
    labels = jax.random.randint(ky, (batch_size,), 0, num_classes)
    return images, labels


def loss_fn(model: ResNet50, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    images, labels = batch
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


tx = optax.adam(1e-3)


def make_update(loss_fn: Callable[[Any, Any], jax.Array]) -> Callable[..., Any]:
    """The usual Equinox training step with `tx` (Adam) for a loss `loss_fn(model, batch)`."""

    def update(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return update


update = make_update(loss_fn)


def count_leaves(tree: Any) -> dict[str, int]:
    """Leaf counts of a pytree: all leaves, array leaves, and other (static) leaves."""
    leaves = jax.tree_util.tree_leaves(tree)
    arrays = sum(1 for x in leaves if eqx.is_array(x))
    return {"leaves": len(leaves), "arrays": arrays, "static": len(leaves) - arrays}


# ==========================================================================================
# The ways of running `update` that the benchmarks compare
# ==========================================================================================


class Setup:
    """The shared initial state and inputs of the Equinox methods: `args`, one step's inputs
    (timed), and `checks`, the distinct inputs of the steps every method runs before timing."""

    def __init__(self, width: int = 2, batch_size: int = 8, image_size: int = 16):
        self.model = make_model(seed=0, width=width)
        self.opt_state = tx.init(eqx.filter(self.model, eqx.is_array))
        key, *keys = jax.random.split(jax.random.PRNGKey(0), harness.CHECK_STEPS + 1)
        self.args = (make_batch(key, batch_size, image_size),)
        self.checks = [(make_batch(k, batch_size, image_size),) for k in keys]

    def fresh(self) -> tuple[Any, Any]:
        return harness.fresh((self.model, self.opt_state))


class FlatLayout:
    """A tree held as (treedef, static leaves, array positions): flatten once, rebuild inside."""

    def __init__(self, tree: Any):
        leaves, self.treedef = jax.tree_util.tree_flatten(tree)
        self.pos = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
        self.static = [None if eqx.is_array(x) else x for x in leaves]
        self.arrays = [leaves[i] for i in self.pos]

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        full = list(self.static)
        for i, a in zip(self.pos, arrays, strict=True):
            full[i] = a
        return jax.tree_util.tree_unflatten(self.treedef, full)

    def arrays_of(self, tree: Any) -> list[Any]:
        leaves = jax.tree_util.tree_leaves(tree)
        return [leaves[i] for i in self.pos]

    def body(self, arrays: Sequence[Any], batch: Any) -> tuple[list[Any], Any]:
        """`update` on the array leaves: rebuild, step, the new array leaves."""
        model, opt_state, loss = update(*self.rebuild(arrays), batch)
        return self.arrays_of((model, opt_state)), loss


class Packing(FlatLayout):
    """The array leaves packed into one f32 buffer (integer leaves, Adam's count, are exact
    in f32 below 2**24)."""

    def __init__(self, tree: Any):
        super().__init__(tree)
        self.shapes = [tuple(a.shape) for a in self.arrays]
        self.dtypes = [a.dtype for a in self.arrays]
        self.offsets = np.cumsum([0, *(math.prod(s) for s in self.shapes)]).tolist()

    def pack(self, arrays: Sequence[Any]) -> jax.Array:
        return jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in arrays])

    def packed_body(self, buf: jax.Array, batch: Any) -> tuple[jax.Array, Any]:
        arrays = [
            jax.lax.slice(buf, (o,), (e,)).reshape(s).astype(d)
            for o, e, s, d in zip(
                self.offsets, self.offsets[1:], self.shapes, self.dtypes, strict=False
            )
        ]
        arrays, loss = self.body(arrays, batch)
        return self.pack(arrays), loss


NOTES = {
    "jit": "params, static = eqx.partition(model, eqx.is_array) once; jax.jit of a step doing "
    "eqx.combine(params, static) inside; no donation (jax.jit's default)",
    "jit_donate": "as jax.jit, with donate_argnums=(0, 1)",
    "filter_jit": "called with the model itself",
    "eqx_recipe": "Equinox docs 'Low-overhead training loops': tree_flatten model and opt_state "
    "once; eqx.filter_jit step takes both leaf lists, unflattens inside, returns tree_leaves; "
    "no donation (as written)",
    "hand_flat": "(model, opt_state) flattened once; the array leaves travel as one list "
    "(donated), non-array leaves and treedef closed over; unflatten inside",
    "single_buffer": "every array leaf packed into ONE f32 buffer (donated); sliced, reshaped "
    "and cast inside, packed again on the way out: one state buffer in, one out",
}
LABELS = {
    "jit": "jax.jit (partition outside)",
    "jit_donate": "jax.jit + donate (partition once, combine inside)",
    "filter_jit": "eqx.filter_jit",
    "eqx_recipe": "Equinox docs recipe (flat leaves + filter_jit)",
    "hand_flat": "hand-written flat leaves (jax.jit + donate)",
    "single_buffer": "single-buffer floor (one packed f32 buffer)",
}


def lazy_false_method(key: str, s: Setup) -> Method:
    """`autoflat_{k}[...]_lazyfalse`: the method of the key without `_lazyfalse`
    (`harness.autoflat_method`), decorated with `lazy=False`: the step returns the real
    model and optimizer state after every call, and they are passed back."""
    base_key = key.removesuffix("_lazyfalse")
    base = harness.autoflat_method(base_key, update, s.fresh, suffix=", lazy=False")
    options: dict[str, Any] = {
        "num_steps": base.steps_per_call,
        "donate": "_nodonate" not in base_key,
        "pack": True
        if base_key.endswith("_pack")
        else "auto"
        if base_key.endswith("_auto")
        else False,
        "lazy": False,
    }
    plan = lambda: Plan(lambda: autoflat.step(update, **options), s.fresh())  # noqa: E731
    note = base.note.replace(
        "returned handles passed back", "lazy=False: returned objects passed back"
    )
    return Method(key, base.label, plan, steps_per_call=base.steps_per_call, note=note)


def methods(s: Setup, keys: Sequence[str], compute_steps: int = 100) -> list[Method]:
    """The methods of `keys`: those of `LABELS`, `compute` (a hand-written `lax.scan` of
    `compute_steps` steps on flat leaves, donated: an estimate of the device compute per
    step), and `autoflat_{k}` with optional suffixes `_nodonate`, `_pack` or `_auto`, then
    `_lazyfalse` (`lazy=False`)."""

    def partitioned(donate: bool) -> Plan:
        model, opt_state = s.fresh()
        params, static = eqx.partition(model, eqx.is_array)

        def step(params, opt_state, batch):
            model, opt_state, loss = update(eqx.combine(params, static), opt_state, batch)
            return eqx.filter(model, eqx.is_array), opt_state, loss

        jit = lambda: jax.jit(step, donate_argnums=(0, 1) if donate else ())  # noqa: E731
        return Plan(jit, (params, opt_state))

    def recipe() -> Plan:
        (flat_model, tm), (flat_opt, to) = (jax.tree_util.tree_flatten(t) for t in s.fresh())

        @eqx.filter_jit
        def make_step(flat_model, flat_opt_state, batch):
            model = jax.tree_util.tree_unflatten(tm, flat_model)
            opt_state = jax.tree_util.tree_unflatten(to, flat_opt_state)
            model, opt_state, loss = update(model, opt_state, batch)
            return jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(opt_state), loss

        return Plan(lambda: make_step, (flat_model, flat_opt))

    def hand_flat() -> Plan:
        layout = FlatLayout(s.fresh())
        return Plan(lambda: jax.jit(layout.body, donate_argnums=0), (layout.arrays,))

    def single_buffer() -> Plan:
        p = Packing(s.fresh())
        return Plan(lambda: jax.jit(p.packed_body, donate_argnums=0), (p.pack(p.arrays),))

    def compute() -> Plan:
        layout = FlatLayout(s.fresh())
        scan = lambda a, bs: jax.lax.scan(layout.body, a, bs)  # noqa: E731
        return Plan(lambda: jax.jit(scan, donate_argnums=0), (layout.arrays,))

    plans: dict[str, Callable[[], Plan]] = {
        "jit": lambda: partitioned(False),
        "jit_donate": lambda: partitioned(True),
        "filter_jit": lambda: Plan(lambda: eqx.filter_jit(update), s.fresh()),
        "eqx_recipe": recipe,
        "hand_flat": hand_flat,
        "single_buffer": single_buffer,
    }
    out = []
    for key in keys:
        if key in plans:
            out.append(Method(key, LABELS[key], plans[key], note=NOTES[key]))
        elif key == "compute":
            note = (
                f"jax.jit of a lax.scan of {compute_steps} steps on the flat array leaves "
                "(donated): the host cost of one call shared by that many steps; an estimate "
                "of the compute per step"
            )
            label = f"device compute (lax.scan of {compute_steps}, flat leaves)"
            out.append(Method(key, label, compute, steps_per_call=compute_steps, note=note))
        elif key.endswith("_lazyfalse"):
            out.append(lazy_false_method(key, s))
        else:
            out.append(harness.autoflat_method(key, update, s.fresh))
    return out
