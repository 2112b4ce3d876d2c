"""The examples run top to bottom (in their fast smoke mode) and print what they claim.

Each example runs in its own subprocess, as a user would run it (`smoke_runs`). The selected
ones start in the background as soon as the session has collected the tests (`conftest.py`),
one at a time beside the suite, longest first; two at a time once a test here waits on them.
"""

from __future__ import annotations

import importlib.util

import pytest
import smoke_runs


def example(script: str):
    """Mark a test as checking the smoke run of `script`."""

    def mark(fn):
        fn.script = script
        return fn

    return mark


@pytest.fixture(scope="module")
def smoke(request):
    """The smoke runs of the examples that the selected tests check (started by the
    session's collection, or here where it did not start them)."""
    runs = smoke_runs.start(smoke_runs.scripts_of(request.session.items))
    yield runs
    smoke_runs.stop()


def _output(smoke, script: str) -> str:
    missing = smoke_runs.missing(script)
    if missing:
        pytest.skip(f"{script} needs {', '.join(missing)}")
    return smoke.wait(script)


@example("train_digits.py")
def test_flagship_digits_smoke(smoke):
    out = _output(smoke, "train_digits.py")
    assert "# autoflat: generated from `update` at train_digits.py:" in out
    assert "test accuracy:" in out
    assert "| autoflat num_steps=10 |" in out
    assert "2 host flattens" in out
    assert "autoflat.profile: `update` (train_digits.py:" in out and "host share" in out


@example("pax_resnet50.py")
def test_pax_resnet50_smoke(smoke):
    out = _output(smoke, "pax_resnet50.py")
    assert "ResNet, [1, 1, 1, 1] blocks, width 2:" in out
    # handles on the fast path; one compile (no weak-typed leaf to retrace on)
    assert (
        "autoflat: 2 calls, 2 state arguments on the fast path, 2 host flattens, 1 compiles" in out
    )
    # the role line's wording after "scanned (per-step" belongs to autoflat's code generator
    assert "# model: state (returned)" in out and "# batch: scanned (per-step" in out
    for row in ("| eqx.filter_jit |", "| autoflat num_steps=1 |", "| autoflat num_steps=10 |"):
        assert row in out
    assert "tree_flatten + tree_unflatten of (model, opt_state)" in out
    assert "tree_flatten of the two autoflat handles (no rebuild)" in out


@example("equinox_batchnorm.py")
def test_equinox_batchnorm_smoke(smoke):
    out = _output(smoke, "equinox_batchnorm.py")
    assert "# state: state (returned)" in out and "# x: scanned (per-step" in out
    assert (
        "autoflat: 2 calls, 3 state arguments on the fast path, 3 host flattens, 1 compiles" in out
    )
    assert "running statistics in the state: 6 arrays" in out
    assert "test accuracy (inference mode):" in out


@example("nnx_metrics.py")
def test_nnx_metrics_smoke(smoke):
    out = _output(smoke, "nnx_metrics.py")
    assert "epoch  1 | train loss" in out and "| test loss" in out
    # the caller's own optimizer saw every step of both calls
    assert "optimizer steps: 20 (the caller's own optimizer object)" in out
    assert "autoflat train_step: 2 calls, 1 compiles" in out
    assert "autoflat eval_step: 1 calls, 1 compiles" in out
    assert "# metrics: state (a flax.MultiMetric mutated in place" in out
    assert "final test accuracy:" in out


@example("data_parallel.py")
def test_data_parallel_smoke(smoke):
    out = _output(smoke, "data_parallel.py")
    assert "mesh: {'data': 8} over 8 cpu devices" in out
    assert "chunks: (10, 64, 64) sharded P(None, 'data'), per device (10, 8, 64)" in out
    assert "state shardings after training: unchanged" in out
    assert "on 8 devices" in out
    assert "test accuracy:" in out


@example("checkpointing.py")
def test_checkpointing_smoke(smoke):
    out = _output(smoke, "checkpointing.py")
    assert "restored into fresh objects; resuming at call 3" in out
    assert "resumed parameters equal the uninterrupted run's bit for bit: True" in out
    assert "per-step losses equal bit for bit: True" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert smoke.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
