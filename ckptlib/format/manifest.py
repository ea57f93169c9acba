"""The v1 manifest's names in one place (pure): records and constants from
:mod:`~ckptlib.format.schema`, bytes from :mod:`~ckptlib.format.build`, validation from
:mod:`~ckptlib.format.decode`, the ``packed_tensors`` table from :mod:`~ckptlib.format.packed_table`.
"""

from __future__ import annotations

from ckptlib.format import schema
from ckptlib.format.build import build_body, encode, encode_body, to_body
from ckptlib.format.decode import check_built, check_path, decode
from ckptlib.format.packed_table import TABLE_COLUMNS, TABLE_KEY, PackedTable
from ckptlib.format.schema import *  # noqa: F403 - the records and constants, listed in schema.__all__
from ckptlib.format.validate import MAX_NAME, MAX_NDIM

__all__ = [
    *schema.__all__, "MAX_NAME", "MAX_NDIM", "TABLE_COLUMNS", "TABLE_KEY", "PackedTable", "build_body", "check_built", "check_path", "decode",
    "encode", "encode_body", "to_body",
]
