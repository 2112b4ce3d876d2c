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

**Weak types.** The buffers are strongly typed; which leaves are weakly typed (made from
Python numbers: `jnp.asarray(0)`, a `jax.jit` output of `0`) is part of the layout
(`Layout.weak`, in its key), and `unpack` gives those leaves back weakly typed, so the step
sees what `jax.jit` would give it for the same leaves, and a layout differs as `jax.jit`'s
cache key does.

**Compile time.** XLA:CPU compiles every distinct fused kernel on its own (its fusion
emitters take ~5-20 ms a kernel on a 2-core machine) and compiles identical fusions once. With
one buffer per leaf, the update kernels of same-shaped leaves are identical, so a state of a
thousand leaves compiles a handful of kernels. A leaf cut out of a packed buffer with a static
slice carries its offset into every kernel that reads it, which makes each of those kernels
distinct: that cost ~10 ms per packed leaf and grew to 124 s against 3.9 s at 3,000 leaves.
So the program never names an offset inside a fused kernel:

- *unpack*: each leaf is a `gather` from the buffer whose start indices are a small
  non-scalar constant of its own: the leaf cut into equal pieces of whole 32-byte vectors,
  the (pieces, size) result reshaped to the leaf (`_take`); a leaf that cannot be cut so is
  gathered with an unused second window next to it and sliced out. XLA:CPU never fuses
  non-scalar constants into kernels, so the constant is a kernel argument and the kernels of
  same-shaped leaves stay identical;
- *repack*: one concatenate of hundreds of operands is compiled into one basic block of
  copies, and LLVM's instruction scheduling is quadratic in its size; the leaves are
  concatenated in runs (`_concatenate`), then the runs, through an optimization barrier.

What remains costs about 0.6-2 ms of compile time per leaf cut out of a buffer on a 2-core
machine, most of it the unpack's gather per leaf (its tracing and XLA's HLO passes over it;
the kernels are shared), the rest the repack's run kernels, which XLA:CPU compiles one by one
even where identical (docs/performance.md measures both). `_segments` cuts out only the
leaves that something other than an elementwise operation reads (the weights a forward pass
multiplies by) and computes the rest on whole buffers, which names fewer things than one
buffer per leaf does. A state packed outside a step (its first call)
is copied on the host rather than by a program compiled for it (`host`). Neither the
unpack nor the repack is meant to change which computations XLA fuses with which (the
unpack's pieces are whole vectors because smaller ones changed how the kernels reading them
were vectorized, and their last bits): with every leaf cut out and repacked (`_segments`
off, `_entry.SEGMENTS`), the test suite's models compute the same bits as with a buffer per
leaf.
That is not a guarantee: with every leaf packed, the corpus case eqx_stateful compiles
otherwise and ends up to 9e-5 away (Adam amplifying gradients of float noise); and whole-buffer
operations (`_segments`) are simplified otherwise by XLA (`a / b / c` into `a / (b * c)` in
one program, not the other), a few ulps.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from .. import _caches, _jax
from .structure import strongly_typed

PackMode = Literal[False, True, "auto"]

# Under `pack="auto"`, leaves with at most this many elements are packed. Chosen from the
# leaf-size sweep of benchmarks/bench_transport.py (`--sweep`, see docs/performance.md): on a
# 2-core CPU, 48 leaves of each size with Adam, packing took 0.56x the flat time per step at
# 128 elements, 0.59x at 256, 0.84x at 512, and lost from 1,024 on (1.13x, 1.08x at 2,048,
# 1.23x at 4,096, 1.57x at 16,384): past that, copying a leaf's bytes in and out of a packed
# buffer costs more device time than its own buffer costs host time.
AUTO_MAX_ELEMENTS = 512

# Under `pack="auto"`, a dtype group of fewer leaves travels one buffer per leaf: a few buffers
# saved are worth less than packing them (in the leaves sweep of the benchmark report, 10 and
# 30 packed leaves were not faster than one buffer each), and every concatenate of the repack
# then has more than 8 operands (see `_concatenate`).
AUTO_MIN_LEAVES = 32


