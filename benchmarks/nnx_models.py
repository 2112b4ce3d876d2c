"""A ResNet50-shaped Flax NNX model with very narrow channels, for measuring host overhead.

The Flax NNX counterpart of `models.make_model`'s narrow ResNet50, with the same structure:

- a stem: 7x7 stride-2 convolution, norm, ReLU, 3x3 stride-2 max pool;
- four stages of bottleneck blocks, [3, 4, 6, 3] blocks, each bottleneck with three
  convolutions (1x1, 3x3, 1x1) and three norms, and a projection shortcut (1x1 convolution
  plus norm) in the first block of every stage;
- global average pooling and a linear classifier.

The convolutions have no bias, so there are the same 161 parameter arrays as ResNet50 (53
conv kernels, 53 norm scales, 53 norm biases, the linear kernel and bias). Every bottleneck is
`width` channels wide inside and `4 * width` outside, so the compute is tiny and a training
step is dominated by the per-call host work of whatever runs it.

Images are NHWC, as for the Equinox model (whose `make_batch` this is). The default norm
(`Norm`) matches the Equinox model's: a per-channel scale and bias, normalising over the batch
and spatial axes of the batch it is given, with no running statistics, so the only state a
train step changes is the parameters and the optimizer. `batchnorm=True` uses `nnx.BatchNorm`
instead (training mode: it also updates running statistics, 106 more `nnx.BatchStat` arrays
mutated by every step).

The train steps:

- `train_step(model, optimizer, x, y)`: the mutation style of the Flax docs
  (`optimizer.update(model, grads)`, returns the loss);
- `split_merge_step(graphdef, state, x, y)`: the same on the state of Flax's performance
  guide's functional loop (`nnx.merge` inside, `nnx.state(...)` returned), the state a
  plain pytree.

`methods` builds the ways of running them that `report.py` compares (`harness.Method`s).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import autoflat
from benchmarks import harness
from benchmarks.harness import Method, Plan
from benchmarks.models import make_batch

STAGE_BLOCKS = (3, 4, 6, 3)
STAGE_STRIDES = (1, 2, 2, 2)
EXPANSION = 4

_List: Any = getattr(nnx, "List", list)  # Flax >= 0.12 wants nnx.List for lists of modules


class Norm(nnx.Module):
    """Per-channel normalisation over batch and spatial axes (NHWC), with a learnable scale
    and bias and no running statistics."""

    def __init__(self, channels: int, eps: float = 1e-5):
        self.scale = nnx.Param(jnp.ones((channels,)))
        self.bias = nnx.Param(jnp.zeros((channels,)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = jnp.mean(x, axis=(0, 1, 2), keepdims=True)
        var = jnp.var(x, axis=(0, 1, 2), keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return x * self.scale[...] + self.bias[...]


def _norm(channels: int, batchnorm: bool, rngs: nnx.Rngs) -> nnx.Module:
    if batchnorm:
        return nnx.BatchNorm(channels, use_running_average=False, rngs=rngs)
    return Norm(channels)


def _conv(cin: int, cout: int, kernel: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
    pad = kernel // 2
    return nnx.Conv(
        cin,
        cout,
        kernel_size=(kernel, kernel),
        strides=(stride, stride),
        padding=((pad, pad), (pad, pad)),
        use_bias=False,
        kernel_init=nnx.initializers.he_normal(),
        rngs=rngs,
    )


class Bottleneck(nnx.Module):
    def __init__(self, cin: int, width: int, stride: int, batchnorm: bool, *, rngs: nnx.Rngs):
        cout = width * EXPANSION
        self.conv1 = _conv(cin, width, 1, 1, rngs)
        self.norm1 = _norm(width, batchnorm, rngs)
        self.conv2 = _conv(width, width, 3, stride, rngs)
        self.norm2 = _norm(width, batchnorm, rngs)
        self.conv3 = _conv(width, cout, 1, 1, rngs)
        self.norm3 = _norm(cout, batchnorm, rngs)
        if stride != 1 or cin != cout:
            self.shortcut_conv = _conv(cin, cout, 1, stride, rngs)
            self.shortcut_norm = _norm(cout, batchnorm, rngs)
        else:
            self.shortcut_conv = None
            self.shortcut_norm = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.relu(self.norm1(self.conv1(x)))
        y = nnx.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        if self.shortcut_conv is None:
            identity = x
        else:
            identity = self.shortcut_norm(self.shortcut_conv(x))
        return nnx.relu(y + identity)


class NarrowResNet50(nnx.Module):
    def __init__(
        self,
        num_classes: int = 10,
        width: int = 2,
        in_channels: int = 3,
        batchnorm: bool = False,
        *,
        rngs: nnx.Rngs,
    ):
        self.stem_conv = _conv(in_channels, width, 7, 2, rngs)
        self.stem_norm = _norm(width, batchnorm, rngs)
        cin = width
        stages = []
        for n_blocks, stride in zip(STAGE_BLOCKS, STAGE_STRIDES, strict=True):
            blocks = []
            for i in range(n_blocks):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1, batchnorm, rngs=rngs))
                cin = width * EXPANSION
            stages.append(_List(blocks))
        self.stages = _List(stages)
        self.fc = nnx.Linear(cin, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits for a batch of NHWC images."""
        x = nnx.relu(self.stem_norm(self.stem_conv(x)))
        x = jax.lax.reduce_window(
            x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0))
        )
        for stage in self.stages:
            for block in stage:
                x = block(x)
        x = jnp.mean(x, axis=(1, 2))
        return self.fc(x)


