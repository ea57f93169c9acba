"""Output for the ``ckptlib`` command: human formatting (rich) and JSON documents.

Humans get rich tables on stdout (colours only on a terminal; plain and wide enough to grep
when piped) and messages on stderr. ``--json`` gets exactly one JSON document on stdout and
never colours or progress bars.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import math
import os
import re
import sys
from collections.abc import Collection, Sized
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

PIPE_WIDTH = 1 << 20
"""Line width when stdout is not a terminal (and ``COLUMNS`` is unset): wide enough that no
row of a table wraps, however long its reason (``grep`` sees whole rows); trailing padding is
stripped (:meth:`Output.print`)."""

STATUS_STYLE = {
    "committed": "green", "ok": "green", "corrupt": "bold red", "incomplete": "yellow",
    "gone": "dim", "quarantined": "red", "debris": "yellow", "in progress": "cyan",
}


class CliError(Exception):
    """A usage or access problem: printed as one line on stderr, exit status ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (``ckptlib ls ROOT | head``): raise, so that ``main`` ends
        quietly with the command's own exit status (rich's default exits with status 1)."""
        self.quiet = True
        self.broken_pipe = True
        raise BrokenPipeError

    broken_pipe = False


def _console_environ() -> dict[str, str]:
    """The environment rich reads, less a ``COLUMNS``/``LINES`` that is not a plain ASCII number
    ("²" passes ``str.isdigit()``, and rich's ``int()`` of it ended the command in a traceback)."""
    env = dict(os.environ)
    for name in ("COLUMNS", "LINES"):
        if name in env and not (env[name].isascii() and env[name].isdigit()):
            del env[name]
    return env


class Output:
    """Where a command writes: a rich console for humans, or one JSON document."""

    def __init__(self, json_mode: bool) -> None:
        self.json_mode = json_mode
        self.exit_code: int | None = None
        """The command's exit status once known, for ``main`` if the output pipe breaks."""
        width: int | None = None
        self.piped = not sys.stdout.isatty()
        if self.piped:
            columns = os.environ.get("COLUMNS", "")
            width = int(columns) if columns.isascii() and columns.isdigit() and int(columns) > 0 else PIPE_WIDTH
        env = _console_environ()
        self.console = _Console(markup=False, highlight=False, emoji=False, width=width, _environ=env)
        self.err = _Console(stderr=True, markup=False, highlight=False, emoji=False, _environ=env)

    @property
    def broken_pipe(self) -> bool:
        """True once writing to stdout or stderr failed because the reader went away."""
        return self.console.broken_pipe or self.err.broken_pipe

    @property
    def interactive(self) -> bool:
        """True when progress bars make sense: human output to a terminal."""
        return not self.json_mode and self.console.is_terminal

    muted = False
    """Set by ``main`` once it gave up on a stalled command: that command's later output (its
    thread may wake up) is dropped; only ``force=True`` output (main's own message) goes out."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Human output (ignored in ``--json`` mode). Piped, each line without the padding a
        table puts after its last column."""
        if self.json_mode or self.muted:
            return
        if not self.piped or self.console.is_terminal:
            self.console.print(*objects, **kwargs)
            return
        fast = plain_table(objects[0], self.console.width) if len(objects) == 1 and not kwargs else None
        if fast is not None:
            text = fast
        else:
            with self.console.capture() as captured:
                self.console.print(*objects, **kwargs)
            text = "\n".join(line.rstrip() for line in captured.get().split("\n"))
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left (`ckptlib ls ROOT | head`): as rich's console
            self.console.broken_pipe = True
            raise

    def note(self, message: str, style: str = "yellow", force: bool = False) -> None:
        """A message for humans on stderr (also in ``--json`` mode: stdout stays pure JSON)."""
        if force or not self.muted:
            self.err.print(Text(message, style=style), soft_wrap=True)

    def emit(self, document: dict[str, Any], force: bool = False) -> None:
        """Write ``document`` as the one JSON document on stdout (``--json`` mode only)."""
        if self.json_mode and (force or not self.muted):
            sys.stdout.write(json.dumps(jsonable(document), indent=2, allow_nan=False) + "\n")
            sys.stdout.flush()


@dataclass
class Progress:
    """A rich progress bar over ``total`` bytes, or nothing (``--json``, or not a terminal).
    ``verify`` draws it on stdout (transient), ``export`` on stderr."""

    out: Output
    total: int
    label: str
    stderr: bool = False
    bar: Any = None
    task: Any = None
    done: int = 0

    def __enter__(self) -> Progress:
        if self.out.interactive and self.total:
            from rich import progress as rp

            self.bar = rp.Progress(
                rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn(binary_units=True),
                rp.TransferSpeedColumn(), rp.TimeRemainingColumn(),
                console=self.out.err if self.stderr else self.out.console, transient=not self.stderr,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def add_total(self, n: int) -> None:
        """More bytes to check than announced (``prune --verify`` found a corrupt kept step)."""
        self.total += n
        if self.bar is not None:
            self.bar.update(self.task, total=self.total)

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.advance(self.task, n)


def has_rows(out: Output, rows: Sized, empty: str) -> bool:
    """Whether a listing goes on to print its rows for humans. Not in ``--json`` mode (its
    document is already out), nor when there are none: then ``empty`` is printed instead."""
    if out.json_mode:
        return False
    if not rows:
        out.print(empty)
        return False
    return True


def table(*columns: str, right: Collection[str] = (), fold: Collection[str] = ()) -> Table:
    """A borderless table with a bold header; ``right`` columns right-justified, ``fold``
    columns wrapped when long."""
    t = Table(box=None, pad_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left",
                     overflow="fold" if c in fold else "ellipsis")
    return t


_UNSAFE = re.compile(r"[\x00-\x1f\x7f]")  # cells rich would expand, split or strip


def plain_table(t: Any, width: int) -> str | None:
    """A :func:`table` laid out as rich lays it out piped (no colours; columns two spaces
    apart, each as wide as its widest cell; trailing spaces stripped), in time linear in its
    cells: rich's renderer takes milliseconds per row, minutes for ``inspect`` of 100,000
    tensors. ``None`` when ``t`` is not such a table or needs rich (a cell with a control
    character or newline, a layout wider than ``width``): :meth:`Output.print` (the command's
    worker thread) then lets rich render it."""
    if not (isinstance(t, Table) and t.box is None and not t.pad_edge and t.show_header
            and t.padding == (0, 1, 0, 1) and not t.collapse_padding and not t.expand
            and not t.show_footer and not t.show_lines and not t.leading and t.title is None
            and t.caption is None and t.width is None and t.columns):
        return None
    cols: list[list[str]] = []
    for c in t.columns:
        if c.justify not in ("left", "right") or c.width or c.min_width or c.max_width or c.ratio:
            return None
        cells: list[str] = []
        for x in (c.header, *c.cells):
            plain = x if isinstance(x, str) else x.plain if isinstance(x, Text) else None
            if plain is None:
                return None
            cells.append(plain)
        cols.append(cells)
    widths: list[list[int]] = []
    for cells in cols:
        if any(_UNSAFE.search(x) for x in cells):
            return None
        widths.append([len(x) if x.isascii() else cell_len(x) for x in cells])
    col_width = [max(w) for w in widths]
    if sum(col_width) + 2 * (len(cols) - 1) > width:
        return None
    right = [c.justify == "right" for c in t.columns]
    lines = []
    for i in range(len(cols[0])):
        parts = []
        for j, cells in enumerate(cols):
            pad = " " * (col_width[j] - widths[j][i])
            parts.append(pad + cells[i] if right[j] else cells[i] + pad)
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"


def status_text(status: str) -> Text:
    """``status`` coloured by meaning."""
    return Text(status, style=STATUS_STYLE.get(status, ""))


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "PiB":
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def human_age(seconds: float | None) -> str:
    """Seconds since an event -> ``"42s ago"``, ``"3m ago"``, ``"5h ago"``, ``"2d ago"``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    future = seconds < -1.0
    s = abs(seconds)
    if s < 60:
        text = f"{int(s)}s"
    elif s < 3600:
        text = f"{int(s // 60)}m"
    elif s < 86400:
        text = f"{int(s // 3600)}h"
    else:
        text = f"{int(s // 86400)}d"
    return f"in {text} (clock skew?)" if future else f"{text} ago"


def iso_time(timestamp: float | None) -> str | None:
    """A Unix time as an ISO 8601 UTC string, or None."""
    if timestamp is None or not math.isfinite(timestamp):
        return None
    try:
        when = _dt.datetime.fromtimestamp(timestamp, tz=_dt.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` made safe for strict JSON: NaN/inf and bytes become strings, tuples lists,
    non-string keys strings, anything else its ``str``."""
    if depth > 64:
        return "..."
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    if isinstance(value, io.BytesIO):
        return f"<io.BytesIO of {value.getbuffer().nbytes} bytes>"
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v, depth + 1) for v in value]
    return str(value)


def short_repr(value: Any, limit: int = 60) -> str:
    """A one-line ``repr`` of at most ``limit`` characters."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summarize(value: Any, limit: int = 200) -> str:
    """One line describing user metadata: ``key=value, ...`` for a dict, else a short repr."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        parts = [f"{k}={short_repr(v, 40)}" for k, v in value.items()]
        text = ", ".join(parts) if parts else "{}"
    else:
        text = short_repr(value, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."
