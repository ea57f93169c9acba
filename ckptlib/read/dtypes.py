"""How each format dtype (``ckptlib.format.dtypes``) is handed to numpy, tensorstore, zarr3 and
safetensors. Pure.

zarr3's core data types cover float16/32/64, complex64/128, signed and unsigned ints and bool.
The others (bfloat16, every float8 variant, complex32) are exported as their raw bits: an
unsigned int of the same width, with the original dtype name in the array's attributes.
tensorstore's own arrays (``CheckpointView.array``) use its native bfloat16/float8 types where
it has them. safetensors has no complex32, complex128 or float8_e8m0fnu.
"""

from __future__ import annotations

import numpy as np
import torch

from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.safetensors import (
    SAFETENSORS as SAFETENSORS,  # the one table (reading and writing)
)

ZARR3_NATIVE = frozenset({
    "float64", "float32", "float16", "complex64", "complex128", "bool",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
})
TENSORSTORE_NATIVE = ZARR3_NATIVE | {
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
}
_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def bits_dtype(name: str) -> str:
    """The unsigned int dtype name of the same width as ``name``."""
    return f"uint{8 * ITEMSIZE[name]}"


def zarr3_dtype(name: str) -> str:
    """The zarr3 ``data_type`` written for a tensor of dtype ``name``."""
    return name if name in ZARR3_NATIVE else bits_dtype(name)


def to_numpy(t: torch.Tensor, name: str, native: frozenset[str] = ZARR3_NATIVE) -> np.ndarray:
    """``t`` (dtype ``name``, CPU) as a numpy array: itself when ``name`` is in ``native``,
    else its raw bits as an unsigned int array (same shape, no copy)."""
    if name in native and name in ZARR3_NATIVE:
        return t.numpy()
    return t.contiguous().view(_BITS[ITEMSIZE[name]]).numpy()