def make_model(
    seed: int = 0, num_classes: int = 10, width: int = 2, batchnorm: bool = False
) -> NarrowResNet50:
    return NarrowResNet50(
        num_classes=num_classes, width=width, batchnorm=batchnorm, rngs=nnx.Rngs(seed)
    )


def make_optimizer(model: nnx.Module, learning_rate: float = 1e-3) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)


def loss_fn(model: NarrowResNet50, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(model, optimizer, x, y):
    """Mutation style, as in the Flax docs: updates `model` and `optimizer` in place."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def split_merge_step(graphdef, state, x, y):
    """The same step on `nnx.split((model, optimizer))`'s state, returning the new state."""
    model, optimizer = nnx.merge(graphdef, state)
    loss = train_step(model, optimizer, x, y)
    return nnx.state((model, optimizer)), loss


def count_leaves(*objs: Any) -> dict[str, int]:
    """Array leaves of NNX objects' state, and how many are parameters."""
    state = nnx.state(objs)
    leaves = jax.tree_util.tree_leaves(state)
    params = jax.tree_util.tree_leaves(nnx.state(objs, nnx.Param))
    return {"arrays": len(leaves), "params": len(params)}


# ==========================================================================================
# The ways of running the steps that the benchmarks compare
# ==========================================================================================


class Setup:
    """The shared inputs of the NNX methods (`args`: one step's (x, y); `checks`: those of the
    steps every method runs before timing); `fresh()` is a new model and optimizer."""

    def __init__(self, width: int, batch_size: int, image_size: int, batchnorm: bool):
        self.width, self.batchnorm = width, batchnorm
        key, *keys = jax.random.split(jax.random.PRNGKey(1), harness.CHECK_STEPS + 1)
        self.args = make_batch(key, batch_size, image_size)
        self.checks = [make_batch(k, batch_size, image_size) for k in keys]

    def fresh(self) -> tuple[Any, Any]:
        model = make_model(seed=0, width=self.width, batchnorm=self.batchnorm)
        return model, make_optimizer(model)


class SplitMerge(Method):
    """The loop of Flax's performance guide: `loss, state = f(graphdef, state, x, y)`."""

    def _loop(self, n: int, args: tuple[Any, ...]) -> Any:
        f, (graphdef,), (state,), loss = self.fn, self.fixed, self.state, None
        for _ in range(n):
            loss, state = f(graphdef, state, *args)
        self.state = (state,)
        return loss


def _mutating(build: Any) -> Any:
    """A plan calling `build(model, optimizer)(model, optimizer, x, y)` on fresh objects
    that the step updates in place."""

    def make(s: Setup) -> Plan:
        model, optimizer = s.fresh()
        return Plan(lambda: build(model, optimizer), fixed=(model, optimizer))

    return make


def _partial(bind: Any) -> Any:
    """A plan calling `bind(model, optimizer)(x, y)`: model and optimizer bound in a partial."""

    def make(s: Setup) -> Plan:
        model, optimizer = s.fresh()
        return Plan(lambda: bind(model, optimizer))

    return make


def _cached_partial(model: Any, optimizer: Any) -> Any:
    jitted = nnx.jit(train_step, graph=True, graph_updates=True)
    with nnx.set_graph_mode(True), nnx.set_graph_updates(True):
        return nnx.cached_partial(jitted, model, optimizer)


def _split_merge(s: Setup) -> Plan:
    graphdef, state = nnx.split(s.fresh())

    @jax.jit
    def jax_train_step(graphdef, state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, x, y)
        return loss, nnx.state((model, optimizer))

    return Plan(lambda: jax_train_step, (state,), (graphdef,))


def _scan(s: Setup) -> Plan:
    graphdef, state = nnx.split(s.fresh())

    def body(state, xy):
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, *xy)
        return nnx.state((model, optimizer)), loss

    scan = lambda s, x, y: jax.lax.scan(body, s, (x, y))  # noqa: E731
    return Plan(lambda: jax.jit(scan, donate_argnums=0), (state,))


