"""`autoflat.chunks`: per-step batches stacked into chunks of `num_steps`, placed on device
ahead of use by a background thread.

A step decorated with `num_steps=k` takes its per-step inputs with a leading axis of k.
`chunks` turns any iterable of per-step batches into those inputs. For each chunk it reads k
batches, checks that each has the structure, shapes and dtypes of the first batch, stacks every
leaf along a new leading axis (NumPy leaves straight into one preallocated NumPy buffer, JAX
leaves with `jnp.stack`), and places the chunk on device: `jax.device_put`, with a sharding
whose per-step axis is unsharded; across processes, `jax.make_array_from_process_local_data`.

With `prefetch > 0` all of that runs on a daemon thread that hands finished chunks over through
a queue of `prefetch` places, so the host-to-device copy of the next chunks overlaps the steps
running on the current one. The producer and the consumer never wait without a timeout: each
wait polls an Event (closed, or collected) or the other side's liveness, so a `break`, an
exception, `close()` or garbage collection ends the thread within one poll.
"""

from __future__ import annotations

import math
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ._errors import ShapeError

_POLL_S = 0.05  # how often a blocked producer or consumer checks the other side
_CLOSE_WAIT_S = 10.0  # how long close() waits for a producer stuck in the input's next()

_CHUNK, _END, _ERROR = "chunk", "end", "error"

CHUNK_STRUCTURE = """\
autoflat.chunks: batch {index} has a different tree structure from batch 0: {diff}.

Each chunk stacks every leaf of a batch with the same leaf of the other batches, so every
batch must have the containers and keys of the first. Make the input yield one structure, for
example always the same keys of a dict:

    {{"image": image, "label": label}}   # not sometimes {{"image": image}}
"""

CHUNK_LEAF = """\
autoflat.chunks: batch {index}, leaf {path}: {got}, but batch 0 had {first}.

Every batch must keep the shapes and dtypes of the first: a chunk is one array per leaf, and a
step compiled for one shape compiles again for another. Only the final chunk may have fewer
steps than num_steps. Drop or pad a smaller last batch (`drop_remainder=True` in tf.data,
`drop_last=True` in a PyTorch DataLoader, `len(x) // batch_size` full batches for NumPy), and
cast every batch to one dtype.
"""

CHUNK_LEAF_TYPE = """\
autoflat.chunks: batch {index}, leaf {path} is {what}, which cannot be stacked into an array.

Every leaf of a batch must be an array (NumPy or JAX) or a Python number. Keep other values
(names, file paths, metadata) out of the batches given to chunks.
"""

CHUNK_SHARDING = """\
autoflat.chunks: cannot place a chunk with {sharding}: {reason}.

Pass the sharding of one step's batch as a NamedSharding, for example
`NamedSharding(mesh, P("data"))` to split the batch axis over the mesh axis "data"; chunks
places each chunk with `P(None, "data")`, the per-step axis unsharded.
"""

CHUNK_SHARDING_TREE = """\
autoflat.chunks: sharding= must be one Sharding for every leaf, or a pytree of Shardings that
is a prefix of the batch's structure; {reason}.
"""


def _is_multiprocess() -> bool:
    return jax.process_count() > 1


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
        extra = {
            name: getattr(spec, name)
            for name in ("unreduced", "reduced")
            if getattr(spec, name, None)  # newer JAX only; empty sets are the default
        }
        return NamedSharding(
            sharding.mesh, PartitionSpec(None, *spec, **extra), memory_kind=sharding.memory_kind
        )
    if isinstance(sharding, SingleDeviceSharding) or sharding.is_fully_replicated:
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


# ==========================================================================================
# The producer thread and the iterator
# ==========================================================================================


