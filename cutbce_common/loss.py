"""`Loss`: what is computed per element, as one frozen value apart from the route (framework-neutral).

A call's loss math is `Loss(focal, label_smoothing)`; where and how it runs (engine, mesh, offsets,
tile sizes) is the route (`options.CutBCEOptions`). Engines, launchers and kernels pass a `Loss`
through unopened; each language's branch math (`jax_kernels/branch_math.py`,
`torch_cutbce/branch_math.py`) and the two dense oracles are the only readers of its fields. So an
option costs its field here, its math per language, its oracles and its tests, nothing else
(tests/test_loss_footprint.py holds that).

Each element's term, with `u` the logit seen from its label (`z` at a negative, `-z` at a
positive), `c = label_smoothing / 2` and Keras' semantics (`binary_crossentropy(...,
label_smoothing)` and `BinaryFocalCrossentropy`: the target `y (1 - 2c) + c`):

    B(u) = (1 - c) softplus(u) + c softplus(-u) = softplus(u) - c u       (the smoothed BCE)
    q(u) = (1 - c) sigmoid(u) + c sigmoid(-u) = c + (1 - 2c) sigmoid(u)   (1 - p_t)
    term(u) = scale q(u)^gamma B(u)                                       (gamma = 0 without focal)
    scale = (1 - c) alpha + c (1 - alpha) at a positive, c alpha + (1 - c) (1 - alpha) at a
            negative, with class balancing; else 1

B is a sum of two nonnegative terms with weights in [0, 1], so it is exact to rounding for any u
(written as `softplus(u) - c u`, the subtraction loses at most a factor 2: c <= 1/2). The
derivation of the slope: docs/design.md, 'The loss value'.

`form()` is what a compiled tile or a Pallas kernel specialises on (static: focal's integer part
is unrolled), `numbers()` the floats it takes at run time, `transcendentals()` its cost.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from cutbce_common.focal import Focal, check_focal, is_real, python_float

# The smallest smoothing taken besides 0. With class balancing at alpha 0 or 1 a branch's scale is
# the smoothing's half c, which multiplies every term of that branch: at 2**-100, c times any factor
# down to 2**-24 (float32's rounding unit) is still a normal float32 number, so no term that counts
# beside an O(1) term is flushed (XLA:CPU flushes subnormals; at 3e-38 whole rows came out 3e-3 to
# 100% off float64). What flushes below that is the underflow every loss has far from its branch.
MIN_LABEL_SMOOTHING = 2.0 ** -100


class Form(NamedTuple):
    """The static shape of a `Loss`: what compiled code specialises on (hashable)."""

    focal: bool  # the (1 - p_t)^gamma factor is present
    power: int  # gamma's integer part, unrolled as multiplies (0 without focal)
    fraction: bool  # gamma has a fractional part
    smoothing: bool  # c > 0
    balanced: bool  # the branch scales differ from 1


class Numbers(NamedTuple):
    """The run-time floats of a `Loss` (floats, or a compiled tile's 0-d tensors)."""

    gamma: float
    fraction: float  # gamma - its integer part
    half_smoothing: float  # c
    positive_scale: float
    negative_scale: float


@dataclasses.dataclass(frozen=True)
class Loss:
    """The loss of one call (hashable: part of static configs and cache keys).

    Attributes:
      focal: a `Focal`, or None (a Focal that is plain BCE is stored as None: `check_focal`).
      label_smoothing: Keras' `label_smoothing` in [0, 1]: targets become `y (1 - eps) + eps / 2`.
    """

    focal: Focal | None = None
    label_smoothing: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "focal", check_focal(self.focal))
        object.__setattr__(self, "label_smoothing", check_label_smoothing(self.label_smoothing))

    @property
    def plain(self) -> bool:
        """Plain BCE: the C kernel and the plain tiles run it, bit for bit."""
        return self.focal is None and self.label_smoothing == 0.0

    def form(self) -> Form:
        gamma = 0.0 if self.focal is None else self.focal.gamma
        power = int(gamma)
        balanced = self.focal is not None and self.focal.apply_class_balancing
        return Form(gamma > 0, power, gamma > power, self.label_smoothing > 0, balanced)

    def numbers(self) -> Numbers:
        gamma = 0.0 if self.focal is None else self.focal.gamma
        c = self.label_smoothing / 2
        positive = negative = 1.0
        if self.focal is not None and self.focal.apply_class_balancing:
            alpha = self.focal.alpha
            positive, negative = (1 - c) * alpha + c * (1 - alpha), c * alpha + (1 - c) * (1 - alpha)
        return Numbers(gamma, gamma - int(gamma), c, positive, negative)

    def transcendentals(self) -> int:
        """Per element, the exps and logs beyond plain BCE's exp and log1p: the focal factor's exp,
        and with smoothing its log."""
        form = self.form()
        return form.focal * (1 + form.smoothing)

    def arguments(self) -> dict:
        """The entries' keyword arguments that give this value (`cut_bce_with_logits(**...)`)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_arguments(cls, arguments: dict) -> Loss:
        """`Loss(**arguments)` from every field, a nested focal given as all of its fields (JSON's
        form of it); a missing or unknown field is a ValueError."""
        arguments = dict(arguments)
        _check_fields(cls, arguments)
        if isinstance(arguments.get("focal"), dict):
            _check_fields(Focal, arguments["focal"])
            arguments["focal"] = Focal(**arguments["focal"])
        return cls(**arguments)


def _check_fields(kind, arguments: dict) -> None:
    names = sorted(field.name for field in dataclasses.fields(kind))
    if sorted(arguments) != names:
        raise ValueError(f"a {kind.__name__} needs exactly the fields {names}, got {sorted(arguments)}")


def check_label_smoothing(value) -> float:
    """`label_smoothing` as a float in [0, 1]: any real number (Python's or numpy's scalars) but a
    bool; a ValueError / TypeError naming it otherwise. A constant first (`focal.python_float`)."""
    value = python_float(value)
    if not is_real(value) or not math.isfinite(value):
        raise TypeError(f"label_smoothing must be a finite real number in [0, 1], got {value!r}")
    if not 0 <= value <= 1:
        raise ValueError(f"label_smoothing must be in [0, 1] (Keras' semantics: targets y (1 - eps) + eps / 2), "
                         f"got {value!r}")
    if 0 < value < MIN_LABEL_SMOOTHING:
        raise ValueError(f"label_smoothing must be 0 or at least 2**-100 = {MIN_LABEL_SMOOTHING!r} (smaller, "
                         f"float32 flushes the smoothed terms to 0), got {value!r}")
    return float(value)


PLAIN = Loss()  # plain BCE: the default of every call
