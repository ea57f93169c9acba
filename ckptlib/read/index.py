"""numpy-style indices -> the box to read and what to apply to it. Pure.

Called by :meth:`ckptlib.read.view.CheckpointView.read` (caller's thread) before it asks the
reader for one box: the box is the smallest region covering the index, so only chunks
overlapping it are fetched; ``post`` (steps, dropped integer dimensions) is applied to the box.
"""

from __future__ import annotations

from typing import Any

Index = Any  # int | slice | Ellipsis | None | tuple of int/slice/Ellipsis


def plan_box(shape: tuple[int, ...], index: Index) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """``(box offset, box shape, post index)`` for ``index`` into a tensor of ``shape``.

    Raises ``IndexError`` for an index that does not fit (too many dimensions, out of range,
    negative steps) and ``TypeError`` for anything but ints, slices and one ``...``.
    """
    items = index if isinstance(index, tuple) else (() if index is None else (index,))
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1 :]
    if len(items) > len(shape):
        raise IndexError(f"too many indices: {len(items)} for a tensor of {len(shape)} dimensions")
    items = items + (slice(None),) * (len(shape) - len(items))
    offset: list[int] = []
    box: list[int] = []
    post: list[int | slice] = []
    for d, (i, n) in enumerate(zip(items, shape, strict=True)):
        if isinstance(i, bool) or not isinstance(i, int | slice):
            raise TypeError(f"index for dimension {d} must be an int or a slice, not {type(i).__name__}")
        if isinstance(i, int):
            j = i + n if i < 0 else i
            if not 0 <= j < n:
                raise IndexError(f"index {i} is out of bounds for dimension {d} of size {n}")
            offset.append(j)
            box.append(1)
            post.append(0)
            continue
        start, stop, step = i.indices(n)
        if step <= 0:
            raise IndexError(f"dimension {d}: only positive slice steps are supported")
        count = len(range(start, stop, step))
        offset.append(start if count else 0)
        box.append((count - 1) * step + 1 if count else 0)
        post.append(slice(None, None, step))
    return tuple(offset), tuple(box), tuple(post)
