"""`autoflat.chunks`: per-step batches stacked into chunks of `num_steps`, placed on device
ahead of use by a background thread.

`chunks` turns any iterable of per-step batches into the per-step inputs of a step decorated
with `num_steps=k`; the `Chunks` iterator it returns hands out the chunks that `_stacking`
stacks and places, with `len()`, `last_steps` and `close()`.

With `prefetch > 0` the reading, stacking and placing run on a daemon thread that hands
finished chunks over through a queue of `prefetch` places, so the host-to-device copy of the
next chunks overlaps the steps running on the current one. The producer and the consumer never
wait without a timeout: each wait polls an Event (closed, or collected) or the other side's
liveness, so a `break`, an exception, `close()` or garbage collection ends the thread within
one poll.
"""

from __future__ import annotations

import queue
import threading
import warnings
import weakref
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import jax

from .stacking import _stacked

_POLL_S = 0.05  # how often a blocked producer or consumer checks the other side
_CLOSE_WAIT_S = 10.0  # how long close() waits for a producer stuck in the input's next()

_CHUNK, _END, _ERROR = "chunk", "end", "error"


def _is_multiprocess() -> bool:
    return jax.process_count() > 1


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