def _put(q: queue.Queue[Any], stop: threading.Event, item: Any) -> bool:
    """Put `item` once there is room; False if `stop` was set first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _produce(chunks: Iterator[tuple[Any, int]], q: queue.Queue[Any], stop: threading.Event) -> None:
    """The producer thread's body. It holds no reference to the `Chunks` object, so that the
    object can be garbage collected (which sets `stop`) while the thread runs."""
    try:
        for chunk, steps in chunks:
            jax.block_until_ready(chunk)  # on device before it is handed over
            if not _put(q, stop, (_CHUNK, (chunk, steps))):
                return
        _put(q, stop, (_END, None))
    except BaseException as e:  # re-raised by the consumer
        _put(q, stop, (_ERROR, e))


class Chunks(Iterator[Any]):
    """An iterator of stacked chunks of per-step batches; made by `autoflat.chunks`.

    Each chunk has the tree structure of one batch, every leaf with a new leading axis of
    `num_steps` steps (the final chunk: the steps that remain).

    **Attributes:**

    - `num_steps`: steps per chunk, as given.
    - `last_steps`: the number of steps in the chunk most recently returned (0 before the
      first): `num_steps`, or fewer for the final chunk. For a progress bar that counts steps,
      `bar.update(it.last_steps)`.
    - `steps_yielded`: the number of steps in all chunks returned so far.

    `len(it)` is the number of chunks when the input has a `len()` (so `tqdm(it)` shows a
    total), and a `TypeError` otherwise. Use it as a context manager, or call `close()`, to
    stop the producer thread before the input is exhausted; dropping the iterator (a `break`
    out of the loop that made it) stops it too.
    """

    num_steps: int
    last_steps: int
    steps_yielded: int

    def __init__(
        self,
        batches: Iterable[Any],
        num_steps: int,
        *,
        sharding: Any = None,
        prefetch: int = 2,
    ):
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"autoflat.chunks: num_steps must be an int >= 1, got {num_steps!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(
                f"autoflat.chunks: prefetch must be an int >= 0 (0: no thread), got {prefetch!r}"
            )
        self.num_steps = num_steps
        self.prefetch = prefetch
        self.last_steps = 0
        self.steps_yielded = 0
        try:
            self._len: int | None = len(batches)  # type: ignore[arg-type]
        except TypeError:
            self._len = None
        self._done = False
        source = iter(batches)
        multiprocess = _is_multiprocess()
        self._stop = threading.Event()
        gen = _stacked(source, num_steps, sharding, multiprocess, self._stop.is_set)
        self._thread: threading.Thread | None = None
        if prefetch == 0:
            self._gen: Generator[tuple[Any, int], None, None] | None = gen
            return
        self._gen = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._thread = threading.Thread(
            target=_produce,
            args=(gen, self._queue, self._stop),
            name="autoflat.chunks producer",
            daemon=True,
        )
        del gen  # the thread holds the only reference
        self._finalizer = weakref.finalize(self, self._stop.set)
        self._thread.start()

    def __iter__(self) -> Chunks:
        return self

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError(
                "len() of autoflat.chunks needs an input with len(); this input has none "
                "(count steps with `it.last_steps` or `it.steps_yielded` instead)"
            )
        return -(-self._len // self.num_steps)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._thread is None:
            assert self._gen is not None
            try:
                chunk, steps = next(self._gen)
            except BaseException:
                self._done = True
                raise
        else:
            kind, payload = self._get()
            if kind != _CHUNK:
                self.close()
                if kind == _ERROR:
                    try:
                        raise payload  # with the producer's traceback
                    finally:
                        del payload
                raise StopIteration
            chunk, steps = payload
        self.last_steps = steps
        self.steps_yielded += steps
        return chunk

    def _get(self) -> tuple[str, Any]:
        assert self._thread is not None
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    try:  # it may have put its last item just before it ended
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return _ERROR, RuntimeError(
                            "autoflat.chunks: the producer thread ended without a result"
                        )

    def close(self) -> None:
        """Stop producing chunks and wait for the producer thread to end (at most one batch's
        `next()` and one chunk's placement). Chunks already made are dropped; further
        `next()` calls raise `StopIteration`. Calling it again does nothing."""
        self._done = True
        if self._thread is None:
            if self._gen is not None:
                self._gen.close()
                self._gen = None
            return
        self._finalizer()  # sets the stop event, once
        if self._thread is not threading.current_thread():
            self._thread.join(_CLOSE_WAIT_S)
            if self._thread.is_alive():
                warnings.warn(
                    f"autoflat.chunks: the producer thread is still inside the input's next() "
                    f"after {_CLOSE_WAIT_S:g} s; it is a daemon thread and ends when that call "
                    "returns",
                    RuntimeWarning,
                    stacklevel=2,
                )
        while True:  # release the device memory of chunks nobody will take
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"autoflat.Chunks(num_steps={self.num_steps}, prefetch={self.prefetch}, "
            f"steps_yielded={self.steps_yielded})"
        )


Chunks.__module__ = "autoflat"


def chunks(
    batches: Iterable[Any], num_steps: int, *, sharding: Any = None, prefetch: int = 2
) -> Chunks:
    """Stack per-step batches into chunks of `num_steps` steps, placed on device ahead of use.

    Feeds a step decorated with `@autoflat.step(num_steps=k)`: each chunk has the tree
    structure of one batch, every leaf with a new leading axis of k steps, and the final chunk
    has the steps that remain (a step runs a shorter final chunk as that many steps). Only
    that chunk differs in shape, so the step compiles at most twice.

    Leaves that are NumPy arrays (or Python numbers) are copied as they arrive into one NumPy
    buffer per leaf and chunk (an input that reuses its buffers is safe), then transferred
    with one `jax.device_put`; JAX arrays are stacked on their device with `jnp.stack`. With
    `prefetch > 0` a daemon thread reads, stacks and places up to `prefetch` chunks ahead
    (waiting until each is on device), while the training loop runs the current one.

    **Arguments:**

    - `batches`: an iterable of per-step batches, each a pytree of arrays with the structure,
      shapes and dtypes of the first (a list, a generator, a `grain` or `tf.data` NumPy
      iterator, `zip(xs, ys)`).
    - `num_steps`: steps per chunk (the step's `num_steps`).
    - `sharding`: the sharding of one step's batch: a `jax.sharding.Sharding` for every leaf
      (`NamedSharding(mesh, P("data"))` splits the batch axis over "data"), or a pytree of
      them that is a prefix of the batch. Each chunk is placed with the per-step axis
      unsharded (`P(None, "data")`). In a multi-process run (`jax.process_count() > 1`) each
      process's batches are its own slice of the global batch, and each chunk is a global
      array built with `jax.make_array_from_process_local_data`. `None` (the default): the
      default device, or for JAX inputs where they are; in a multi-process run, this
      process's local devices only.
    - `prefetch`: chunks made ahead of use on a background thread (the queue's size; the
      thread works on one more). 0: no thread, each chunk is made when asked for.

    **Returns:**

    A `Chunks` iterator. `len()` is the number of chunks when `batches` has a `len()`, and its
    `last_steps` attribute the number of steps in the chunk just returned, for progress bars.
    Exceptions raised by the input (or while stacking) are raised from the `next()` that
    would have returned their chunk, with their traceback and a note naming the batch.

    **Raises:**

    `autoflat.ShapeError` (a `ValueError`), from `next()`, for a batch whose structure, shapes
    or dtypes differ from the first batch's, naming the batch's index and the leaf's key path;
    `ValueError` for `num_steps < 1` or `prefetch < 0`.

    ```python
    >>> import autoflat, numpy as np
    >>> batches = [{"x": np.full(3, i, np.float32), "y": np.int32(i)} for i in range(5)]
    >>> it = autoflat.chunks(batches, num_steps=2)
    >>> len(it)
    3
    >>> for chunk in it:
    ...     print(chunk["x"].shape, chunk["y"].tolist(), it.last_steps)
    (2, 3) [0, 1] 2
    (2, 3) [2, 3] 2
    (1, 3) [4] 1

    ```
    """
    return Chunks(batches, num_steps, sharding=sharding, prefetch=prefetch)
