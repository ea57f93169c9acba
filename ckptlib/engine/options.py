"""Argument checks for the options the user passes, with messages that name the argument.

The one place those rules live: ``SaveOptions.__post_init__`` (``ckptlib.save``, the manager's
saves, the DCP writer's constructor) and ``ManagerOptions.__post_init__``
(``CheckpointManager(...)``) call these when the options are built, on the caller's thread, so
a bad value fails the call that passed it, never a background save. Wrong type:
``TypeError``; right type, bad value: ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptlib.format.codec import codec_for


def positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    """``value`` is an int >= 1 (or None when ``optional``); bool is not an int here."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def int_at_least(name: str, value: Any, low: int) -> None:
    """``value`` is an int >= ``low`` (counts where 0 may be allowed); bool is not an int here."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def positive_number(name: str, value: Any) -> None:
    """``value`` is an int or float > 0 (seconds, sizes)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a positive, finite number, got {value!r}")


def flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def one_of(name: str, value: Any, choices: Sequence[Any]) -> None:
    """``value`` is one of ``choices``; a bool choice matches only that bool (``1``, ``1.0`` or
    numpy's ``True_`` equal ``True`` but are refused: ``check_replicas=1`` acted as "auto")."""
    if not any(value is c if isinstance(c, bool) or isinstance(value, bool) else value == c for c in choices):
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def optional_int(name: str, value: Any) -> None:
    """``value`` is None or any int (e.g. a niceness)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{name} must be an int or None, got {value!r}")


def compression(value: Any) -> None:
    """``compression``: None or ``"zstd"`` (the codecs :mod:`ckptlib.format.codec` knows)."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"compression must be None or 'zstd', got {value!r}")
    codec_for(value, 1)  # ValueError naming the argument for an unknown codec
