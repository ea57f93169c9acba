"""argparse ``type=`` helpers shared by the command parsers (cli/main.py, cli/plan.py).

No imports beyond the standard library: ``ckptlib --help`` loads this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``low`` (the parse error names the value)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse
