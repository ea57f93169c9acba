"""``ckptlib export URL [--step N] --to zarr3|safetensors OUT [--select PREFIX]``.

Registered by :mod:`ckptlib.cli.main` (:func:`add_parser`), which calls :func:`cmd_export` on
the command's worker thread (cli/deadline.py). Opens the checkpoint with ``ckptlib.open`` and streams it through
:mod:`ckptlib.read.to_zarr3` or :mod:`ckptlib.read.to_safetensors`; a progress bar on a
terminal, one JSON summary with ``--json``. Exit 0 when written, 2 on any error (a corrupt
chunk included: the export stops at it, never writes wrong values, and leaves OUT as it was:
the exporters write into a staging folder beside it, :mod:`ckptlib.read.staging`).
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .output import Output

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1048576"`` -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB or 500MB, got {text!r}")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("export", parents=[common], help="write tensors as zarr3 arrays or safetensors files",
                       description="Export the newest committed step (or step N, or one checkpoint "
                       "folder) as zarr3 arrays (tensorstore, zstd) or Hugging Face-style sharded "
                       "safetensors files, streaming with bounded memory.")
    p.add_argument("url", metavar="URL", help="checkpoint root or checkpoint folder")
    p.add_argument("--step", type=int, metavar="N", help="export step N")
    p.add_argument("--to", dest="to_format", choices=("zarr3", "safetensors"), required=True)
    p.add_argument("out", metavar="OUT", help="output folder (zarr3: also a tensorstore kvstore URL)")
    p.add_argument("--select", metavar="PREFIX", help="only tensors under this path, e.g. model "
                   "(required for safetensors: names become dotted and relative to it)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GiB", metavar="SIZE",
                   help="safetensors: most tensor bytes per file (default 5GiB)")


def cmd_export(args: argparse.Namespace, out: Output) -> int:
    from ckptlib.read.view import open_view

    from .output import CliError, Progress, human_bytes

    if args.to_format == "safetensors" and not args.select:
        raise CliError("--to safetensors needs --select PREFIX (e.g. --select model)")
    with open_view(args.url, args.step, args.storage_options) as view:
        total = sum(i.nbytes for i in view.tensors(args.select))
        if not total and not view.tensors(args.select):
            raise CliError(f"no tensors under {args.select!r} in {view.where}")
        with Progress(out, total, "export", stderr=True) as progress:
            if args.to_format == "zarr3":
                from ckptlib.read.to_zarr3 import export_zarr3

                summary = export_zarr3(view, args.out, args.select, progress.advance)
            else:
                from ckptlib.read.to_safetensors import export_safetensors

                summary = export_safetensors(view, args.out, args.select, args.max_shard_size, progress.advance)
    out.print(f"exported {summary['tensors']} tensors ({human_bytes(summary['bytes'])}) of step "
              f"{summary['step'] if summary['step'] is not None else '-'} to {args.out} as {args.to_format}")
    out.emit(summary)
    out.exit_code = 0
    return 0

