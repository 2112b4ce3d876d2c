"""How state leaves travel across the `jax.jit` boundary: one buffer per leaf, or packed.

Every output buffer of a compiled call costs host time (on CPU, microseconds each), so a state
of hundreds of small leaves pays for hundreds of buffers per call. A `Layout` groups the small
array leaves of one state argument by dtype into a few contiguous 1-D buffers; large leaves
(weights) keep their own buffers, since slicing them out of a packed buffer and concatenating
them back are real copies. Inside the compiled function the buffers are sliced and reshaped
back into leaves, and the updated leaves are written back into buffers of the same layout
(donated, so XLA can update them in place where it can).

Leaves whose sharding spans several devices are never packed: a packed buffer has one
sharding. PRNG key arrays (extended dtypes) are never packed either.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _caches

PackMode = Literal[False, True, "auto"]

# Under `pack="auto"`, leaves with at most this many elements are packed. Chosen from the
# leaf-size sweep of benchmarks/bench_transport.py (`--sweep`, see docs/performance.md): on a
# 2-core CPU, 48 leaves of each size with Adam, packing took 0.56x the flat time per step at
# 128 elements, 0.59x at 256, 0.84x at 512, and lost from 1,024 on (1.13x, 1.08x at 2,048,
# 1.23x at 4,096, 1.57x at 16,384): past that, copying a leaf's bytes in and out of a packed
# buffer costs more device time than its own buffer costs host time.
AUTO_MAX_ELEMENTS = 512


class Group:
    """Leaves of one dtype packed into one 1-D buffer."""

    __slots__ = ("dtype", "indices", "offsets", "sizes", "shapes", "total")

    def __init__(self, dtype: Any, indices: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]):
        self.dtype = dtype
        self.indices = indices
        self.shapes = shapes
        self.sizes = tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)
        offsets = []
        total = 0
        for n in self.sizes:
            offsets.append(total)
            total += n
        self.offsets = tuple(offsets)
        self.total = total


class Layout:
    """The transport of one state's array leaves: `singles` travel alone, `groups` packed.

    Buffers are ordered singles first, then one per group. Interned: compare with `is`.
    """

    __slots__ = ("n_leaves", "singles", "groups", "key")

    def __init__(
        self, n_leaves: int, singles: tuple[int, ...], groups: tuple[Group, ...], key: Any
    ):
        self.n_leaves = n_leaves
        self.singles = singles
        self.groups = groups
        self.key = key

    @property
    def n_buffers(self) -> int:
        return len(self.singles) + len(self.groups)

    def __repr__(self) -> str:
        packed = sum(len(g.indices) for g in self.groups)
        return f"Layout({self.n_leaves} leaves -> {self.n_buffers} buffers, {packed} packed)"


_lock = threading.Lock()
_interned: dict[Any, Layout] = {}


def _packable_dtype(dtype: Any) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def layout_for(
    avals: Sequence[tuple[tuple[int, ...], Any]],
    multi_device: Sequence[bool],
    mode: PackMode,
) -> Layout | None:
    """The layout for leaves of these (shape, dtype)s, or None when nothing would be packed.

    **Arguments:**

    - `avals`: (shape, dtype) of every array leaf, in order.
    - `multi_device`: per leaf, whether its sharding spans several devices (never packed).
    - `mode`: `True` packs every eligible leaf, `"auto"` only those of at most
      `AUTO_MAX_ELEMENTS` elements, `False` none.
    """
    if not mode:
        return None
    limit = None if mode is True else AUTO_MAX_ELEMENTS
    by_dtype: dict[Any, list[int]] = {}
    singles = []
    for i, ((shape, dtype), multi) in enumerate(zip(avals, multi_device, strict=True)):
        size = int(np.prod(shape, dtype=np.int64))
        if multi or not _packable_dtype(dtype) or (limit is not None and size > limit):
            singles.append(i)
        else:
            by_dtype.setdefault(np.dtype(dtype), []).append(i)
    # A group of one leaf saves nothing.
    groups = []
    for dtype, indices in by_dtype.items():
        if len(indices) < 2:
            singles.extend(indices)
        else:
            groups.append((dtype, tuple(indices)))
    if not groups:
        return None
    singles.sort()
    key = (
        tuple((tuple(s), np.dtype(d) if _packable_dtype(d) else d) for s, d in avals),
        tuple(singles),
        tuple(groups),
    )
    layout = _interned.get(key)
    if layout is None:
        made = Layout(
            len(avals),
            tuple(singles),
            tuple(Group(d, idx, tuple(tuple(avals[i][0]) for i in idx)) for d, idx in groups),
            key,
        )
        with _lock:
            layout = _interned.setdefault(key, made)
    return layout


def pack(layout: Layout, arrays: Sequence[Any]) -> list[Any]:
    """Leaves -> buffers (traceable)."""
    out = [arrays[i] for i in layout.singles]
    for g in layout.groups:
        out.append(jnp.concatenate([jnp.ravel(arrays[i]).astype(g.dtype) for i in g.indices]))
    return out


def unpack(layout: Layout, buffers: Sequence[Any]) -> list[Any]:
    """Buffers -> leaves (traceable)."""
    arrays: list[Any] = [None] * layout.n_leaves
    for i, b in zip(layout.singles, buffers, strict=False):
        arrays[i] = b
    for g, buf in zip(layout.groups, buffers[len(layout.singles) :], strict=True):
        for i, off, n, shape in zip(g.indices, g.offsets, g.sizes, g.shapes, strict=True):
            arrays[i] = jax.lax.slice(buf, (off,), (off + n,)).reshape(shape)
    return arrays


_pack_jit = jax.jit(pack, static_argnums=0)
_unpack_jit = jax.jit(unpack, static_argnums=0)


def pack_on_device(layout: Layout, arrays: Sequence[Any]) -> list[Any]:
    """Pack on the host's behalf: one device call; the buffers are fresh (never aliases of
    `arrays`), so they may be donated."""
    return list(_pack_jit(layout, list(arrays)))


def unpack_on_device(layout: Layout, buffers: Sequence[Any]) -> list[Any]:
    """Unpack for a rebuild outside a trace: one device call."""
    return list(_unpack_jit(layout, list(buffers)))


def host_layout(arrays: Sequence[Any], placement: Any, mode: PackMode) -> Layout | None:
    """The layout for concrete leaves on the host (slow path)."""
    if not mode:
        return None
    avals = [
        (tuple(np.shape(a)), jnp.result_type(a) if not hasattr(a, "dtype") else a.dtype)
        for a in arrays
    ]
    multi = (
        [s is not None for s in placement.shardings]
        if placement is not None
        else [False] * len(arrays)
    )
    return layout_for(avals, multi, mode)


@_caches.register
def clear() -> None:
    with _lock:
        _interned.clear()
