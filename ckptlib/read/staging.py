"""Where an export writes: a staging folder beside OUT, put in OUT's place only when complete.

Who calls what, all on the exporter's (the caller's) thread, in this order:
:func:`ckptlib.read.to_safetensors.export_safetensors` and
:func:`ckptlib.read.to_zarr3.export_zarr3` (for a local OUT) first make their own checks of the
checkpoint (dtypes, names), then enter :func:`staged` with OUT and the rule for the names they
write (their ``owns`` functions). :func:`staged` refuses an OUT that is a
file or a folder holding anything else, before creating anything; otherwise it creates the
empty folder ``<OUT>.tmp-<id>`` next to OUT and hands it to the exporter, which writes every
file into it (every chunk it reads was checksum-verified). When the exporter's block ends
normally, :func:`staged` checks OUT again, moves an existing OUT aside to ``<OUT>.old-<id>``,
renames the staging folder to OUT and deletes the old one. When the block raises (a corrupt
chunk, a full disk), the staging folder is deleted and OUT is left as it was, or absent if it
did not exist: an export either completes or changes nothing. A process killed mid-export can
leave a ``<OUT>.tmp-<id>`` folder behind (never OUT itself half-written); delete it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SHOWN = 5
"""How many of the names that refuse an OUT a message lists."""

Owns = Callable[[str, str], bool]
"""``owns(out, name)``: whether the entry ``name`` of the folder ``out`` is one an export of that
format writes (so a later export may replace it)."""


def check_out(out: str, owns: Owns, what: str) -> None:
    """Raise ``FileExistsError`` when ``out`` exists and is not a folder an export may replace:
    a file or link, or a folder holding entries ``owns`` does not accept (an empty folder, or
    one holding only an earlier ``what`` export's files, is fine)."""
    if not os.path.lexists(out):
        return
    if os.path.islink(out) or not os.path.isdir(out):
        raise FileExistsError(f"{out} exists and is not a folder; nothing was written. "
                              "Export into a new or empty folder")
    other = sorted(n for n in os.listdir(out) if not owns(out, n))
    if other:
        more = f" and {len(other) - SHOWN} more" if len(other) > SHOWN else ""
        raise FileExistsError(
            f"{out} holds files that are not a {what} export ({', '.join(other[:SHOWN])}{more}); nothing "
            f"in it was changed. Export into a new or empty folder, or move those files away")


@contextmanager
def staged(out: str, owns: Owns, what: str) -> Iterator[str]:
    """Yield a new empty staging folder beside ``out`` for the export to write into; put it in
    ``out``'s place when the block ends normally, delete it when the block raises (see the
    module docstring). ``out`` is refused first as :func:`check_out` says."""
    out = os.path.abspath(out)
    check_out(out, owns, what)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tag = secrets.token_hex(4)
    staging = f"{out}.tmp-{tag}"
    os.mkdir(staging)
    old: str | None = None
    try:
        yield staging
        check_out(out, owns, what)  # again: something may have been put there meanwhile
        if os.path.lexists(out):
            old = f"{out}.old-{tag}"
            os.rename(out, old)
        try:
            os.rename(staging, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