# key: (label, plan, note)
CATALOGUE: dict[str, tuple[str, Any, str]] = {
    "nnx_jit": (
        "nnx.jit (graph mode, the default)",
        _mutating(lambda m, o: nnx.jit(train_step)),
        "nnx.jit(train_step): graph=True, graph_updates=True are Flax 0.12's defaults; no donation",
    ),
    "nnx_jit_tree": (
        "nnx.jit(graph=False) (tree mode)",
        _mutating(lambda m, o: nnx.jit(train_step, graph=False)),
        "modules treated as pytrees; no donation",
    ),
    "cached_partial": (
        "nnx.cached_partial (graph mode)",
        _partial(_cached_partial),
        "nnx.cached_partial(nnx.jit(train_step, graph=True, graph_updates=True), model, "
        "optimizer) under set_graph_mode(True), set_graph_updates(True), as its docstring",
    ),
    "jit_partial": (
        "nnx.jit_partial (tree mode)",
        _partial(lambda m, o: nnx.jit_partial(train_step, m, o, graph=False)),
        "nnx.jit_partial(train_step, model, optimizer, graph=False), as its docstring",
    ),
    "split_merge": (
        "split/merge loop (jax.jit on state)",
        _split_merge,
        "Flax performance guide's functional loop: graphdef, state = nnx.split((model, "
        "optimizer)) once; jax.jit(step)(graphdef, state, x, y) merges inside and returns "
        "nnx.state(...); no donation (as written)",
    ),
}


def methods(s: Setup, keys: Sequence[str], compute_steps: int = 100) -> list[Method]:
    """The methods of `keys`: those of `CATALOGUE`; `autoflat_mut_{k}` (the mutation-style
    step, the caller's objects written back after each call as nnx.jit does);
    `autoflat_fn_{k}` (`split_merge_step` with the graphdef bound by a `functools.partial`,
    the state's handles passed back); `compute` (a jitted
    `lax.scan` of `compute_steps` split/merge steps, donated: the device compute per step)."""
    out: list[Method] = []
    for key in keys:
        k = int(key.rsplit("_", 1)[-1]) if key.startswith("autoflat") else 1
        if key in CATALOGUE:
            label, make, note = CATALOGUE[key]
            cls = SplitMerge if key == "split_merge" else Method
            out.append(cls(key, label, lambda make=make: make(s), note=note))
        elif key.startswith("autoflat_mut"):
            build = _mutating(lambda m, o, k=k: autoflat.step(train_step, num_steps=k))
            note = (
                f"autoflat.step(train_step, num_steps={k}) called with the caller's model and "
                "optimizer every time (written back in place after each call, as nnx.jit does)"
            )
            label = f"autoflat num_steps={k} (mutation style)"
            out.append(Method(key, label, lambda b=build: b(s), steps_per_call=k, note=note))
        elif key.startswith("autoflat_fn"):
            graphdef, _ = nnx.split(s.fresh())
            step = functools.partial(split_merge_step, graphdef)
            functools.update_wrapper(step, split_merge_step)
            state = lambda: (nnx.split(s.fresh())[1],)  # noqa: E731
            out.append(harness.autoflat_method(key, step, state, " (split/merge state)"))
        elif key == "compute":
            label = f"device compute (lax.scan of {compute_steps}, split/merge)"
            note = (
                f"jax.jit of a lax.scan of {compute_steps} split/merge steps (state donated): "
                "an estimate of the compute per step"
            )
            make = lambda: _scan(s)  # noqa: E731
            out.append(Method(key, label, make, steps_per_call=compute_steps, note=note))
        else:
            raise KeyError(key)
    return out
