import os

# Eight CPU devices for the sharding tests; set before JAX starts a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402,F401  (strict dtype promotion is off: optax itself promotes int32 counts with Python floats)


def pytest_report_header(config):
    # `AUTOFLAT_PACK=off|on pytest` runs the whole suite with that transport as the default of
    # autoflat.step (the `tests_pack` nox sessions run `off` and `on`); autoflat reads it itself.
    return f"autoflat transport (AUTOFLAT_PACK): {os.environ.get('AUTOFLAT_PACK', 'auto')}"
