"""The examples' smoke runs that tests/test_examples.py checks, started in the background.

Each example runs in its own subprocess, as a user would run it. `tests/conftest.py` starts
the runs the selected tests need as soon as the session has collected them, one at a time,
longest first: their time is mostly single-threaded XLA compilation, as is the suite's own, so
on two cores one run beside the suite takes the other core. A run started so is niced
(`NICE`): where no core is idle it yields to the suite instead of slowing it. Once a test
waits on them, a second run goes at a time (`wait`), at the usual priority.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# script -> (modules it needs, extra arguments); in order of start (longest first)
SCRIPTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "pax_resnet50.py": (("equinox", "sklearn", "tqdm"), ()),
    "train_digits.py": (("sklearn", "tqdm"), ()),
    "equinox_batchnorm.py": (("equinox", "sklearn", "tqdm"), ()),
    "nnx_metrics.py": (("flax", "sklearn", "tqdm"), ()),
    "data_parallel.py": (("sklearn", "tqdm"), ()),
    "checkpointing.py": (("sklearn", "tqdm"), ()),
}
PLOT = "checkpointing.py"  # one example also writes its plot, where matplotlib is installed
TIMEOUT_S = 600  # for each run
NICE = 10  # the niceness of the runs started before a test waits on them


def missing(script: str) -> list[str]:
    return [m for m in SCRIPTS[script][0] if importlib.util.find_spec(m) is None]


class Runs:
    """The smoke runs of some examples: script -> Future of its stdout."""

    def __init__(self, scripts: set[str]) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="autoflat-tests-examples-"))
        self.plot = self.directory / "loss.png"
        self.futures: dict[str, Future[str]] = {}
        self._queue: list[tuple[str, list[str]]] = []
        self._procs: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._background = True  # no test waits on the runs yet
        self._workers = 0
        for script in SCRIPTS:  # in SCRIPTS' order: longest first
            if script in scripts and not missing(script):
                args = ["--smoke"]
                if script == PLOT and importlib.util.find_spec("matplotlib") is not None:
                    args += ["--plot", str(self.plot)]
                self.futures[script] = Future()
                self._queue.append((script, args))

    def add_worker(self) -> None:
        """One more run at a time (a thread that takes the next script until none is left)."""
        with self._lock:
            if not self._queue or self._stopped:
                return
            self._workers += 1
        threading.Thread(target=self._work, name="examples-smoke", daemon=True).start()

    def wait(self, script: str) -> str:
        """The stdout of `script`'s run; two runs at a time from the first wait on, and the
        runs started from then on at the usual priority."""
        if self._background:
            with self._lock:
                self._background = False
                procs = list(self._procs)
            for proc in procs:  # where allowed (lowering a niceness may need privileges)
                _renice(proc, 0)
        if self._workers < 2:
            self.add_worker()
        return self.futures[script].result()

    def stop(self) -> None:
        """Start no more runs, end those still running, and remove the plot's folder."""
        with self._lock:
            self._stopped = True
            self._queue.clear()
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for future in self.futures.values():
            future.cancel()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._stopped:
                    return
                script, args = self._queue.pop(0)
            future = self.futures[script]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._run(script, args))
            except BaseException as e:  # the test that waits on it raises it
                future.set_exception(e)

    def _run(self, script: str, args: list[str]) -> str:
        env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
        with self._lock:
            if self._stopped:
                raise RuntimeError("the session ended before this example ran")
            proc = subprocess.Popen(
                [sys.executable, str(EXAMPLES / script), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            self._procs.append(proc)
            if self._background:
                _renice(proc, NICE)
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(
                f"{script} ran past {TIMEOUT_S} s:\n" + stdout[-3000:] + stderr[-3000:]
            ) from None
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        return stdout


def _renice(proc: subprocess.Popen[str], niceness: int) -> None:
    """Set the niceness of every thread of `proc` (Linux's is per thread), where allowed."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
    except OSError:
        tids = [proc.pid]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:
            pass


_runs: Runs | None = None


def scripts_of(items: list[Any]) -> set[str]:
    """The examples whose smoke runs the tests `items` check (`@example(script)`)."""
    return {s for item in items if (s := getattr(getattr(item, "function", None), "script", None))}


def start(scripts: set[str]) -> Runs | None:
    """Start the smoke runs of `scripts` in the background, one at a time (once a session)."""
    global _runs
    if _runs is None:
        runs = Runs(scripts & set(SCRIPTS))
        if runs.futures:
            runs.add_worker()
            _runs = runs
        else:
            shutil.rmtree(runs.directory, ignore_errors=True)
    return _runs


def stop() -> None:
    global _runs
    if _runs is not None:
        _runs.stop()
        _runs = None
