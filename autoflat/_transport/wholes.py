"""Segments of packed buffers, computed when needed: the values `_segments` evaluates a step with.

A `Whole` is a 1-D array cut into segments (the leaves of a packed buffer, `Layout` order),
not computed until something needs it: a `Buffer` (a packed input), `Gathered` leaves computed
one by one (concatenated when needed), or an `Op`, an elementwise primitive applied to whole
operands. A `View` is one segment of a whole, a leaf not cut out yet. `leaf()` cuts a segment
out, computed from the segments it depends on; `whole()` computes the whole array. `pack`
makes a state's buffers from leaves that may be views: a run of consecutive segments of one
whole computation is a slice of it, not its leaves concatenated again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _jax
from . import layout as _transport
from .structure import strongly_typed

# A whole computation is used for a packed output only when the output takes at least this
# share of its elements; else its segments are computed leaf by leaf.
_MIN_SHARE = 0.5


class Whole:
    """A 1-D array cut into segments (`shapes`, at `offsets`), computed when needed; valid
    on the segments `lo` to `hi` (its `value`, once computed, holds those only)."""

    __slots__ = ("shapes", "offsets", "total", "dtype", "lo", "hi", "value", "cut")

    def __init__(self, shapes: Any, offsets: Any, total: int, dtype: Any, lo: int, hi: int):
        self.shapes = shapes
        self.offsets = offsets
        self.total = total
        self.dtype = dtype
        self.lo = lo
        self.hi = hi
        self.value: Any = None
        self.cut: dict[int, Any] = {}  # segment -> that leaf, computed alone

    def end(self, t: int) -> int:
        """The element offset where segment t ends."""
        return self.offsets[t + 1] if t + 1 < len(self.offsets) else self.total

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Elements of segments lo to hi, relative to `value`."""
        base = self.offsets[self.lo]
        return self.offsets[lo] - base, self.end(hi - 1) - base

    def leaf(self, t: int) -> Any:
        """Segment t alone. (The operations it depends on are computed first, in order, not
        by recursion: a step's chain of elementwise operations can be thousands long.)"""
        todo = [(self, t)]
        while todo:
            w, s = todo[-1]
            if s in w.cut:
                todo.pop()
                continue
            missing = [(d, u) for d, u in w._leaf_operands(s) if u not in d.cut]
            if missing:
                todo.extend(missing)
            else:
                w.cut[s] = w._leaf(s)
                todo.pop()
        return self.cut[t]

    def whole(self) -> Any:
        """The segments lo to hi, as one 1-D array (computed as `leaf`, without recursion)."""
        todo: list[Whole] = [self]
        while todo:
            w = todo[-1]
            if w.value is not None:
                todo.pop()
                continue
            missing = [d for d in w._whole_operands() if d.value is None]
            if missing:
                todo.extend(missing)
            else:
                w.value = w._whole()
                todo.pop()
        return self.value

    def _leaf_operands(self, t: int) -> list[tuple[Whole, int]]:
        """The (whole, segment) pairs `_leaf(t)` reads."""
        return []

    def _whole_operands(self) -> list[Whole]:
        """The wholes `_whole` reads."""
        return []

    def _leaf(self, t: int) -> Any:
        raise NotImplementedError

    def _whole(self) -> Any:
        raise NotImplementedError


class Buffer(Whole):
    """A packed input buffer."""

    __slots__ = ("group", "buffer")

    def __init__(self, group: _transport.Group, buffer: Any):
        n = len(group.shapes)
        super().__init__(group.shapes, group.offsets, group.total, group.dtype, 0, n)
        self.group = group
        self.buffer = buffer

    def _leaf(self, t: int) -> Any:
        n = self.end(t) - self.offsets[t]
        return _transport._take(self.buffer, self.offsets[t], n, self.shapes[t], self.total)

    def _whole(self) -> Any:
        return self.buffer


class Gathered(Whole):
    """Leaves computed one by one (the per-leaf operand of a whole operation), concatenated;
    a segment no leaf was given for is zeros (its result is never read)."""

    __slots__ = ("parts",)

    def __init__(self, like: Whole, lo: int, hi: int):
        super().__init__(like.shapes, like.offsets, like.total, None, lo, hi)
        self.parts: dict[int, Any] = {}

    def _leaf(self, t: int) -> Any:
        return self.parts[t]

    def _whole(self) -> Any:
        parts = []
        t = self.lo
        while t < self.hi:
            if t in self.parts:
                parts.append(jax.lax.reshape(self.parts[t], (self.end(t) - self.offsets[t],)))
                t += 1
                continue
            start = t
            while t < self.hi and t not in self.parts:
                t += 1
            parts.append(jax.numpy.zeros((self.end(t - 1) - self.offsets[start],), self.dtype))
        if len(parts) == 1:
            return parts[0]
        return _transport._concatenate(parts)


