"""Bad and degenerate-but-valid input at an engine's entry: `BadInputChecks`.

A check family of the conformance suite (`conformance.py`).
"""

from __future__ import annotations


class BadInputChecks:
    """(to be filled)"""