# The repack's concatenate in runs (see `_concatenate`): XLA:CPU fuses a concatenate of at
# most 8 operands (`kMaxConcatenateArguments` of its fusion pass); a run holds about this many
# bytes of the copies that LLVM expands inline (copies of up to 256 bytes).
_FUSED_RUN = 8
_RUN_BYTES = 2048
_INLINE_BYTES = 256
# ... unless there are at most `_ONE_BLOCK_PARTS` parts of at most `_ONE_BLOCK_BYTES` such
# bytes in all: then one concatenate is one kernel, where runs are a kernel each (XLA:CPU
# compiles them one by one even where identical). Compile time on a 2-core machine, CPU
# seconds, medians of 5 processes taken round-robin: the small transformer of
# benchmarks/bench_zoo.py (2 groups of 53 leaves, 7 KB each) 4.74 s in one concatenate
# against 5.26 s in runs (4.54 s with a buffer per leaf); the narrow ResNet (2 groups of 162
# leaves, 7 KB each) 3.74 s against 3.66 s, so many parts stay in runs.
_ONE_BLOCK_PARTS = 64
_ONE_BLOCK_BYTES = 8192
# Offsets the unpack's gather indices (int32) can hold; a larger buffer is sliced statically.
_MAX_GATHER_OFFSET = 2**31 - 2


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

    __slots__ = ("n_leaves", "singles", "groups", "weak", "key", "host_calls")

    def __init__(
        self,
        n_leaves: int,
        singles: tuple[int, ...],
        groups: tuple[Group, ...],
        key: Any,
        weak: tuple[bool, ...] = (),
    ):
        self.n_leaves = n_leaves
        self.singles = singles
        self.groups = groups
        # Per leaf, whether it is weakly typed (the buffers never are): `unpack` restores it.
        self.weak = weak or (False,) * n_leaves
        self.key = key
        # [packs, unpacks] done on the host (`pack_on_device`, `unpack_on_device`)
        self.host_calls = [0, 0]

    @property
    def n_buffers(self) -> int:
        return len(self.singles) + len(self.groups)

    def __repr__(self) -> str:
        packed = sum(len(g.indices) for g in self.groups)
        return f"Layout({self.n_leaves} leaves -> {self.n_buffers} buffers, {packed} packed)"


_lock = threading.Lock()
_interned: dict[Any, Layout] = {}


def packable_dtype(dtype: Any) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def layout_for(
    avals: Sequence[tuple[tuple[int, ...], Any]],
    multi_device: Sequence[bool],
    mode: PackMode,
    weak: Sequence[bool] | None = None,
) -> Layout | None:
    """The layout for leaves of these (shape, dtype)s, or None when nothing would be packed.

    **Arguments:**

    - `avals`: (shape, dtype) of every array leaf, in order.
    - `multi_device`: per leaf, whether its sharding spans several devices (never packed).
    - `mode`: `True` packs every eligible leaf, `"auto"` only those of at most
      `AUTO_MAX_ELEMENTS` elements, in dtype groups of at least `AUTO_MIN_LEAVES`, `False`
      none.
    - `weak`: per leaf, whether it is weakly typed (None: none is).
    """
    if not mode:
        return None
    limit = None if mode is True else AUTO_MAX_ELEMENTS
    by_dtype: dict[Any, list[int]] = {}
    singles = []
    for i, ((shape, dtype), multi) in enumerate(zip(avals, multi_device, strict=True)):
        size = int(np.prod(shape, dtype=np.int64))
        if multi or not packable_dtype(dtype) or (limit is not None and size > limit):
            singles.append(i)
        else:
            by_dtype.setdefault(np.dtype(dtype), []).append(i)
    # A group of one leaf saves nothing; under "auto", a small group saves too little.
    fewest = 2 if mode is True else AUTO_MIN_LEAVES
    groups = []
    for dtype, indices in by_dtype.items():
        if len(indices) < fewest:
            singles.extend(indices)
        else:
            groups.append((dtype, tuple(indices)))
    if not groups:
        return None
    singles.sort()
    weak_leaves = tuple(bool(w) for w in weak) if weak is not None and any(weak) else ()
    key = (
        tuple((tuple(s), np.dtype(d) if packable_dtype(d) else d) for s, d in avals),
        tuple(singles),
        tuple(groups),
        weak_leaves,
    )
    layout = _interned.get(key)
    if layout is None:
        made = Layout(
            len(avals),
            tuple(singles),
            tuple(Group(d, idx, tuple(tuple(avals[i][0]) for i in idx)) for d, idx in groups),
            key,
            weak_leaves,
        )
        with _lock:
            layout = _interned.setdefault(key, made)
    return layout


