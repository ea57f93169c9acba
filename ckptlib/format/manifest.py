"""The v1 manifest, by concern: the names other modules import, in one place. Pure.

- :mod:`ckptlib.format.schema`: the records (:class:`Manifest`, :class:`TensorEntry`, ...) and
  the format's constants;
- :mod:`ckptlib.format.build`: the body from the ranks' write results, and its bytes
  (:func:`build_body`, :func:`encode_body`, :func:`encode`);
- :mod:`ckptlib.format.decode`: parse and validate untrusted bytes (:func:`decode`);
- :mod:`ckptlib.format.packed_table`: the columnar ``packed_tensors`` table.
"""

from __future__ import annotations

from ckptlib.format import schema
from ckptlib.format.build import build_body, encode, encode_body, to_body
from ckptlib.format.decode import check_path, decode
from ckptlib.format.packed_table import TABLE_COLUMNS, TABLE_KEY, PackedTable
from ckptlib.format.schema import *  # noqa: F403 - the records and constants, listed in schema.__all__
from ckptlib.format.validate import MAX_NDIM

__all__ = [
    *schema.__all__, "MAX_NDIM", "TABLE_COLUMNS", "TABLE_KEY", "PackedTable", "build_body", "check_path", "decode",
    "encode", "encode_body", "to_body",
]
