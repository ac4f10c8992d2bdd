"""Each element's branch math, pinned: torch, JAX and the C kernel against float64 and each other.

The three implementations of an element's `(loss, slope)` (`torch_cutbce/branch_math.py`,
`jax_kernels/branch_math.py`, `cutbce_common/cpu_tile.c`, plain BCE only) are run in float32
on a grid of logits over [-1e4, 1e4] (dense near 0, log-spaced out to 1e4, both signs, 0, the
smallest subnormal and normal, float32's largest), for a negative and a positive, plain and focal
(gammas 0, 0.5, 1, 2, 3, 5; JAX also with class balancing), and compared with the float64
definition written here in numpy. The errors are counted in float32 ulps of the truth and must stay
within `ulp_bound`; torch and JAX must agree within the sum of their bounds. The three copies of
the log1p polynomial must hold the same coefficients.
"""

from __future__ import annotations

import importlib.util

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cutbce_common import cpu_tile_build
from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from torch_cutbce import branch_math as torch_math

ROOT = Path(__file__).resolve().parents[1]
GAMMAS = (0.0, 0.5, 1.0, 2.0, 3.0, 5.0)
BRANCHES = {"negative": False, "positive": True}
F32 = np.float32

# THE ulp bounds, in float32 ulps of the float64 truth. Plain BCE: exp, the log1p polynomial and a
# division, a few roundings (measured: 2.5 at most, the C kernel's own exp included). Focal: the
# factor's e^k is k roundings of k copies of exp(-|u|) (measured: 9 at gamma 5). The fraction f of
# gamma = k + f adds f max(-u, 0) ulps on top: exp(-gamma tail - f max(-u, 0)) carries its
# argument's rounding, about one ulp of the result per unit of the argument (the exact part is
# e^k; the one-step exp(-gamma softplus(-u)) would carry gamma |u| ulps and fails this bound).
ULPS_PLAIN = 4
ULPS_FOCAL = 12
# Below 2^-125 (twice float32's smallest normal) a result may be flushed to 0: XLA:CPU flushes
# subnormals, and e / (2 + e) is one there. An absolute error up to 2^-125 is allowed.
FLUSH_LIMIT = 2.0**-125


def _grid() -> np.ndarray:
    """The float32 logits z: dense near 0, log-spaced to 1e4, both signs, and the exact specials."""
    dense = np.linspace(-40, 40, 16001)
    logs = np.logspace(-3, 4, 3001)
    info = np.finfo(F32)
    specials = np.array([0.0, info.smallest_subnormal, info.tiny, 1e-30, 1e-10, 1e4, info.max])
    return np.unique(np.concatenate([dense, logs, -logs, specials, -specials]).astype(F32))


Z = _grid()


def _truth(z, positive: bool, gamma: float):
    """float64 `(loss, d loss / dz)` of float32 logits z, from the definition (docs/design.md, 'The
    focal variant'): u = -z at a positive; `term(u) = sigmoid(u)^gamma softplus(u)` (plain: gamma 0)."""
    u = -z.astype(np.float64) if positive else z.astype(np.float64)
    e = np.exp(-np.abs(u))

    def softplus(x):
        return np.logaddexp(0.0, x)

    def sigmoid(x):
        return np.where(x >= 0, 1.0, e) / (1.0 + e)  # |x| = |u|: exp(-|x|) = e

    factor = np.exp(-gamma * softplus(-u))
    slope = factor * (gamma * sigmoid(-u) * softplus(u) + sigmoid(u))
    return factor * softplus(u), (-slope if positive else slope)


def ulp_bound(z, positive: bool, gamma: float) -> np.ndarray:
    """Per element: `ULPS_PLAIN` or `ULPS_FOCAL`, plus `f max(-u, 0)` for gamma's fraction f."""
    u = -z.astype(np.float64) if positive else z.astype(np.float64)
    return (ULPS_FOCAL if gamma else ULPS_PLAIN) + (gamma - int(gamma)) * np.maximum(-u, 0)