def pack(layout: Layout, arrays: Sequence[Any], inputs: bool = False) -> list[Any]:
    """Leaves -> buffers (traceable). `inputs`: the leaves are the program's own inputs (as
    in `pack_on_device`), not computed by it. The buffers are strongly typed, as the host
    copy makes them, whatever the leaves' weak types (`Layout.weak` keeps those)."""
    out = [strongly_typed(arrays[i]) for i in layout.singles]
    for g in layout.groups:
        flat = []
        for i in g.indices:
            x = arrays[i]
            if x.dtype != g.dtype:
                x = jax.lax.convert_element_type(x, g.dtype)
            flat.append(jax.lax.reshape(x, (int(np.prod(x.shape, dtype=np.int64)),)))
        out.append(strongly_typed(_concatenate(flat, inputs)))
    return out


def _concatenate(parts: list[Any], inputs: bool = False) -> Any:
    """`jnp.concatenate(parts)` of 1-D parts, compiled in time linear in the number of parts.

    XLA:CPU compiles a concatenate of more than 8 operands into one kernel that copies each
    operand with a `memcpy`, all in one basic block; LLVM expands small copies inline and its
    instruction scheduling is quadratic in the size of a block (1,000 leaves of 8 floats took
    about a second). So the parts are concatenated in runs of about `_RUN_BYTES` of such
    copies (unless they are few, `_ONE_BLOCK_PARTS`), then the runs, passed through an
    optimization barrier: else XLA merges nested concatenates back into one, or fuses a
    concatenate of at most 8 runs into one kernel of unrolled copy loops (the runs were
    reshaped between 1-D and 2-D before, which XLA fused: 0.1 s more compile time for the
    tiny MLP of benchmarks/bench_zoo.py). Every run keeps
    more than 8 parts: XLA fuses a smaller concatenate with the computations that produce its
    operands, which changes how those compile (and their last bits). Parts that are the
    program's `inputs` (`pack_on_device`) are first concatenated 8 at a time:
    those are fused kernels, which alike groups of 8 share."""
    total = sum(p.shape[0] for p in parts)
    if inputs and len(parts) > _FUSED_RUN:
        parts = [
            _reshaped(jax.lax.concatenate(parts[i : i + _FUSED_RUN], 0))
            for i in range(0, len(parts), _FUSED_RUN)
        ]
    costs = [_inline_cost(p) for p in parts]
    few = len(parts) <= _ONE_BLOCK_PARTS and sum(costs) <= _ONE_BLOCK_BYTES
    if len(parts) < 2 * (_FUSED_RUN + 1) or few:
        return jax.lax.reshape(jax.lax.concatenate(parts, 0), (total,))
    runs: list[list[Any]] = [[]]
    cost = 0
    for p, c in zip(parts, costs, strict=True):
        if len(runs[-1]) > _FUSED_RUN and cost >= _RUN_BYTES:
            runs.append([])
            cost = 0
        runs[-1].append(p)
        cost += c
    if len(runs[-1]) <= _FUSED_RUN:
        last = runs.pop()
        runs[-1].extend(last)
    pieces = [jax.lax.concatenate(run, 0) for run in runs]
    pieces = list(jax.lax.optimization_barrier(pieces))
    return jax.lax.reshape(jax.lax.concatenate(pieces, 0), (total,))


