"""Triton's interpreter (`TRITON_INTERPRET=1`): CPU tensors through the same kernels, for checking them
without a GPU. Read when `triton` is first imported; the route into it is `engines.py`'s.

`make_compatible()` fixes one incompatibility of triton 3.5's interpreter (the one torch 2.9
ships) with numpy >= 2.4: a loop bound such as `range(0, V, BLOCK_V)` is turned into a Python int
by `int()` of a one-element array, which numpy 2.4 refuses ("only 0-dimensional arrays can be
converted to Python scalars"; triton-lang/triton#9171, fixed upstream by #9172 with the same
`squeeze()` as here). Only that interpreter's own attribute is replaced, only while interpreting.
"""

from __future__ import annotations

import functools
import inspect
import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (set before `triton` is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def make_compatible() -> None:
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if len(inspect.signature(patch_tensor).parameters) != 1:  # a newer interpreter: fixed there
        return

    def patched(tensor):
        patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    interpreter._patch_lang_tensor = patched
