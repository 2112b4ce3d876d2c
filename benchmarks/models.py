"""A ResNet50-shaped Equinox model with very narrow channels, for measuring host overhead.

`NarrowResNet50` has exactly the block and layer structure of ResNet50:

- a stem: 7x7 stride-2 convolution, norm, ReLU, 3x3 stride-2 max pool;
- four stages of bottleneck blocks, [3, 4, 6, 3] blocks, each bottleneck with three
  convolutions (1x1, 3x3, 1x1) and three norms, and a projection shortcut (1x1 convolution
  plus norm) in the first block of every stage;
- global average pooling and a linear classifier.

As in ResNet50 the convolutions have no bias, so the parameter arrays are the same 161 as
torchvision's `resnet50` (53 conv weights, 53 norm scales, 53 norm biases, the linear weight
and bias). Only the widths differ: every bottleneck is `width` channels wide inside and
`4 * width` outside (ResNet50: 64..512 and 256..2048), so the compute is tiny and the cost of
a training step is dominated by the per-call host work of whatever runs it.

The "norm" has a learnable per-channel scale and bias but no running statistics: it
normalises over the batch and spatial axes of the batch it is given (batch norm in training
mode, without the state). That keeps the training step a pure
`(model, opt_state, batch) -> (model, opt_state, loss)`.

Each bottleneck holds its activation function (`jax.nn.relu`) as an ordinary field, so the
model has non-array leaves, as many real Equinox models do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

STAGE_BLOCKS = (3, 4, 6, 3)
STAGE_STRIDES = (1, 2, 2, 2)
EXPANSION = 4


class Conv(eqx.Module):
    """A bias-free 2D convolution on a batched NCHW input."""

    weight: jax.Array
    stride: int = eqx.field(static=True)
    padding: int = eqx.field(static=True)

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, *, key: jax.Array):
        fan_in = cin * kernel * kernel
        self.weight = jax.random.normal(key, (cout, cin, kernel, kernel)) * jnp.sqrt(2.0 / fan_in)
        self.stride = stride
        self.padding = kernel // 2

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.conv_general_dilated(
            x,
            self.weight,
            window_strides=(self.stride, self.stride),
            padding=((self.padding, self.padding), (self.padding, self.padding)),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )


class Norm(eqx.Module):
    """Per-channel normalisation over batch and spatial axes, with a learnable scale and bias
    and no running statistics."""

    weight: jax.Array
    bias: jax.Array
    eps: float = eqx.field(static=True, default=1e-5)

    def __init__(self, channels: int, eps: float = 1e-5):
        self.weight = jnp.ones((channels,))
        self.bias = jnp.zeros((channels,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = jnp.mean(x, axis=(0, 2, 3), keepdims=True)
        var = jnp.var(x, axis=(0, 2, 3), keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return x * self.weight[None, :, None, None] + self.bias[None, :, None, None]


class Bottleneck(eqx.Module):
    conv1: Conv
    norm1: Norm
    conv2: Conv
    norm2: Norm
    conv3: Conv
    norm3: Norm
    shortcut: tuple[Conv, Norm] | None
    activation: Callable[[jax.Array], jax.Array]  # a non-array leaf (static for autoflat)

    def __init__(self, cin: int, width: int, stride: int, *, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        cout = width * EXPANSION
        self.conv1 = Conv(cin, width, 1, 1, key=k1)
        self.norm1 = Norm(width)
        self.conv2 = Conv(width, width, 3, stride, key=k2)
        self.norm2 = Norm(width)
        self.conv3 = Conv(width, cout, 1, 1, key=k3)
        self.norm3 = Norm(cout)
        if stride != 1 or cin != cout:
            self.shortcut = (Conv(cin, cout, 1, stride, key=k4), Norm(cout))
        else:
            self.shortcut = None
        self.activation = jax.nn.relu

    def __call__(self, x: jax.Array) -> jax.Array:
        act = self.activation
        y = act(self.norm1(self.conv1(x)))
        y = act(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        if self.shortcut is None:
            identity = x
        else:
            conv, norm = self.shortcut
            identity = norm(conv(x))
        return act(y + identity)


class NarrowResNet50(eqx.Module):
    stem_conv: Conv
    stem_norm: Norm
    stages: tuple[tuple[Bottleneck, ...], ...]
    fc: eqx.nn.Linear

    def __init__(
        self, num_classes: int = 10, width: int = 2, in_channels: int = 3, *, key: jax.Array
    ):
        k_stem, k_fc, *k_stages = jax.random.split(key, 2 + len(STAGE_BLOCKS))
        self.stem_conv = Conv(in_channels, width, 7, 2, key=k_stem)
        self.stem_norm = Norm(width)
        cin = width
        stages = []
        for n_blocks, stride, k in zip(STAGE_BLOCKS, STAGE_STRIDES, k_stages, strict=True):
            keys = jax.random.split(k, n_blocks)
            blocks = []
            for i in range(n_blocks):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1, key=keys[i]))
                cin = width * EXPANSION
            stages.append(tuple(blocks))
        self.stages = tuple(stages)
        self.fc = eqx.nn.Linear(cin, num_classes, key=k_fc)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits for a batch of NCHW images."""
        x = jax.nn.relu(self.stem_norm(self.stem_conv(x)))
        x = jax.lax.reduce_window(
            x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1))
        )
        for stage in self.stages:
            for block in stage:
                x = block(x)
        x = jnp.mean(x, axis=(2, 3))
        return jax.vmap(self.fc)(x)


def make_model(key: jax.Array, num_classes: int = 10, width: int = 2) -> NarrowResNet50:
    return NarrowResNet50(num_classes=num_classes, width=width, key=key)


def make_batch(
    key: jax.Array, batch_size: int, image_size: int = 32, num_classes: int = 10
) -> tuple[jax.Array, jax.Array]:
    """A random (images NCHW float32, integer labels) batch."""
    kx, ky = jax.random.split(key)
    images = jax.random.normal(kx, (batch_size, 3, image_size, image_size))
    labels = jax.random.randint(ky, (batch_size,), 0, num_classes)
    return images, labels


def loss_fn(model: NarrowResNet50, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    images, labels = batch
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def count_leaves(tree: Any) -> dict[str, int]:
    """Leaf counts of a pytree: all leaves, array leaves, and other (static) leaves."""
    leaves = jax.tree_util.tree_leaves(tree)
    arrays = sum(1 for x in leaves if eqx.is_array(x))
    return {"leaves": len(leaves), "arrays": arrays, "static": len(leaves) - arrays}


if __name__ == "__main__":
    m = make_model(jax.random.PRNGKey(0))
    print(count_leaves(m))
    b = make_batch(jax.random.PRNGKey(1), 8)
    print(loss_fn(m, b))
