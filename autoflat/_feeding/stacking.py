"""Stacking per-step batches into chunks for `autoflat.chunks`, and placing each chunk on
device.

A step decorated with `num_steps=k` takes its per-step inputs with a leading axis of k.
`_stacked` turns an iterator of per-step batches into those inputs. For each chunk it reads k
batches, checks that each has the structure, shapes and dtypes of the first batch, stacks every
leaf along a new leading axis (NumPy leaves straight into one preallocated NumPy buffer, JAX
leaves with `jnp.stack`), and places the chunk on device: `jax.device_put`, with a sharding
whose per-step axis is unsharded (`chunk_sharding`); across processes,
`jax.make_array_from_process_local_data`, with the global shape from `global_shape`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from .. import _jax
from .._errors import (
    CHUNK_LEAF,
    CHUNK_LEAF_TYPE,
    CHUNK_SHARDING,
    CHUNK_SHARDING_TREE,
    CHUNK_STRUCTURE,
    ShapeError,
)


def chunk_sharding(sharding: Sharding) -> Sharding:
    """The sharding of a chunk whose every step is placed with `sharding`: the same placement
    of the batch axes, with a new leading per-step axis that is not sharded.

    **Arguments:**

    - `sharding`: the sharding of one step's batch leaf. A `NamedSharding` gets `None`
      prepended to its PartitionSpec; a `SingleDeviceSharding` or any fully replicated sharding
      is the same for arrays of any rank and is returned as it is.

    **Returns:**

    The sharding to place a stacked chunk with.

    **Raises:**

    `TypeError` for a sharding whose spec cannot be extended by an axis (neither a
    `NamedSharding` nor fully replicated).
    """
    if isinstance(sharding, NamedSharding):
        spec = sharding.spec
        extra = _jax.spec_extras(spec)
        return NamedSharding(
            sharding.mesh, PartitionSpec(None, *spec, **extra), memory_kind=sharding.memory_kind
        )
    if _jax.is_single_device(sharding) or sharding.is_fully_replicated:
        return sharding
    raise TypeError(
        CHUNK_SHARDING.format(
            sharding=sharding,
            reason="only a NamedSharding or a fully replicated sharding can gain an unsharded "
            "per-step axis",
        )
    )


def global_shape(
    sharding: Sharding, local_shape: Sequence[int], local_devices: np.ndarray | None = None
) -> tuple[int, ...]:
    """The shape of the global array that `jax.make_array_from_process_local_data` builds from
    this process's `local_shape` data placed with `sharding`.

    Along an axis that is not sharded, every process holds all of it (global = local). Along
    an axis sharded over mesh axes with `n` positions in all, of which this process's devices
    occupy `m`, the process holds m of the n slices: global = local * n / m.

    **Arguments:**

    - `sharding`: the global array's sharding (a `NamedSharding`, or fully replicated).
    - `local_shape`: the shape of this process's data.
    - `local_devices`: a boolean array of the mesh's shape, true where the device belongs to
      this process (by default from `jax.process_index()`); tests pass their own.

    **Returns:**

    The global shape.

    **Raises:**

    `TypeError` for a sharding that is neither a `NamedSharding` nor fully replicated;
    `autoflat.ShapeError` when the local size along a sharded axis does not divide into the
    process's slices.
    """
    if not isinstance(sharding, NamedSharding):
        if sharding.is_fully_replicated:
            return tuple(local_shape)
        raise TypeError(
            CHUNK_SHARDING.format(
                sharding=sharding,
                reason="in a multi-process run, chunks builds global arrays with a NamedSharding",
            )
        )
    mesh = sharding.mesh
    if local_devices is None:
        here = jax.process_index()
        local_devices = np.vectorize(lambda d: d.process_index == here, otypes=[bool])(mesh.devices)
    coords = np.argwhere(local_devices)  # (local devices, mesh axes): their mesh positions
    names = list(mesh.axis_names)
    spec = tuple(sharding.spec)
    out = []
    for dim, size in enumerate(local_shape):
        entry = spec[dim] if dim < len(spec) else None
        if entry is None:
            out.append(size)
            continue
        axes = [names.index(a) for a in ((entry,) if isinstance(entry, str) else entry)]
        total = math.prod(mesh.devices.shape[a] for a in axes)
        mine = len({tuple(c) for c in coords[:, axes].tolist()})
        if size % mine:
            raise ShapeError(
                f"autoflat.chunks: this process's data has {size} entries along axis {dim}, "
                f"which {sharding.spec} splits over {mine} slices on this process's devices; "
                f"make it a multiple of {mine}."
            )
        out.append(size // mine * total)
    return tuple(out)


# ==========================================================================================
# Stacking: batches -> chunks
# ==========================================================================================


def _as_leaf(leaf: Any) -> Any:
    """A JAX or NumPy array as it is; anything else (Python numbers) as a NumPy array."""
    if isinstance(leaf, (jax.Array, np.ndarray)):
        return leaf
    return np.asarray(leaf)


@dataclass
class _Layout:
    """What the first batch fixes for the whole stream: the structure, each leaf's key path,
    shape, dtype and how it is stacked, and the placement of each leaf's chunks."""

    treedef: Any
    paths: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[Any]
    on_device: list[bool]  # stacked with jnp.stack (a JAX input); else into a NumPy buffer
    shardings: list[Sharding] | None  # per leaf, for the chunk (per-step axis unsharded)
    global_tails: list[tuple[int, ...]] | None  # per leaf, global shape after the step axis

    @classmethod
    def of(
        cls, batch: Any, leaves: list[Any], treedef: Any, sharding: Any, multiprocess: bool
    ) -> _Layout:
        keyed, _ = jax.tree_util.tree_flatten_with_path(batch)
        paths = [jax.tree_util.keystr(p) for p, _ in keyed]
        for path, leaf in zip(paths, leaves, strict=True):
            if isinstance(leaf.dtype, np.dtype) and leaf.dtype.kind in "OSU":
                if leaf.ndim == 0:
                    value = leaf.item()
                    what = f"a {type(value).__name__} ({value!r:.60})"
                else:
                    what = f"an array of dtype {leaf.dtype}"
                raise ShapeError(CHUNK_LEAF_TYPE.format(index=0, path=path or "(root)", what=what))
        shardings = None if sharding is None else _leaf_shardings(sharding, batch, len(leaves))
        tails = None
        if shardings is not None and multiprocess:
            tails = [
                global_shape(s, (1, *leaf.shape))[1:]
                for s, leaf in zip(shardings, leaves, strict=True)
            ]
        return cls(
            treedef=treedef,
            paths=paths,
            shapes=[leaf.shape for leaf in leaves],
            dtypes=[leaf.dtype for leaf in leaves],
            # across processes, everything is stacked on the host: the input is local data
            on_device=[isinstance(leaf, jax.Array) and not multiprocess for leaf in leaves],
            shardings=shardings,
            global_tails=tails,
        )

    def check(self, index: int, batch: Any, leaves: list[Any], treedef: Any) -> None:
        """Raise `ShapeError` naming the batch and leaf if `batch` does not fit the layout."""
        if treedef != self.treedef:
            keyed, _ = jax.tree_util.tree_flatten_with_path(batch)
            paths = [jax.tree_util.keystr(p) for p, _ in keyed]
            missing = [p for p in self.paths if p not in set(paths)]
            new = [p for p in paths if p not in set(self.paths)]
            parts = []
            if missing:
                parts.append(f"it lacks leaf {', '.join(missing[:3])}")
            if new:
                parts.append(f"it has a new leaf {', '.join(new[:3])}")
            if not parts:
                parts.append(f"it is {treedef}, batch 0 was {self.treedef}")
            raise ShapeError(CHUNK_STRUCTURE.format(index=index, diff="; ".join(parts)))
        for i, leaf in enumerate(leaves):
            if leaf.shape != self.shapes[i] or leaf.dtype != self.dtypes[i]:
                raise ShapeError(
                    CHUNK_LEAF.format(
                        index=index,
                        path=self.paths[i] or "(root)",
                        got=f"shape {leaf.shape} dtype {leaf.dtype}",
                        first=f"shape {self.shapes[i]} dtype {self.dtypes[i]}",
                    )
                )

    def start(self, num_steps: int) -> list[Any]:
        """Empty per-leaf accumulators for one chunk: a NumPy buffer of `num_steps` entries,
        or a list of JAX arrays."""
        return [
            [] if dev else np.empty((num_steps, *shape), dtype)
            for dev, shape, dtype in zip(self.on_device, self.shapes, self.dtypes, strict=True)
        ]

    def place(self, parts: list[Any], steps: int) -> Any:
        """The chunk of `steps` steps from filled accumulators, on device, as a batch's tree."""
        stacked = [jnp.stack(p) if isinstance(p, list) else p[:steps] for p in parts]
        if self.shardings is None:
            leaves = jax.device_put(stacked)
        elif self.global_tails is None:
            leaves = jax.device_put(stacked, self.shardings)
        else:
            leaves = [
                jax.make_array_from_process_local_data(s, np.asarray(x), (steps, *tail))
                for x, s, tail in zip(stacked, self.shardings, self.global_tails, strict=True)
            ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _leaf_shardings(sharding: Any, batch: Any, n_leaves: int) -> list[Sharding]:
    """One chunk sharding per leaf of `batch`, from a Sharding or a prefix tree of them."""
    if isinstance(sharding, Sharding):
        per_leaf = [sharding] * n_leaves
    else:
        try:
            spread = jax.tree_util.tree_map(
                lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), sharding, batch
            )
        except (ValueError, TypeError) as e:
            raise ValueError(CHUNK_SHARDING_TREE.format(reason=str(e).splitlines()[0])) from e
        per_leaf = jax.tree_util.tree_leaves(spread)
        bad = [s for s in per_leaf if not isinstance(s, Sharding)]
        if bad or len(per_leaf) != n_leaves:
            reason = f"found {type(bad[0]).__name__}" if bad else "it does not cover every leaf"
            raise ValueError(CHUNK_SHARDING_TREE.format(reason=reason))
    converted: dict[int, Sharding] = {}
    return [converted.setdefault(id(s), chunk_sharding(s)) for s in per_leaf]


