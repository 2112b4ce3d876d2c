"""Development sessions: `nox -s tests`, `lint`, `typecheck`, `slow`, `pax`, `pax_slow`, `bench`.

Every session passes `session.posargs` on, e.g. `nox -s tests -- -k sharding`. pytest leaves
the tests marked `slow` out unless asked (`-m slow`, in pyproject.toml): `slow` and `pax_slow`
run them.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import nox


def _add_pyenv_interpreters() -> None:
    """Let nox find every interpreter that pyenv installed (its shims only expose the global
    one), so `nox -s tests` runs on 3.11 and 3.12 wherever pyenv has them."""
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return
    root = subprocess.run(
        [pyenv, "root"], capture_output=True, text=True, check=False
    ).stdout.strip()
    bins = sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin")))
    if bins:
        os.environ["PATH"] = os.pathsep.join([*bins, os.environ.get("PATH", "")])


_add_pyenv_interpreters()

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHONS = ["3.11", "3.12"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The test suite (without the long tests), on Python 3.11 (JAX 0.10) and 3.12 (JAX 0.12)."""
    session.install("-e", ".[tests]")
    session.run("python", "-m", "pytest", "-n", "auto", *session.posargs)


@nox.session(python="3.11")
@nox.parametrize("pack", ["off", "on"])
def tests_pack(session: nox.Session, pack: str) -> None:
    """The test suite with another default transport than `tests`' `"auto"`: one buffer per
    leaf (`off`, `pack=False`) or every leaf packed (`on`, `pack=True`)."""
    session.install("-e", ".[tests]")
    session.env["AUTOFLAT_PACK"] = pack
    session.run("python", "-m", "pytest", "-n", "auto", *session.posargs)


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ (mkdocs-material + mkdocstrings, strict)."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python="3.11")
def slow(session: nox.Session) -> None:
    """The long tests only (PAX's: `pax_slow`)."""
    session.install("-e", ".[tests]")
    session.run("python", "-m", "pytest", "-m", "slow", "-n", "auto", *session.posargs)


def _install_pax(session: nox.Session) -> None:
    """JAX 0.4.35 and PAX, then autoflat itself without its dependencies."""
    # (no bytecode compiled at install: the session imports a fraction of what it installs)
    session.install(
        "--no-compile",
        "jax==0.4.35",
        "jaxlib==0.4.35",
        "pax3==0.5.9",
        "opax==0.2.11",
        "optax==0.2.5",
        "libcst>=1.1",
        "typing-extensions>=4.5",
        "pytest>=8",
    )
    session.install("--no-compile", "--no-deps", "-e", ".")


@nox.session
def pax(session: nox.Session) -> None:
    """PAX (the library the idea came from) needs an older JAX: its tutorial's step under
    autoflat, on small PAX models, against the tutorial's own jax.jit loop; and the tests of
    autoflat's JAX internals (`autoflat/_jax.py`) on that JAX. Runs on the interpreter that
    runs nox (part of the README's test command, so CI runs it)."""
    _install_pax(session)
    session.run(
        "python", "-m", "pytest", "tests/test_pax.py", "tests/test_jax.py", *session.posargs
    )


@nox.session
def pax_slow(session: nox.Session) -> None:
    """PAX's long tests (ResNet18 from `pax.nets`), on JAX 0.4.35 as `pax`."""
    _install_pax(session)
    session.run("python", "-m", "pytest", "tests/test_pax.py", "-m", "slow", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff (E, F, I, UP, B) and its formatter check."""
    session.install("ruff>=0.6")
    session.run(
        "ruff",
        "check",
        "autoflat",
        "tests",
        "benchmarks",
        "examples",
        "noxfile.py",
        *session.posargs,
    )


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy on the package."""
    session.install("-e", ".", "mypy>=1.10")
    session.run("mypy", "autoflat", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The benchmark report (not a test): benchmarks/results/report.{md,json,png}.

    `nox -s bench` is the full run (10-20 min on 2 CPU cores: use a quiet machine);
    `nox -s bench -- --quick` checks the suite in a few minutes. Arguments after `--` go to
    benchmarks/report.py (`--out DIR`, `--sections 2,3`, `--jobs 1`, ...).
    """
    session.install("-e", ".[bench]")  # equinox, flax, matplotlib, keras
    session.run("python", "benchmarks/report.py", *session.posargs)


@nox.session(python="3.11")
def bench_transport(session: nox.Session) -> None:
    """Flat, packed and automatic transport side by side (issue figures; not a test)."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/bench_transport.py", *session.posargs)


@nox.session(python="3.11")
def bench_peers(session: nox.Session) -> None:
    """Keras 3 on the JAX backend against autoflat on the same MLP (not a test):
    benchmarks/results/keras.{md,json}."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/bench_keras.py", *session.posargs)


@nox.session(python="3.11")
def bench_zoo(session: nox.Session) -> None:
    """Flat, automatic and packed transport on the model zoo (not a test):
    benchmarks/results/zoo.{md,json}."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/bench_zoo.py", *session.posargs)
