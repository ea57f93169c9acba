"""Compare the tensors of two checkpoints (``ckptlib diff``), block by block.

Called by :mod:`ckptlib.cli.diff` or directly, on the caller's thread. Tensors are equal when
their dtype, shape and bytes are equal (so NaNs in the same places with the same bits are
equal). For a changed tensor of equal dtype and shape, ``max_abs_diff`` is the largest
``|a - b|`` computed in float64 (complex: the modulus; bits-only dtypes such as float8 are
compared after conversion to float32), ``changed`` the number of differing elements.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ckptlib.read.view import CheckpointView


def _block_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    if not a.numel():  # e.g. shape (3, 0): nothing differs (and no bytes per element to reshape by)
        return 0, 0.0
    ba = a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1)
    bb = b.reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    changed = int((ba != bb).any(dim=1).sum())
    if not changed:
        return 0, 0.0
    if a.dtype.is_complex:
        d = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    else:
        wide = torch.float32 if a.dtype.itemsize == 1 and a.dtype.is_floating_point else torch.float64
        d = (a.to(wide).to(torch.float64) - b.to(wide).to(torch.float64)).abs()
    d = d[~torch.isnan(d)]
    return changed, float(d.max()) if d.numel() else math.nan


def compare(a: CheckpointView, b: CheckpointView) -> dict[str, Any]:
    """The difference between ``a`` and ``b``: ``identical``, ``only_a``, ``only_b`` (names),
    ``changed`` (one row per differing tensor: name, kind ``dtype``/``shape``/``values``,
    dtypes, shapes, ``changed`` element count, ``max_abs_diff``), ``same`` (count)."""
    ta = {i.name: i for i in a.tensors()}
    tb = {i.name: i for i in b.tensors()}
    changed: list[dict[str, Any]] = []
    same = 0
    for name in sorted(ta.keys() & tb.keys()):
        ia, ib = ta[name], tb[name]
        row: dict[str, Any] = {"name": name, "dtype_a": ia.dtype, "dtype_b": ib.dtype,
                               "shape_a": list(ia.shape), "shape_b": list(ib.shape)}
        if ia.dtype != ib.dtype or ia.shape != ib.shape:
            row["kind"] = "dtype" if ia.dtype != ib.dtype else "shape"
            changed.append(row)
            continue
        count, worst = 0, 0.0
        for (_, x), (_, y) in zip(a.blocks(name), b.blocks(name), strict=True):
            n, m = _block_diff(x, y)
            count += n
            worst = m if math.isnan(m) or math.isnan(worst) else max(worst, m)
        if count:
            changed.append({**row, "kind": "values", "changed": count, "elements": math.prod(ia.shape),
                            "max_abs_diff": worst})
        else:
            same += 1
    only_a, only_b = sorted(ta.keys() - tb.keys()), sorted(tb.keys() - ta.keys())
    return {"step_a": a.step, "step_b": b.step, "identical": not (changed or only_a or only_b),
            "same": same, "changed": changed, "only_a": only_a, "only_b": only_b}
