"""Property-based checks (hypothesis) of an engine against the float64 oracle: `PropertyChecks`.

A check family of the conformance suite (`conformance.py`).
"""

from __future__ import annotations


class PropertyChecks:
    """(to be filled)"""