def ulp_errors(fast, truth, scale=None) -> np.ndarray:
    """|fast - truth| in float32 ulps of the truth, or of `scale` where larger (0 below
    `FLUSH_LIMIT` within it, else inf)."""
    fast, truth = np.asarray(fast, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    error = np.abs(fast - truth)
    exponent = np.frexp(truth if scale is None else np.maximum(np.abs(truth), scale))[1]  # |truth| in [2^(exponent - 1), 2^exponent): ulp 2^(exponent - 24)
    ulps = error / np.maximum(np.ldexp(1.0, exponent - 24), 2.0**-149)
    flushed = np.abs(truth) < FLUSH_LIMIT
    return np.where(flushed, np.where(error <= FLUSH_LIMIT, 0.0, np.inf), ulps)


def assert_within(fast, truth, bound, name, scale=None):
    """Every element within its bound; the message names the worst one (z, fast, truth, ulps)."""
    fast = np.asarray(fast, dtype=np.float64)
    assert np.isfinite(fast).all(), f"{name}: non-finite at z = {Z[~np.isfinite(fast)][:5]}"
    excess = ulp_errors(fast, truth, scale) - bound
    i = int(np.argmax(excess))
    assert excess[i] <= 0, (f"{name}: {ulp_errors(fast, truth, scale)[i]:.1f} ulps > bound {bound[i]:.1f} at "
                            f"z = {Z[i]!r}: fast {fast[i]!r}, truth {np.asarray(truth)[i]!r}")


CASES = [(branch, gamma) for branch in BRANCHES for gamma in GAMMAS]


def _loss(gamma: float) -> Loss:
    return Loss(Focal(gamma) if gamma else None)


# -- label smoothing (issue 30): each element's Keras term of the target y (1 - 2c) + c ---------------

SMOOTHINGS = (0.1, 1.0)
SMOOTHED_CASES = [(branch, Loss(Focal(gamma, 0.25, balanced) if gamma or balanced else None, eps))
                  for branch in BRANCHES for eps in SMOOTHINGS for gamma, balanced in ((0.0, False), (2.0, True),
                                                                                       (0.5, False))]


def _smoothed_truth(z, positive: bool, loss: Loss):
    """float64 `(loss, d loss / dz)` from Keras' definition in logit space: B = (1 - c) softplus(u)
    + c softplus(-u), q = (1 - c) sigmoid(u) + c sigmoid(-u), term = a q^gamma B, u = -z at a
    positive; and `scale`, the size of the slope's terms before they cancel (`sigmoid(u) - c`, and its
    sum with the factor's slope, of the other sign where sigmoid(u) < c)."""
    c = loss.label_smoothing / 2
    gamma = 0.0 if loss.focal is None else loss.focal.gamma
    u = -z.astype(np.float64) if positive else z.astype(np.float64)
    e = np.exp(-np.abs(u))
    s_u, s_flip = np.where(u >= 0, 1.0, e) / (1 + e), np.where(u >= 0, e, 1.0) / (1 + e)
    bce = (1 - c) * np.logaddexp(0.0, u) + c * np.logaddexp(0.0, -u)
    q = (1 - c) * s_u + c * s_flip
    numbers = loss.numbers()
    a = numbers.positive_scale if positive else numbers.negative_scale
    slope = a * q**gamma * (s_u - c + gamma * (1 - 2 * c) * s_u * s_flip * bce / q)
    scale = a * q**gamma * (np.maximum(s_u, c) + gamma * (1 - 2 * c) * s_u * s_flip * bce / q)
    return a * q**gamma * bce, (-slope if positive else slope), scale


def check_smoothed(value, slope, branch, loss, who):
    """The loss within 6 ulps (7 with the class balance's multiply) plus gamma |log q|
    (exp(gamma log q) carries its argument's rounding);
    the slope within the same ulps of `scale` (sigmoid(u) - c cancels where sigmoid(u) ~ c: the
    dense BCE's `sigmoid(z) - target` loses the same)."""
    positive = BRANCHES[branch]
    truth, truth_slope, scale = _smoothed_truth(Z, positive, loss)
    gamma = 0.0 if loss.focal is None else loss.focal.gamma
    c = loss.label_smoothing / 2
    u = -Z.astype(np.float64) if positive else Z.astype(np.float64)
    s_u = 1 / (1 + np.exp(-np.clip(u, -700, 700)))
    bound = 6 + loss.form().balanced + gamma * np.abs(np.log((1 - c) * s_u + c * (1 - s_u)))
    name = f"{who} {branch} {loss}"
    assert_within(value, truth, bound, f"{name} loss")
    assert_within(slope, truth_slope, bound, f"{name} slope", scale=scale)


@pytest.mark.parametrize("branch,loss", SMOOTHED_CASES, ids=str)
def test_torch_smoothed_within_the_bound(branch, loss):
    value, slope = torch_math.branch_terms(torch.from_numpy(Z), BRANCHES[branch], loss)
    check_smoothed(value.numpy(), slope.numpy(), branch, loss, "torch")


@pytest.mark.jax
@pytest.mark.parametrize("branch,loss", SMOOTHED_CASES, ids=str)
def test_jax_smoothed_within_the_bound(branch, loss):
    import jax
    import jax.numpy as jnp

    from jax_kernels import branch_math as jax_math
    from parity import enable_x64

    with enable_x64(False):
        value, slope = jax.jit(lambda z: jax_math.branch_terms(z, BRANCHES[branch], loss))(jnp.asarray(Z))
        labelled = jax.jit(lambda z: jax_math.labelled_terms(
            z, jnp.full(z.shape, BRANCHES[branch]), jax_math.exp_neg_abs(z), loss))(jnp.asarray(Z))
    check_smoothed(np.asarray(value), np.asarray(slope), branch, loss, "jax")
    check_smoothed(*(np.asarray(x) for x in labelled), branch, loss, "jax labelled (Pallas)")


def test_a_taken_out_positive_adds_nothing_under_smoothing():
    """z = -inf marks a positive taken out of its tile: 0 loss (its smoothed c |u| is inf there)."""
    z = torch.tensor([float("-inf"), 0.0])
    value, _ = torch_math.branch_terms(z, False, Loss(label_smoothing=0.2))
    assert value[0] == 0 and value[1] > 0


@pytest.mark.parametrize("branch,gamma", CASES)
def test_torch_float32_within_the_ulp_bound(branch, gamma):
    positive = BRANCHES[branch]
    loss, slope = torch_math.branch_terms(torch.from_numpy(Z), positive, _loss(gamma))
    truth = _truth(Z, positive, gamma)
    bound = ulp_bound(Z, positive, gamma)
    assert_within(loss.numpy(), truth[0], bound, f"torch {branch} gamma={gamma} loss")
    assert_within(slope.numpy(), truth[1], bound, f"torch {branch} gamma={gamma} slope")


def _all_compiled_terms(z):
    """Every case's `(loss, slope)` in one graph (one compile): the polynomial log1p path."""
    terms = [torch_math.branch_terms(z, positive, _loss(gamma)) for positive, gamma in
             ((BRANCHES[branch], gamma) for branch, gamma in CASES)]
    smoothed = [torch_math.branch_terms(z, BRANCHES[branch], loss) for branch, loss in SMOOTHED_CASES]
    return terms, torch_math.softplus_one_exp(z), smoothed


@pytest.mark.slow
def test_torch_compiled_within_the_ulp_bound():
    """As `torch.compile`d tiles run it (polynomial log1p, FMA contraction as fused_tile asks)."""
    options = {"cpp.enable_floating_point_contract_flag": "fast"}
    compiled = torch.compile(_all_compiled_terms, fullgraph=True, dynamic=False, options=options)
    terms, softplus_alone, smoothed = compiled(torch.from_numpy(Z))
    for (branch, loss), (value, slope) in zip(SMOOTHED_CASES, smoothed):
        check_smoothed(value.numpy(), slope.numpy(), branch, loss, "compiled")
    for (branch, gamma), (loss, slope) in zip(CASES, terms):
        positive = BRANCHES[branch]
        truth, bound = _truth(Z, positive, gamma), ulp_bound(Z, positive, gamma)
        assert_within(loss.numpy(), truth[0], bound, f"compiled {branch} gamma={gamma} loss")
        assert_within(slope.numpy(), truth[1], bound, f"compiled {branch} gamma={gamma} slope")
    assert_within(softplus_alone.numpy(), _truth(Z, False, 0.0)[0], ulp_bound(Z, False, 0.0),
                  "compiled softplus_one_exp")


def _jax_terms(positive: bool, gamma: float, balancing: bool):
    """JAX float32 `(loss, slope)` (x64 off, jitted as the engines run it), as numpy."""
    import jax
    import jax.numpy as jnp

    from jax_kernels import branch_math as jax_math
    from cutbce_common.focal import Focal, check_focal
    from parity import enable_x64

    focal = check_focal(Focal(gamma, 0.25, balancing))
    with enable_x64(False):
        loss, slope = jax.jit(lambda z: jax_math.branch_terms(z, positive, Loss(focal)))(jnp.asarray(Z))
        return np.asarray(loss), np.asarray(slope), (1.0 if focal is None else
                                                     focal.positive_scale if positive else focal.negative_scale)


@pytest.mark.jax
@pytest.mark.parametrize("balancing", [False, True], ids=["unbalanced", "balanced"])
@pytest.mark.parametrize("branch,gamma", CASES)
def test_jax_float32_within_the_ulp_bound(branch, gamma, balancing):
    positive = BRANCHES[branch]
    loss, slope, scale = _jax_terms(positive, gamma, balancing)
    truth = _truth(Z, positive, gamma)
    bound = ulp_bound(Z, positive, gamma) + (scale != 1.0)  # the class balance: one more rounding
    name = f"jax {branch} gamma={gamma} balancing={balancing}"
    assert_within(loss, scale * truth[0], bound, f"{name} loss")
    assert_within(slope, scale * truth[1], bound, f"{name} slope")


@pytest.mark.jax
@pytest.mark.parametrize("branch,gamma", CASES)
def test_torch_and_jax_agree(branch, gamma):
    """Within the sum of their bounds, counted in ulps of JAX's value."""
    positive = BRANCHES[branch]
    jax_loss, jax_slope, _ = _jax_terms(positive, gamma, False)
    loss, slope = torch_math.branch_terms(torch.from_numpy(Z), positive, _loss(gamma))
    bound = 2 * ulp_bound(Z, positive, gamma)
    assert_within(loss.numpy(), jax_loss.astype(np.float64), bound, f"torch vs jax {branch} gamma={gamma} loss")
    assert_within(slope.numpy(), jax_slope.astype(np.float64), bound, f"torch vs jax {branch} gamma={gamma} slope")


@pytest.fixture(scope="module")
def c_library():
    try:
        return cpu_tile_build.c_library()
    except cpu_tile_build.BuildError as error:
        pytest.skip(f"no C compiler: the CPU tile kernel is not built ({error})")


@pytest.mark.parametrize("branch", BRANCHES)
def test_c_kernel_float32_within_the_ulp_bound(c_library, branch):
    """Plain BCE only (the kernel's tiles are negatives): a positive's terms are a negative's at -z,
    with the slope's sign flipped. One element per row: the rows are the elements' losses."""
    positive = BRANCHES[branch]
    z = np.ascontiguousarray(-Z if positive else Z, dtype=F32)
    g, dz, rows = np.ones(z.size, F32), np.empty_like(z), np.empty(z.size, F32)
    c_library.cutbce_tile(z.ctypes.data, None, g.ctypes.data, dz.ctypes.data, rows.ctypes.data, z.size, 1, 1)
    truth, bound = _truth(Z, positive, 0.0), ulp_bound(Z, positive, 0.0)
    assert_within(rows, truth[0], bound, f"C kernel {branch} loss")
    assert_within(-dz if positive else dz, truth[1], bound, f"C kernel {branch} slope")


def _coefficients(path: str, function: str) -> list[float]:
    """The float literals of the log1p polynomial in `function` of the file at `path`."""
    # The installed package's file (the core-only check runs the tests without the source folders).
    package, _, rest = path.partition("/")
    source = (Path(importlib.util.find_spec(package).origin).parent / rest).read_text()
    body = source[source.index(function):]
    body = body[:body.index("\n", body.index("return"))]  # to the end of its return line
    return [float(x) for x in re.findall(r"\d+\.\d{6,}", body)]


def test_the_three_polynomials_hold_the_same_coefficients():
    torch_fit = _coefficients("torch_cutbce/branch_math.py", "def log1p_from_t")
    assert len(torch_fit) == 5, torch_fit
    assert _coefficients("jax_kernels/branch_math.py", "def log1p_unit") == torch_fit
    assert _coefficients("cutbce_common/cpu_tile.c", "cutbce_log1p_unit(cutbce_vf e)") == torch_fit
