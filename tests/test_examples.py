"""The examples run top to bottom (in their fast smoke mode)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_flagship_digits_smoke():
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    out = _run("train_digits.py", "--smoke")
    assert "# autoflat: generated from `update` at train_digits.py:" in out
    assert "test accuracy:" in out
    assert "| autoflat num_steps=10 |" in out
    assert "2 host flattens" in out