def _inline_cost(part: Any) -> int:
    """The bytes of code a copy of `part` costs in a concatenate's kernel: small copies are
    expanded inline, larger ones are a call."""
    nbytes = part.shape[0] * part.dtype.itemsize
    return nbytes if nbytes <= _INLINE_BYTES else _INLINE_BYTES // 4


def _reshaped(x: Any) -> Any:
    """(n,) -> (n, 1) and (n, 1) -> (n,)."""
    return jax.lax.reshape(x, (x.shape[0],) if x.ndim == 2 else (x.shape[0], 1))


_WINDOW = jax.lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,)
)


def _take(buf: Any, offset: int, n: int, shape: tuple[int, ...], total: int) -> Any:
    """`buf[offset : offset + n].reshape(shape)`, without the offset inside a kernel: a gather
    whose start indices are a constant of several different values (one of a single value, a
    scalar or a splat, would be folded into the kernels reading the leaf; several are kernel
    arguments, so the kernels of same-shaped leaves stay identical).

    The windows are the leaf cut in `k` equal pieces (`_pieces`), and the gather's (k, n / k)
    result is the leaf reshaped. A leaf that cannot be cut so (one smaller than two 32-byte
    vectors, or without such a divisor) is gathered whole with an unused second window next
    to it and sliced out of the (2, n) result: a slice more in every kernel that reads it."""
    if n == 0:
        return jnp.zeros(shape, buf.dtype)
    if total > _MAX_GATHER_OFFSET:
        return jax.lax.reshape(jax.lax.slice(buf, (offset,), (offset + n,)), shape)
    k = _pieces(n, buf.dtype.itemsize)
    if k:
        starts = np.arange(offset, offset + n, n // k, dtype=np.int32).reshape(k, 1)
        pieces = jax.lax.gather(buf, starts, _WINDOW, slice_sizes=(n // k,), mode=_IN_BOUNDS)
        return jax.lax.reshape(pieces, shape)
    other = offset + 1 if offset + n < total else max(offset - 1, 0)
    starts = np.array([[offset], [other]], dtype=np.int32)
    windows = jax.lax.gather(buf, starts, _WINDOW, slice_sizes=(n,), mode=_IN_BOUNDS)
    return jax.lax.reshape(jax.lax.slice(windows, (0, 0), (1, n)), shape)


_IN_BOUNDS = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS
# The most pieces `_take` cuts a leaf into (one start index each).
_MAX_PIECES = 16
_VECTOR_BYTES = 32


def _pieces(n: int, itemsize: int) -> int:
    """The fewest equal pieces, at least 2 and at most `_MAX_PIECES`, that n elements cut into
    with each piece a whole number of 32-byte vectors; 0 if none. Smaller pieces change how
    XLA:CPU vectorizes the kernels that read the leaf (XLA:CPU prefers 256-bit vectors), and
    with it the last bits of what they compute: a (4,) float32 leaf cut in two differed from
    one buffer per leaf after one Adam step."""
    for k in range(2, _MAX_PIECES + 1):
        if n % k == 0 and (n // k * itemsize) % _VECTOR_BYTES == 0:
            return k
    return 0


def unpack(layout: Layout, buffers: Sequence[Any]) -> list[Any]:
    """Buffers -> leaves (traceable), weakly typed where `layout.weak` says."""
    arrays: list[Any] = [None] * layout.n_leaves
    for i, b in zip(layout.singles, buffers, strict=False):
        arrays[i] = b
    for g, buf in zip(layout.groups, buffers[len(layout.singles) :], strict=True):
        for i, off, n, shape in zip(g.indices, g.offsets, g.sizes, g.shapes, strict=True):
            arrays[i] = _take(buf, off, n, shape, g.total)
    return weakened(layout, arrays)


def weakened(layout: Layout, arrays: list[Any]) -> list[Any]:
    """The leaves with the weak types `layout.weak` gives them (traceable)."""
    if any(layout.weak):
        arrays = [
            _jax.weakly_typed(x) if w else x for x, w in zip(arrays, layout.weak, strict=True)
        ]
    return arrays


@_caches.register
def clear() -> None:
    with _lock:
        _interned.clear()
