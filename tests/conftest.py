import os

# Eight CPU devices for the sharding tests; set before JAX starts a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402,F401  (strict dtype promotion is off: optax itself promotes int32 counts with Python floats)
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_caches():
    yield
