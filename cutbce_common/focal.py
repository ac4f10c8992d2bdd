"""The focal variant's options, shared by both frameworks (framework-neutral: plain Python).

`Focal(gamma, alpha, apply_class_balancing)`: Keras `BinaryFocalCrossentropy` semantics (Lin et
al.), each element's BCE term scaled by `(1 - p_t)^gamma`. The formula: `jax_kernels/reference.py`;
with its derivative: docs/design.md, 'The focal variant' (finite for every logit and every
gamma >= 0, fractional included). `gamma = 0` without balancing is plain CutBCE, and
`check_focal` turns it into None so that the engines run the plain code, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

# The gammas every engine computes exactly. Above MAX_GAMMA: gamma's integer part k is unrolled into
# every compiled tile and Pallas kernel (a kernel per k, its compile growing with k) and each of its
# multiplies is a rounding of the factor; k <= 32 keeps that within 2e-6 relative in float32, and
# (1 - p_t)^32 is already 2e-10 at p_t = 1/2. Below MIN_GAMMA (float32's smallest normal number) a
# gamma rounds or flushes to 0 in float32 arithmetic while its fraction does not: the factor was NaN.
MAX_GAMMA = 32.0
MIN_GAMMA = 2.0 ** -126


@dataclasses.dataclass(frozen=True)
class Focal:
    """Focal loss options (hashable: part of static configs and cache keys).

    Attributes:
      gamma: the focusing exponent, 0 or a float in [2**-126, 32] (Keras' default 2.0; the bounds:
        `MIN_GAMMA`, `MAX_GAMMA`).
      alpha: the positives' share when `apply_class_balancing` (Keras' default 0.25), in [0, 1].
      apply_class_balancing: multiply positives by alpha and negatives by 1 - alpha (Keras' default
        False).
    """

    gamma: float = 2.0
    alpha: float = 0.25
    apply_class_balancing: bool = False

    def __post_init__(self):
        self.validate()
        object.__setattr__(self, "gamma", float(self.gamma))
        object.__setattr__(self, "alpha", float(self.alpha))

    def validate(self) -> None:
        """Raises TypeError / ValueError naming the field that is out of range. Run at construction,
        and at every call by `check_focal`'s rebuild (a frozen dataclass can still be changed through
        `object.__setattr__`)."""
        for name in ("gamma", "alpha"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value):
                raise TypeError(f"focal {name} must be a finite real number, got {value!r}")
        if self.gamma < 0:
            raise ValueError(f"focal gamma must be >= 0, got {self.gamma}")
        if self.gamma > MAX_GAMMA:
            raise ValueError(f"focal gamma must be at most {MAX_GAMMA:g} (its integer part is unrolled into "
                             f"every compiled tile, one rounding per multiply; (1 - p_t)^{MAX_GAMMA:g} is already "
                             f"2e-10 at p_t = 1/2), got {self.gamma!r}")
        if 0 < self.gamma < MIN_GAMMA:
            raise ValueError(f"focal gamma must be 0 or at least {MIN_GAMMA!r} (float32's smallest normal number: "
                             f"a smaller gamma rounds or flushes to 0 in float32 arithmetic), got {self.gamma!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"focal alpha must be in [0, 1], got {self.alpha}")
        if not isinstance(self.apply_class_balancing, bool):
            raise TypeError(f"focal apply_class_balancing must be a bool, got {self.apply_class_balancing!r}")

    @property
    def positive_scale(self) -> float:
        """What every positive's term is multiplied by (alpha with balancing, else 1)."""
        return self.alpha if self.apply_class_balancing else 1.0

    @property
    def negative_scale(self) -> float:
        """What every negative's term is multiplied by (1 - alpha with balancing, else 1)."""
        return 1.0 - self.alpha if self.apply_class_balancing else 1.0


def python_float(value):
    """`value` as a Python float constant where it is a float, else unchanged. Under
    `torch.compile(dynamic=True)` dynamo passes a float read from a default (label_smoothing's 0.0),
    a global or an object (a Focal's fields) as a symbol, which `math.isfinite` cannot take (one
    graph failed); formatted, its value becomes a constant of the trace (dynamo guards on it: a new
    value recompiles), and a float's repr reads back exactly. Plain Python eagerly."""
    return float(f"{value}") if isinstance(value, float) else value


def is_real(value) -> bool:
    """A number as the options take it: Python's int and float and numpy's scalars (`numbers.Real`;
    numpy's bool is none), never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_focal(focal) -> Focal | None:
    """The `focal` argument of an entry, checked and normalised: None for plain CutBCE (also for a
    `Focal` with gamma = 0 and no class balancing, which is plain BCE: the plain code then runs, bit
    for bit), else the `Focal`. Anything else is a TypeError naming the argument."""
    if focal is None:
        return None
    if not isinstance(focal, Focal):
        raise TypeError(f"focal must be None or a Focal(gamma, alpha, apply_class_balancing), got {focal!r}")
    # Rebuilt from its fields as constants (`python_float`): checked as at construction.
    focal = Focal(python_float(focal.gamma), python_float(focal.alpha), focal.apply_class_balancing)
    return None if focal.gamma == 0.0 and not focal.apply_class_balancing else focal