class Op(Whole):
    """An elementwise primitive applied to whole operands: (`Whole`, segment shift) pairs,
    `Gathered` leaves (shift 0), or scalars shared by every segment."""

    __slots__ = ("prim", "params", "operands")

    def __init__(self, prim: Any, params: dict[str, Any], operands: list[Any], like: Whole,
                 lo: int, hi: int, dtype: Any):  # fmt: skip
        super().__init__(like.shapes, like.offsets, like.total, dtype, lo, hi)
        self.prim = prim
        self.params = params
        self.operands = operands

    def _leaf_operands(self, t: int) -> list[tuple[Whole, int]]:
        out: list[tuple[Whole, int]] = []
        for x in self.operands:
            if type(x) is tuple:
                out.append((x[0], t + x[1]))
            elif isinstance(x, Whole):
                out.append((x, t))
        return out

    def _whole_operands(self) -> list[Whole]:
        return [w for w, _ in self._leaf_operands(0)]

    def _leaf(self, t: int) -> Any:
        args = [
            x[0].leaf(t + x[1]) if type(x) is tuple else x.leaf(t) if isinstance(x, Whole) else x
            for x in self.operands
        ]
        return _jax.apply(self.prim, args, self.params)

    def _whole(self) -> Any:
        args = []
        for x in self.operands:
            if type(x) is tuple:
                w, shift = x
                a, b = w.span(self.lo + shift, self.hi + shift)
                value = w.whole()
                args.append(value if (a, b) == (0, value.shape[0]) else value[a:b])
            elif isinstance(x, Whole):
                args.append(x.whole())
            else:
                args.append(x)
        return _jax.apply(self.prim, args, self.params)


class View:
    """Leaf `t` of a `Whole`, not cut out yet."""

    __slots__ = ("whole", "t")

    def __init__(self, whole: Whole, t: int):
        self.whole = whole
        self.t = t

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.whole.shapes[self.t])

    @property
    def dtype(self) -> Any:
        return self.whole.dtype

    def leaf(self) -> Any:
        return self.whole.leaf(self.t)


def leaf(x: Any) -> Any:
    """A value as an array (a view cut out)."""
    return x.leaf() if type(x) is View else x


def views(layout: _transport.Layout, buffers: Sequence[Any]) -> list[Any]:
    """A packed state's leaves: its single buffers, and views of its packed buffers."""
    arrays: list[Any] = [None] * layout.n_leaves
    for i, b in zip(layout.singles, buffers, strict=False):
        arrays[i] = b
    for g, buf in zip(layout.groups, buffers[len(layout.singles) :], strict=True):
        whole = Buffer(g, buf)
        for t, i in enumerate(g.indices):
            arrays[i] = View(whole, t)
    return arrays


def pack(layout: _transport.Layout, values: Sequence[Any]) -> list[Any]:
    """`_transport.pack` of values that may be views (see `pack_group`): strongly typed
    buffers, as `_transport.pack` makes them."""
    out = [strongly_typed(leaf(values[i])) for i in layout.singles]
    out.extend(pack_group(g, [values[i] for i in g.indices]) for g in layout.groups)
    return out


def pack_group(g: _transport.Group, items: list[Any]) -> Any:
    """The buffer of group `g` from its leaves, which may be views: a run of consecutive
    segments of one whole computation is a slice of it."""
    runs = _runs(items)
    used: dict[int, int] = {}
    for start, stop in runs:
        w, t = items[start].whole, items[start].t
        a, b = w.span(t, t + stop - start)
        used[id(w)] = used.get(id(w), 0) + b - a
    parts: list[Any] = []
    whole_parts = 0
    k = 0
    for start, stop in runs + [(len(items), len(items))]:
        parts.extend(_flat(leaf(x), g.dtype) for x in items[k:start])
        k = stop
        if start == stop:
            continue
        w, t = items[start].whole, items[start].t
        a, b = w.span(w.lo, w.hi)
        if used[id(w)] < _MIN_SHARE * (b - a):
            parts.extend(_flat(leaf(x), g.dtype) for x in items[start:stop])
            continue
        a, b = w.span(t, t + stop - start)
        value = w.whole()
        part = value if (a, b) == (0, value.shape[0]) else value[a:b]
        if part.dtype != g.dtype:
            part = jax.lax.convert_element_type(part, g.dtype)
        parts.append(part)
        whole_parts += 1
    if not whole_parts:
        return strongly_typed(_transport._concatenate(parts))
    if len(parts) == 1:
        return strongly_typed(parts[0])
    return strongly_typed(jax.lax.concatenate(parts, 0))


def _flat(x: Any, dtype: Any) -> Any:
    if x.dtype != dtype:
        x = jax.lax.convert_element_type(x, dtype)
    return jax.lax.reshape(x, (int(np.prod(x.shape, dtype=np.int64)),))


def _runs(items: list[Any]) -> list[tuple[int, int]]:
    """(start, stop) of the runs of views of consecutive segments of one whole."""
    runs = []
    i = 0
    while i < len(items):
        x = items[i]
        if type(x) is not View:
            i += 1
            continue
        j = i + 1
        while (
            j < len(items)
            and type(items[j]) is View
            and items[j].whole is x.whole
            and items[j].t == x.t + j - i
        ):
            j += 1
        runs.append((i, j))
        i = j
    return runs
