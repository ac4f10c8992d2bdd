"""Test session set-up: the torch_xla device the bridge tests run on, and skips for what an install
lacks.

JAX runs with x64 off, its default and the configuration users run: float32 / bfloat16 cases and
int64 ids (validated before JAX narrows them to int32) are tested as users see them. Each float64
case switches x64 on locally (`parity.jax_x64(dtype)`, i.e. `jax.enable_x64`, or
`jax.experimental.enable_x64` before jax 0.8); the subprocess workers do the same.

Nothing here imports torch_xla or jax at import time. `pytest_configure` sets PJRT_DEVICE, then
imports torch_xla (where installed); when the session holds tests marked `xla`, the fixture
`xla_runtime_before_any_backward` starts the XLA device before the first test. torch's autograd
engine sizes its per-device queues at the first backward, so an XLA backward after a CPU backward
that ran before the XLA device existed fails with an internal assert (a torch / torch_xla
limitation users meet too: README, 'What is not verified'); importing torch_xla alone is not enough. Without
this, which tests pass would depend on their order and on which files run.

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
# `bash ci/test.sh -m fast`: the files that check the core in-process in seconds each (the oracle,
# both frameworks' engines against it, options, the repository's rules), and the conformance
# families whose checks are as quick (bad input, in every engine class that runs it), for a check
# while editing; the full run is CI's.
FAST_MODULES = {
    "test_reference.py", "test_branch_math.py", "test_neutral_options.py", "test_torch_native.py",
    "test_repo_hygiene.py", "test_repo_layout.py", "test_docs_links.py", "test_loss_footprint.py",
    "test_torch_engines.py",
}
FAST_FAMILIES = {"BadInputChecks"}  # a family's own checks only: not the other families of its classes


def is_fast(item) -> bool:
    function = getattr(item, "function", None)  # the check's function, where the family defined it
    family = function.__qualname__.split(".")[0] if function is not None else None
    return item.path.name in FAST_MODULES or family in FAST_FAMILIES


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_configure(config):
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    # JAX's x64 mode stays off (JAX's default), whatever the shell says; float64 cases switch it on
    # locally (parity.jax_x64). Subprocess workers inherit this environment.
    os.environ.pop("JAX_ENABLE_X64", None)
    if installed("torch_xla"):
        import torch_xla  # noqa: F401  (before any backward: see the module docstring)


def narrowed_to_nothing(item) -> bool:
    """A check an engine class narrowed to no parameters (a conformance class's empty tuple, e.g.
    `row_losses = ()`): it runs nothing by design, so it is deselected rather than reported as a skip."""
    return any(str(mark.kwargs.get("reason", "")).startswith("got empty parameter set")
               for mark in item.iter_markers("skip"))


def pytest_collection_modifyitems(config, items):
    kept, narrowed = [], []
    for item in items:
        (narrowed if narrowed_to_nothing(item) else kept).append(item)
    if narrowed:
        config.hook.pytest_deselected(items=narrowed)
        items[:] = kept
    missing = {marker: (module, extra) for marker, (module, extra) in OPTIONAL.items() if not installed(module)}
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)
        for marker, (module, extra) in missing.items():
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=f"needs {module}: pip install 'torch-cutbce[{extra}]'"))


LIBRARY_ENV = ("TORCH_CUTBCE_", "JAX_", "XLA_FLAGS")  # what the library and JAX read from the environment


def _library_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(LIBRARY_ENV)}


@pytest.fixture(scope="module", autouse=True)
def library_env_does_not_leak():
    """A test file that sets TORCH_CUTBCE_* or JAX_* in this process must put it back (monkeypatch):
    xdist runs several files per worker, and a leaked `TORCH_CUTBCE_NO_COMPILE=1` once made later
    files skip their C-kernel checks and run eager tiles, depending on which files shared a worker."""
    before = _library_env()
    yield
    after = _library_env()
    if after != before:
        os.environ.update(before)
        for name in set(after) - set(before):
            del os.environ[name]
        changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
        pytest.fail(f"this test file left the environment changed: {changed} (use monkeypatch.setenv)")


@pytest.fixture(scope="session", autouse=True)
def xla_runtime_before_any_backward(request):
    """Starts the XLA device before any test when an `xla` test will run (see the module docstring)."""
    if installed("torch_xla") and any(item.get_closest_marker("xla") for item in request.session.items):
        import torch_xla

        torch_xla.device()


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of one rank in this process: enough for vocab_parallel to run its all_reduces."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
