"""Two JAX processes on this machine (loopback, gloo CPU collectives), 2 CPU devices each: autoflat
on a mesh that spans both equals a `jax.jit` loop in one process on a mesh of the same shape.

The processes run `tests/multihost_worker.py` (its docstring lists the cases) once for the
whole module; while they run, this process computes the single-process references from the
same definitions. Every worker has a deadline, and the moment one of them fails the other is
killed: the failure reports both processes' output, and nothing can hang.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import multihost_worker as worker
import numpy as np
import pytest

WORKER = Path(worker.__file__).resolve()
DEADLINE_S = 300  # for the whole two-process run; it takes well under a minute on 2 cores
HAS_ORBAX = importlib.util.find_spec("orbax.checkpoint") is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(devices_per_process: int) -> dict[str, str]:
    """This environment with each process's own CPU device count (the suite sets 8)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


class WorkerFailure(AssertionError):
    """A worker failed or ran past the deadline; the message holds every worker's output."""


class TwoProcesses:
    """Worker processes started together, waited for with one deadline, and killed together:
    when one fails the others are killed at once, not left waiting in a collective."""

    def __init__(self, directory: Path, cases: list[str], *, num_processes: int = 2) -> None:
        self.directory = directory
        self.cases = cases
        self.num_processes = num_processes
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, extra_args: dict[int, list[str]] | None = None) -> TwoProcesses:
        port = _free_port()
        env = _worker_env(2)
        for i in range(self.num_processes):
            args = [
                sys.executable,
                str(WORKER),
                f"--process-id={i}",
                f"--num-processes={self.num_processes}",
                f"--port={port}",
                f"--out={self.directory}",
                f"--cases={','.join(self.cases)}",
                *(extra_args or {}).get(i, []),
            ]
            with (
                open(self._log(i, "stdout"), "wb") as out,
                open(self._log(i, "stderr"), "wb") as err,
            ):
                self.procs.append(subprocess.Popen(args, stdout=out, stderr=err, env=env))
        return self

    def _log(self, i: int, stream: str) -> Path:
        return self.directory / f"{stream}-{i}.txt"

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def wait(self, timeout: float) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]]:
        """Every process's (arrays, checks); raises `WorkerFailure` (killing the rest) when one
        fails or the deadline passes, and skips when the workers say gloo is missing."""
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            self.kill()
        codes = [p.returncode for p in self.procs]
        if all(c == 77 for c in codes):
            pytest.skip(self._read(0, "stderr").strip().removeprefix("SKIP: "))
        if timed_out or any(c != 0 for c in codes):
            what = f"ran past {timeout:.0f} s" if timed_out else f"exit codes {codes}"
            raise WorkerFailure(f"the worker processes failed ({what}):\n" + self.report())
        out = []
        for i in range(self.num_processes):
            with np.load(self.directory / f"result-{i}.npz") as data:
                arrays = {k: data[k] for k in data.files}
            checks = json.loads((self.directory / f"result-{i}.json").read_text())
            out.append((arrays, checks))
        return out

    def _read(self, i: int, stream: str) -> str:
        try:
            return self._log(i, stream).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def report(self) -> str:
        parts = []
        for i, p in enumerate(self.procs):
            for stream in ("stdout", "stderr"):
                text = self._read(i, stream)[-6000:]
                parts.append(f"--- process {i} (exit code {p.returncode}) {stream} ---\n{text}")
        return "\n".join(parts)


CASES = ["dp", "fsdp", "nnx", "chunks", *(["resume"] if HAS_ORBAX else [])]
COMPARED = [("dp", 1), ("dp", 4), ("fsdp", 1), ("fsdp", 4), ("nnx", 1), ("nnx", 4)]


# The two-process run started once the tests are collected (`start_early`, from conftest.py):
# it runs beside the tests before this module's, on the core that the suite leaves idle.
_early: list[TwoProcesses] = []
_taken: list[TwoProcesses] = []  # (an early run the fixture took: its folder removed at the end)


