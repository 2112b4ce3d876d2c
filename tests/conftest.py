import os

# Eight CPU devices for the sharding tests; set before JAX starts a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402,F401  (strict dtype promotion is off: optax itself promotes int32 counts with Python floats)
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_caches():
    yield


def pytest_configure(config):
    # `AUTOFLAT_TEST_PACK=on|auto pytest` runs the whole suite with that transport as the
    # default of autoflat.step (the `tests_pack` nox session does both).
    import autoflat._api

    mode = os.environ.get("AUTOFLAT_TEST_PACK", "off")
    value = {"off": False, "on": True, "auto": "auto"}[mode]
    autoflat._api.step.__kwdefaults__["pack"] = value
    config.addinivalue_line("markers", f"autoflat_pack_{mode}: the transport under test")
