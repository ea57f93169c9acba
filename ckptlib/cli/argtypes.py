"""argparse ``type=`` helpers shared by the command parsers (cli/main.py, cli/plan.py).

No imports beyond the standard library: ``ckptlib --help`` loads this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(low: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``low`` (and <= ``most``; the parse error names the
    value)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be <= {most:,}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def seconds(text: str) -> float:
    """An argparse ``type=``: a finite number of seconds >= 0 (``nan``, ``inf`` and negative
    values are refused: each option taking one is a safety margin or a limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value