def _stacked(
    source: Iterator[Any],
    num_steps: int,
    sharding: Any,
    multiprocess: bool,
    stopped: Callable[[], bool],
) -> Generator[tuple[Any, int], None, None]:
    """(chunk, steps) for consecutive runs of `num_steps` batches of `source`, stacked and
    placed; the last run may be shorter. Stops early, between batches, once `stopped()`."""
    layout: _Layout | None = None
    index = 0  # of the next batch in the stream
    while True:
        parts: list[Any] = []
        steps = 0
        while steps < num_steps and not stopped():
            try:
                batch = next(source)
            except StopIteration:
                break
            except Exception as e:
                e.add_note(f"(raised by the input of autoflat.chunks, reading batch {index})")
                raise
            leaves, treedef = jax.tree_util.tree_flatten(batch)
            leaves = [_as_leaf(x) for x in leaves]
            if layout is None:
                layout = _Layout.of(batch, leaves, treedef, sharding, multiprocess)
            else:
                layout.check(index, batch, leaves, treedef)
            if not parts:
                parts = layout.start(num_steps)
            for part, leaf in zip(parts, leaves, strict=True):
                if isinstance(part, list):
                    part.append(leaf)
                else:
                    part[steps] = leaf
            steps += 1
            index += 1
        if steps == 0 or stopped():
            return
        assert layout is not None
        try:
            chunk = layout.place(parts, steps)
        except Exception as e:
            e.add_note(
                f"(raised by autoflat.chunks placing the chunk of batches {index - steps} to "
                f"{index - 1})"
            )
            raise
        yield chunk, steps
        if steps < num_steps:
            return
