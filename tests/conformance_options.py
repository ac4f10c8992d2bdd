"""Each loss option's own definitions (Keras' label smoothing and focal, torchvision's focal, the bounds of gamma) on an engine: `OptionChecks`.

A check family of the conformance suite (`conformance.py`).
"""

from __future__ import annotations


class OptionChecks:
    """(to be filled)"""
