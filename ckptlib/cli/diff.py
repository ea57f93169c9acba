"""``ckptlib diff URL_A URL_B [--step-a N] [--step-b M]``: which tensors differ.

Registered by :mod:`ckptlib.cli.main` (:func:`add_parser`), which calls :func:`cmd_diff` on
the command's worker thread (cli/deadline.py); the comparison is :func:`ckptlib.read.compare.compare`. Exit status: 0 when
the tensors are identical (same names, dtypes, shapes and bytes), 1 when they differ, 2 on a
usage or access error (a corrupt chunk included).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .output import Output

EXIT_SAME, EXIT_DIFFERENT = 0, 1


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("diff", parents=[common], help="compare the tensors of two checkpoints (exit 1 if they differ)",
                       description="Compare the tensors of two steps or checkpoints: tensors only on one "
                       "side, dtype or shape changes, changed values with the max abs difference. "
                       "Exit 0 if identical, 1 if they differ, 2 on error.")
    p.add_argument("url_a", metavar="URL_A", help="checkpoint root or checkpoint folder")
    p.add_argument("url_b", metavar="URL_B", help="checkpoint root or checkpoint folder (may equal URL_A)")
    p.add_argument("--step-a", type=int, metavar="N", help="step of URL_A (default: newest committed)")
    p.add_argument("--step-b", type=int, metavar="M", help="step of URL_B (default: newest committed)")
    p.set_defaults(url="")


def cmd_diff(args: argparse.Namespace, out: Output) -> int:
    from ckptlib.read.compare import compare
    from ckptlib.read.view import open_view

    with open_view(args.url_a, args.step_a, args.storage_options) as a, \
            open_view(args.url_b, args.step_b, args.storage_options) as b:
        result = compare(a, b)
    code = EXIT_SAME if result["identical"] else EXIT_DIFFERENT
    out.exit_code = code
    out.emit({**result, "exit_code": code})
    if result["identical"]:
        out.print(f"identical: {result['same']} tensors")
        return code
    from rich.table import Table

    table = Table("tensor", "change", "dtype", "shape", "changed", "max abs diff", box=None)
    for name in result["only_a"]:
        table.add_row(name, "only in A", "", "", "", "")
    for name in result["only_b"]:
        table.add_row(name, "only in B", "", "", "", "")
    for r in result["changed"]:
        dtype = r["dtype_a"] if r["dtype_a"] == r["dtype_b"] else f"{r['dtype_a']} -> {r['dtype_b']}"
        shape = str(r["shape_a"]) if r["shape_a"] == r["shape_b"] else f"{r['shape_a']} -> {r['shape_b']}"
        counts = f"{r['changed']}/{r['elements']}" if r["kind"] == "values" else ""
        worst = f"{r['max_abs_diff']:.6g}" if r["kind"] == "values" else ""
        table.add_row(r["name"], r["kind"], dtype, shape, counts, worst)
    out.print(table)
    out.print(f"{len(result['changed'])} changed, {len(result['only_a'])} only in A, "
              f"{len(result['only_b'])} only in B, {result['same']} identical")
    return code
