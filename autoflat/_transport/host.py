"""State packed and unpacked outside a step: the caller's concrete arrays, a handle's buffers.

`layout` says how a state's leaves travel and packs them inside the step's trace; this module
does the same for concrete values on the host's behalf: it picks the layout of a call's state
(`host_layout`, `mode_for`), packs the caller's arrays into buffers before a launch
(`pack_on_device`) and unpacks a handle's buffers when it is rebuilt (`unpack_on_device`).
Each is one device call, or the first times a layout is seen, a copy made with NumPy
(`_HOST_CALLS`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax
from .layout import Layout, PackMode, layout_for, pack, packable_dtype, unpack
from .structure import computed_dtype

_pack_jit = jax.jit(functools.partial(pack, inputs=True), static_argnums=0)
_unpack_jit = jax.jit(unpack, static_argnums=0)

# `pack_on_device` and `unpack_on_device` copy on the host (NumPy) the first this many times
# per layout when the arrays are on a CPU device: a step packs its state once, on its first
# call (later calls get back the packed buffers), and compiling the pack program for that one
# call cost more than the packing (about 0.1 s for 100 leaves on a 2-core machine, a third of
# the extra first-call time of packing the tiny-MLP of benchmarks/bench_zoo.py). Past that,
# the arrays keep coming unpacked, and the compiled program is the faster per call (about
# 220 µs against 440 µs on the host for 200 leaves).
_HOST_CALLS = 2

# Under `pack="auto"` on a TPU, a step of at least this many steps a call takes its state one
# buffer per leaf. A packed buffer carried through the `num_steps` scan has its leaves cut out
# (into the TPU's tiled layouts) and packed again in every step, which costs device time per
# step; one buffer per leaf costs host time per call, shared by the call's steps. On one TPU
# v5e chip, the narrow ResNet50 of the benchmark report with Adam (484 state arrays), µs per
# step, packed against one buffer per leaf (round-robin, medians of 7): 400 vs 1,170 at 2
# steps a call, 399 vs 568 at 4, 357 vs 311 at 8, 357 vs 273 at 16, 367 vs 265 at 32 (on
# another machine of that kind: 367 vs 300 at 10, 389 vs 255 at 100). Both costs grow with
# the number of leaves, so the crossing point depends little on it. On a CPU and a GPU the
# packed buffer stays the faster at 10 steps a call (the report's section 2; where they cross:
# benchmarks/bench_pack_steps.py).
TPU_UNPACKED_STEPS = 8


def _host_device(layout: Layout, arrays: Sequence[Any], kind: int) -> tuple[Any, bool] | None:
    """(device, committed) when `arrays` may be copied on the host instead (see
    `_HOST_CALLS`): all single-device jax.Arrays on one CPU device, in its default memory,
    none a PRNG key array."""
    if layout.host_calls[kind] >= _HOST_CALLS or (kind == 1 and any(layout.weak)):
        return None  # (NumPy has no weakly typed arrays to unpack into)
    device, committed = None, False
    for a in arrays:
        if not isinstance(a, jax.Array) or _jax.is_tracer(a):
            return None
        if not packable_dtype(a.dtype):  # PRNG keys: no NumPy copy
            return None
        sharding = a.sharding
        if not _jax.is_single_device(sharding):
            return None
        d: Any = next(iter(sharding.device_set))
        if d.platform != "cpu" or sharding.memory_kind not in (None, "device"):
            return None
        if device is None:
            device = d
        elif d != device:
            return None
        committed = committed or a.committed
    if device is None:
        return None
    layout.host_calls[kind] += 1
    return device, committed


def _put(arrays: list[np.ndarray], device: Any, committed: bool) -> list[Any]:
    # as `jax.jit` places its outputs: on the arguments' device, committed if one of them is
    return jax.device_put(arrays, device if committed else None)


def pack_on_device(layout: Layout, arrays: Sequence[Any]) -> list[Any]:
    """Pack on the host's behalf: one device call (a copy on the host the first times, see
    `_HOST_CALLS`); the buffers are fresh (never aliases of `arrays`), so they may be
    donated."""
    where = _host_device(layout, arrays, 0)
    if where is None:
        return list(_pack_jit(layout, list(arrays)))
    # copies, as the compiled program's outputs are: never sharing memory with `arrays`
    singles = [np.array(arrays[i]) for i in layout.singles]
    packed = [
        np.concatenate([np.asarray(arrays[i], g.dtype).reshape(-1) for i in g.indices])
        for g in layout.groups
    ]
    return _put(singles + packed, *where)


def unpack_on_device(layout: Layout, buffers: Sequence[Any]) -> list[Any]:
    """Unpack for a rebuild outside a trace: one device call (a copy on the host the first
    times, see `_HOST_CALLS`)."""
    where = _host_device(layout, buffers, 1)
    if where is None:
        return list(_unpack_jit(layout, list(buffers)))
    # copies, as the compiled program's outputs are: the buffers may be donated to a step
    leaves = [np.array(b) for b in buffers[: len(layout.singles)]]
    places = list(layout.singles)
    for g, buf in zip(layout.groups, buffers[len(layout.singles) :], strict=True):
        host = np.asarray(buf)
        for i, off, n, shape in zip(g.indices, g.offsets, g.sizes, g.shapes, strict=True):
            leaves.append(host[off : off + n].reshape(shape).copy())
            places.append(i)
    arrays: list[Any] = [None] * layout.n_leaves
    for i, x in zip(places, _put(leaves, *where), strict=True):
        arrays[i] = x
    return arrays


def mode_for(mode: PackMode, written_back: bool, num_steps: int) -> PackMode:
    """The mode for one state argument of a step of `num_steps` steps a call. Under `"auto"`,
    two kinds of state travel one buffer per leaf:

    - state written back into the caller's objects after each call (Flax NNX mutation
      style): those objects hold one array per leaf, so packing would cost a device call to
      pack their arrays and another to unpack the results on every call (2-3x slower per step
      on the NNX ResNet of the zoo);
    - on a TPU, the state of a step of at least `TPU_UNPACKED_STEPS` steps a call (see
      there)."""
    if mode != "auto":
        return mode
    if written_back:
        return False
    if num_steps >= TPU_UNPACKED_STEPS and jax.default_backend() == "tpu":
        return False
    return mode


def host_layout(arrays: Sequence[Any], placement: Any, mode: PackMode) -> Layout | None:
    """The layout for concrete leaves on the host (slow path)."""
    if not mode:
        return None
    avals = [
        (
            tuple(np.shape(a)),
            computed_dtype(jnp.result_type(a) if not hasattr(a, "dtype") else a.dtype),
        )
        for a in arrays
    ]
    multi = (
        [s is not None for s in placement.shardings]
        if placement is not None
        else [False] * len(arrays)
    )
    return layout_for(avals, multi, mode, [bool(_jax.weak_type(a)) for a in arrays])
