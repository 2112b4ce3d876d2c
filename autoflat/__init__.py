"""autoflat: fast JAX training steps, generated from the step you already have.

`@autoflat.step(num_steps=k)` turns an update function into one whose model and optimizer
state cross the `jax.jit` boundary as cached structures plus flat leaf lists, runs k steps per
call in a `lax.scan`, and returns lazy handles that rebuild modules only when used.
`autoflat.show(fn)` returns the generated code that actually runs; `autoflat.chunks(batches, k)`
stacks per-step batches into the chunks such a step takes, placed on device ahead of use.
"""

import importlib.metadata

from ._api import clear_caches as clear_caches
from ._api import profile as profile
from ._api import show as show
from ._api import stats as stats
from ._api import step as step
from ._errors import AutoflatError as AutoflatError
from ._errors import CallError as CallError
from ._errors import ConsumedError as ConsumedError
from ._errors import OptionError as OptionError
from ._errors import ShapeError as ShapeError
from ._errors import SourceError as SourceError
from ._errors import StateError as StateError
from ._feeding.chunks import Chunks as Chunks
from ._feeding.chunks import chunks as chunks
from ._handles.lazy import LazyHandle as LazyHandle
from ._handles.lazy import is_handle as is_handle
from ._handles.lazy import unwrap as unwrap
from ._runtime.diagnostics import AutoflatRecompileWarning as AutoflatRecompileWarning
from ._runtime.diagnostics import Stats as Stats
from ._runtime.profile import Profile as Profile
from ._runtime.stages import Compiled as Compiled
from ._runtime.stages import Lowered as Lowered
from ._runtime.stages import Traced as Traced
from ._step import Step as Step


def _hide_library_frames() -> None:
    """JAX removes registered paths from the tracebacks it shows; hide autoflat's own frames
    there too, so errors point at the user's code."""
    import os

    from ._jax import hide_frames

    hide_frames(os.path.dirname(__file__))


_hide_library_frames()

try:
    __version__ = importlib.metadata.version("autoflat")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a checkout
    __version__ = "0.0.0"

__all__ = [
    "AutoflatError",
    "AutoflatRecompileWarning",
    "CallError",
    "Chunks",
    "Compiled",
    "ConsumedError",
    "LazyHandle",
    "Lowered",
    "OptionError",
    "Profile",
    "ShapeError",
    "SourceError",
    "StateError",
    "Stats",
    "Step",
    "Traced",
    "chunks",
    "clear_caches",
    "is_handle",
    "profile",
    "show",
    "stats",
    "step",
    "unwrap",
]
