import os

# Eight CPU devices for the sharding tests, and XLA:CPU's backend (LLVM) optimisations off: the
# tests compare programs compiled alike, which then compile about a quarter faster (test_corpus
# and test_nnx side by side, round-robin: 85 s against 117 s). Set before JAX starts a backend.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402  (strict dtype promotion is off: optax itself promotes int32 counts with Python floats)
import smoke_runs  # noqa: E402

# The suite compiles many identical programs (the same small models and reference loops in
# many tests): an XLA compilation cache for this run alone compiles each once. A fresh folder
# each run, removed at exit, so no run reuses another's compiles; unless the caller chose one.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _cache = tempfile.mkdtemp(prefix="autoflat-tests-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_report_header(config):
    # `AUTOFLAT_PACK=off|on pytest` runs the whole suite with that transport as the default of
    # autoflat.step (the `tests_pack` nox sessions run `off` and `on`); autoflat reads it itself.
    return f"autoflat transport (AUTOFLAT_PACK): {os.environ.get('AUTOFLAT_PACK', 'auto')}"


def pytest_collection_finish(session):
    # The examples' smoke runs that the selected tests check, started now in the background
    # (tests/smoke_runs.py): on two cores they take the core that the suite leaves idle, niced.
    # So is the two-process run of tests/test_multihost.py, when its tests are selected.
    if not session.config.option.collectonly:
        smoke_runs.start(smoke_runs.scripts_of(session.items))
        for module in _multihost(session):
            module.start_early()


def pytest_sessionfinish(session):
    smoke_runs.stop()
    for module in _multihost(session):
        module.stop_early()


def _multihost(session):
    modules = {getattr(item, "module", None) for item in session.items}
    return {m for m in modules if m is not None and m.__name__.endswith("test_multihost")}
