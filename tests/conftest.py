"""Test session set-up: float64 for JAX, the torch_xla device the bridge tests run on, and skips for
what an install lacks.

Nothing here imports torch_xla or jax at import time. `pytest_configure` runs before any test
module is collected, so PJRT_DEVICE is in the environment before torch_xla is first imported.

The core install (`pip install torch-cutbce`: torch and numpy) runs every torch-only test; tests
marked `jax` or `xla` skip, with the extra to install as the reason, where jax or torch_xla is
missing (`ci/core_only.sh` checks this). Modules that need jax for every test skip themselves
with `pytest.importorskip`.
"""

import importlib.util
import os

import pytest

# marker -> (the module it needs, the extra that installs it)
OPTIONAL = {"jax": ("jax", "jax"), "xla": ("torch_xla", "xla")}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_configure(config):
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    # The float64 rung of the parity ladder needs x64; without jax installed there is nothing to set.
    if installed("jax"):
        import jax

        jax.config.update("jax_enable_x64", True)


def pytest_collection_modifyitems(config, items):
    missing = {marker: (module, extra) for marker, (module, extra) in OPTIONAL.items() if not installed(module)}
    for item in items:
        for marker, (module, extra) in missing.items():
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=f"needs {module}: pip install 'torch-cutbce[{extra}]'"))