def start_early() -> None:
    """Start the two-process run of every case now, for the `runs` fixture to take."""
    if worker.gloo_unavailable() is None and jax.device_count() >= worker.MESH_DEVICES:
        _early.append(TwoProcesses(Path(tempfile.mkdtemp(prefix="multihost-")), CASES).start())


def stop_early() -> None:
    """Kill an early run no test took, and remove the folders of early runs."""
    while _early or _taken:
        started = (_early or _taken).pop()
        started.kill()
        shutil.rmtree(started.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two-process run of every case, and the single-process references computed here
    while it runs: (process 0's arrays, its checks, process 1's arrays, references)."""
    reason = worker.gloo_unavailable()
    if reason is not None:
        pytest.skip(reason)
    if jax.device_count() < worker.MESH_DEVICES:
        pytest.skip(f"the single-process reference needs {worker.MESH_DEVICES} devices")
    if _early:
        started = _early.pop()
        _taken.append(started)
    else:
        started = TwoProcesses(tmp_path_factory.mktemp("multihost"), CASES).start()
    try:
        references = {case: worker.reference(case, jax.devices()) for case in ("dp", "fsdp", "nnx")}
    except BaseException:
        started.kill()
        raise
    (arrays, checks), (arrays1, _) = started.wait(DEADLINE_S)
    return arrays, checks, arrays1, references


def _leaves(arrays: dict[str, np.ndarray], prefix: str = "") -> list[np.ndarray]:
    """The state leaves stored under `prefix` (`<prefix>/state/<i>`; the references have none)."""
    head = f"{prefix}/state/" if prefix else "state/"
    n = sum(1 for k in arrays if k.startswith(head))
    return [arrays[f"{head}{i}"] for i in range(n)]


def _assert_matches(arrays, prefix, reference):
    got = _leaves(arrays, prefix)
    want = _leaves(reference)
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, (prefix, i, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{prefix} leaf {i}")
    np.testing.assert_allclose(arrays[f"{prefix}/loss"], reference["loss"], rtol=1e-5, atol=1e-6)


def test_two_processes_of_two_devices_share_one_mesh(runs):
    arrays, checks, arrays1, _ = runs
    assert (checks["process_count"], checks["device_count"], checks["local_device_count"]) == (
        2,
        4,
        2,
    )
    # every result was gathered in full: both processes hold the same global values
    assert arrays.keys() == arrays1.keys()
    for key in arrays:
        np.testing.assert_array_equal(arrays[key], arrays1[key], err_msg=key)


@pytest.mark.parametrize("case,k", COMPARED)
def test_equals_single_process_jit_loop(runs, case, k):
    """Parameters, optimizer state and every step's loss equal a `jax.jit` loop (one step a
    call) in one process on a mesh of the same shape, at num_steps=1 and at num_steps=4 with
    its shorter final chunk."""
    arrays, checks, _, references = runs
    _assert_matches(arrays, f"{case}/k{k}", references[case])
    assert checks[f"{case}/k{k}"]["spans_processes"]


@pytest.mark.parametrize("case,k", COMPARED)
def test_state_keeps_its_shardings_across_processes(runs, case, k):
    _, checks, _, _ = runs
    assert checks[f"{case}/k{k}"]["sharding_changes"] == []


@pytest.mark.parametrize("case,k", [c for c in COMPARED if c[0] != "nnx"])
def test_handles_take_the_fast_path_across_processes(runs, case, k):
    """Every call after the first takes both returned handles with no host flatten, and the
    step compiles at most twice: at num_steps=4, once per chunk length; at 1, once more after
    the first call, as `jax.jit` does, since the step counts that `tx.init` made on one
    device come back as arrays replicated over the mesh."""
    _, checks, _, _ = runs
    c = checks[f"{case}/k{k}"]
    assert c["calls"] == (worker.STEPS if k == 1 else 2)
    assert c["fast_path"] == 2 * (c["calls"] - 1)
    assert c["traces"] <= 2


@pytest.mark.parametrize("case", ["dp", "fsdp", "nnx"])
def test_nothing_spanning_devices_is_packed(runs, case):
    """With `pack=True` (k=4), every state leaf placed on several devices (here: on both
    processes) is its own buffer of the compiled program (`Step.lower(...).args`), never
    packed, while the step counts made on one device are packed; with `pack="auto"` (k=1)
    those few counts are not worth a buffer of their own, and nothing is packed."""
    _, checks, _, _ = runs
    packing = checks[f"{case}/k4"]["packing"]
    assert packing["spread_packed"] == []
    assert packing["buffers"] < packing["leaves"]
    assert checks[f"{case}/k1"]["packing"]["buffers"] == checks[f"{case}/k1"]["packing"]["leaves"]


def test_nnx_callers_objects_are_updated_in_place(runs):
    _, checks, _, _ = runs
    assert checks["nnx/k1"]["optimizer_step"] == worker.STEPS
    assert checks["nnx/k4"]["optimizer_step"] == worker.STEPS


@pytest.mark.skipif(not HAS_ORBAX, reason="orbax-checkpoint is not installed")
def test_orbax_checkpoint_resumes_bit_for_bit(runs):
    """orbax saves the state (`autoflat.unwrap` of the handles: orbax cannot take handles, see
    `test_handles.py`) with each process writing its own shards, restores it with its
    shardings, and the resumed run equals the uninterrupted one bit for bit."""
    arrays, checks, _, references = runs
    resumed, unbroken = _leaves(arrays, "resume/resumed"), _leaves(arrays, "resume/unbroken")
    assert len(resumed) == len(unbroken) > 0
    for i, (a, b) in enumerate(zip(resumed, unbroken, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
    np.testing.assert_array_equal(arrays["resume/resumed/loss"], arrays["resume/unbroken/loss"])
    # the same run as fsdp at num_steps=4, so the same values as there, and as jax.jit's
    for a, b in zip(unbroken, _leaves(arrays, "fsdp/k4"), strict=True):
        np.testing.assert_array_equal(a, b)
    _assert_matches(arrays, "resume/unbroken", references["fsdp"])

    c = checks["resume"]
    assert c["restored_equal"] and c["restored_sharding_changes"] == []
    mesh = worker.mesh_for("fsdp", jax.devices())
    params, opt_state = worker.init_state("fsdp", mesh)
    assert c["restored_types"] == [type(params).__name__, type(opt_state).__name__]  # real ones
    paths = jax.tree_util.tree_flatten_with_path((params, opt_state))[0]
    assert c["handle_paths"] == [jax.tree_util.keystr(k) for k, _ in paths]  # not flat indices
    names = jax.tree_util.tree_flatten_with_path({"params": params, "opt_state": opt_state})[0]
    assert c["saved_names"] == sorted(_dotted(k) for k, _ in names)  # params.w1, ...


def _dotted(path: tuple[Any, ...]) -> str:
    """A key path as orbax names a leaf: `opt_state.inner_state.0.mu.w1`."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def test_chunks_builds_global_arrays_from_each_process_half(runs):
    arrays, checks, _, references = runs
    c = checks["chunks"]
    assert c["differences"] == []
    assert c["chunk_shapes"] == [
        [4, worker.BATCH, worker.FEATURES],
        [2, worker.BATCH, worker.FEATURES],
    ]
    _assert_matches(arrays, "chunks", references["dp"])


def test_a_dead_process_fails_fast_with_both_logs(tmp_path):
    """One process dies right after joining, as a crash would: the other, left waiting for it
    in the first collective, is killed at once, and the failure shows both processes' output."""
    if worker.gloo_unavailable() is not None:
        pytest.skip(worker.gloo_unavailable())
    started = TwoProcesses(tmp_path, ["dp"]).start({1: ["--die-after-init"]})
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        started.wait(timeout=120)
    assert time.monotonic() - t0 < 60  # not the 120 s deadline, nor JAX's own timeouts
    message = str(info.value)
    assert "--- process 1 (exit code 3) stderr ---" in message
    assert "dying after initialize, as asked" in message
    assert "--- process 0 (exit code " in message  # killed (or failed itself), its log shown
    assert all(p.poll() is not None for p in started.procs)
    assert not (tmp_path / "result-0.json").exists()
