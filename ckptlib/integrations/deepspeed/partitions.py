"""Which elements of which parameter each rank's flat ZeRO partition holds. Pure (ints only).

A ZeRO optimizer keeps, on every data-parallel rank, one flat fp32 tensor per *flat* (a
parameter group under ZeRO 1/2 and DeepSpeed's bf16 optimizer, a sub-group under ZeRO 3) and
optimizer-state tensors (Adam's moments) of the same length. A :class:`Layout` records, by
parameter name, where every parameter's elements sit in those tensors at one data-parallel
size; two styles cover DeepSpeed 0.19's optimizers:

- ``flat`` (``DeepSpeedZeroOptimizer``, ``BF16_Optimizer``): the group's parameters lie end to
  end in one buffer (parameter ``k`` at ``offsets[k]``, alignment gaps allowed), cut into
  ``dp`` equal parts of ``partition`` elements; rank ``r`` holds ``[r * partition, (r + 1) *
  partition)``.
- ``per_param`` (``DeepSpeedZeroOptimizer_Stage3``): every parameter is cut into ``dp`` equal
  parts of ``parts[k]`` elements (the last padded); rank ``r`` holds part ``r`` of each, laid
  end to end (parameter ``k``'s part at ``offsets[k]``), ``partition`` elements in all.

Who calls what: :mod:`.zero` builds the layout of a live engine (:meth:`Layout.to_json` is
stored with every tag, :meth:`Layout.from_json` reads it back and validates it);
:mod:`.reshard` calls :func:`copy_plan` for the rank that loads, on the training thread.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from ckptlib.errors import CorruptCheckpointError, StateMismatchError

VERSION = 1
STYLES = {
    "DeepSpeedZeroOptimizer": "flat",
    "BF16_Optimizer": "flat",
    "DeepSpeedZeroOptimizer_Stage3": "per_param",
}
"""DeepSpeed optimizer class -> how it lays parameters out."""


@dataclass(frozen=True, slots=True)
class Flat:
    """One flat: its parameters (in buffer order) and how many elements each rank holds."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    """``flat``: each parameter's offset in the whole buffer; ``per_param``: in a rank's part."""
    partition: int
    """Elements of this flat on each rank (the length of a rank's fp32 tensor, padding included)."""
    parts: tuple[int, ...] = ()
    """``per_param`` only: each parameter's elements per rank."""


@dataclass(frozen=True, slots=True)
class Copy:
    """Elements ``[src, src + length)`` of rank ``rank``'s saved tensor of flat ``flat`` go to
    ``[dst, dst + length)`` of the loading rank's tensor."""

    rank: int
    flat: int
    src: int
    dst: int
    length: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every parameter's elements sit in the flat partitions at data-parallel size ``dp``."""

    optimizer: str
    dp: int
    flats: tuple[Flat, ...]

    @property
    def style(self) -> str:
        return STYLES[self.optimizer]

    def to_json(self) -> dict[str, Any]:
        flats = []
        for f in self.flats:
            d: dict[str, Any] = {"names": list(f.names), "numels": list(f.numels),
                                 "offsets": list(f.offsets), "partition": f.partition}
            if self.style == "per_param":
                d["parts"] = list(f.parts)
            flats.append(d)
        return {"version": VERSION, "optimizer": self.optimizer, "dp": self.dp, "flats": flats}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Layout:
        """The layout stored with a tag; ``CorruptCheckpointError`` unless it is well formed
        (every parameter inside the partitions, none overlapping, names unique)."""
        def bad(msg: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"ZeRO partition layout: {msg}", where)

        if not isinstance(obj, dict) or obj.get("version") != VERSION:
            raise bad(f"not a version {VERSION} layout")
        optimizer, dp, flats = obj.get("optimizer"), obj.get("dp"), obj.get("flats")
        if optimizer not in STYLES:
            raise bad(f"unknown optimizer {optimizer!r}")
        if not isinstance(dp, int) or not _count(dp) or dp == 0 or not isinstance(flats, list):
            raise bad("needs dp >= 1 and a list of flats")
        out, seen = [], set()
        for i, f in enumerate(flats):
            if not isinstance(f, dict):
                raise bad(f"flat {i} is not a dict")
            names, numels, offsets, partition = f.get("names"), f.get("numels"), f.get("offsets"), f.get("partition")
            parts = f.get("parts", []) if STYLES[optimizer] == "per_param" else []
            lists = (names, numels, offsets) + ((parts,) if STYLES[optimizer] == "per_param" else ())
            if not all(isinstance(x, list) and len(x) == len(names or []) for x in lists) \
                    or not isinstance(partition, int) or not _count(partition):
                raise bad(f"flat {i}: names, numels, offsets (and parts) must be lists of one length, partition an int")
            assert isinstance(names, list) and isinstance(numels, list) and isinstance(offsets, list)
            if not all(isinstance(n, str) for n in names) or not all(map(_count, numels + offsets + parts)):
                raise bad(f"flat {i}: names must be str, sizes non-negative ints")
            end = 0
            for k, name in enumerate(names):
                if name in seen:
                    raise bad(f"parameter {name!r} appears twice")
                seen.add(name)
                size = numels[k] if STYLES[optimizer] == "flat" else parts[k]
                if offsets[k] < end or (STYLES[optimizer] == "per_param" and parts[k] * dp < numels[k]):
                    raise bad(f"flat {i}: parameter {name!r} overlaps the one before it or does not fit its parts")
                end = offsets[k] + size
            if end > (partition * dp if STYLES[optimizer] == "flat" else partition):
                raise bad(f"flat {i}: parameters end at {end}, beyond the partitions")
            out.append(Flat(tuple(names), tuple(numels), tuple(offsets), partition, tuple(parts)))
        return cls(optimizer, dp, tuple(out))

    # -- where elements are
    def held(self, flat: int, rank: int) -> list[tuple[int, int, int, int]]:
        """``(k, start, length, local)`` for every run of parameter ``k``'s elements ``[start,
        start + length)`` that rank ``rank`` holds in flat ``flat``, at ``local`` in its tensor."""
        f = self.flats[flat]
        out = []
        if self.style == "flat":
            lo, hi = rank * f.partition, (rank + 1) * f.partition
            ends = [o + n for o, n in zip(f.offsets, f.numels, strict=True)]
            for k in range(bisect_right(ends, lo), len(f.names)):  # from the first one ending after lo
                if f.offsets[k] >= hi:
                    break
                a, b = max(lo, f.offsets[k]), min(hi, ends[k])
                if a < b:
                    out.append((k, a - f.offsets[k], b - a, a - lo))
            return out
        for k, (numel, part, off) in enumerate(zip(f.numels, f.parts, f.offsets, strict=True)):
            start = rank * part
            if start < numel:
                out.append((k, start, min(part, numel - start), off))
        return out

    def locate(self, flat: int, k: int, start: int, length: int) -> list[tuple[int, int, int, int]]:
        """``(rank, local, start, length)`` runs covering elements ``[start, start + length)``
        of parameter ``k`` of flat ``flat``: held by ``rank`` at ``local``."""
        f = self.flats[flat]
        shift, unit, add = (f.offsets[k], f.partition, 0) if self.style == "flat" else (0, f.parts[k], f.offsets[k])
        out = []
        e, end = start, start + length
        while e < end:
            pos = shift + e
            rank = pos // unit
            n = min(end - e, (rank + 1) * unit - pos)
            out.append((rank, pos - rank * unit + add, e, n))
            e += n
        return out


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def copy_plan(saved: Layout, current: Layout, rank: int) -> list[list[Copy]]:
    """For each flat of ``current``: the copies that fill rank ``rank``'s tensors from the
    tensors the ``saved`` ranks wrote, adjacent copies merged. Raises
    :class:`StateMismatchError` (before anything is read) when the two layouts do not hold
    the same parameters with the same sizes."""
    index = {name: (i, k, n) for i, f in enumerate(saved.flats)
             for k, (name, n) in enumerate(zip(f.names, f.numels, strict=True))}
    ours = {name: n for f in current.flats for name, n in zip(f.names, f.numels, strict=True)}
    missing = sorted(set(ours) - set(index))
    extra = sorted(set(index) - set(ours))
    wrong = sorted(f"{name} ({index[name][2]} saved, {n} now)" for name, n in ours.items()
                   if name in index and index[name][2] != n)
    if missing or extra or wrong:
        parts = [f"{what}: {', '.join(v[:10])}{' ...' if len(v) > 10 else ''}"
                 for what, v in (("not in the checkpoint", missing), ("not in the model", extra),
                                 ("different sizes", wrong)) if v]
        raise StateMismatchError("the ZeRO checkpoint's parameters do not match the model's; " + "; ".join(parts))
    plans = []
    for j, f in enumerate(current.flats):
        copies: list[Copy] = []
        for k, start, length, local in current.held(j, rank):
            i, ks, _ = index[f.names[k]]
            for r, src, e, n in saved.locate(i, ks, start, length):
                c = Copy(r, i, src, local + (e - start), n)
                last = copies[-1] if copies else None
                if last and (last.rank, last.flat) == (c.rank, c.flat) and last.src + last.length == c.src \
                        and last.dst + last.length == c.dst:
                    copies[-1] = Copy(c.rank, c.flat, last.src, last.dst, last.length + c.length)
                else:
                    copies.append(c)
        plans.append(copies)
    return plans
