"""Test session set-up: float64 for JAX, and the torch_xla device the bridge tests run on.

Nothing here imports torch_xla or jax at import time. `pytest_configure` runs before any test
module is collected, so PJRT_DEVICE is in the environment before torch_xla is first imported.
"""

import importlib.util
import os


def pytest_configure(config):
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    # The float64 rung of the parity ladder needs x64; without jax installed there is nothing to set.
    if importlib.util.find_spec("jax") is not None:
        import jax

        jax.config.update("jax_enable_x64", True)
