"""Test-facing name for :mod:`ckptlib.crashpoints` (the library's named crash points)."""

from ckptlib.crashpoints import PHASES, configure, parse, point

__all__ = ["PHASES", "configure", "parse", "point"]
