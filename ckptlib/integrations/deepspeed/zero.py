"""What a live DeepSpeed engine's ZeRO optimizer holds: its partition layout and this rank's place.

The one module that reads DeepSpeed 0.19's optimizer internals (there is no public API for
the layout; DeepSpeed's own ``ds_to_universal`` reads the same attributes). Called on the
training thread: :func:`describe` by the checkpoint engine's ``commit`` (every save, every
rank: the layout stored with the tag) and by :mod:`.reshard` through :func:`target` when a tag
saved at another data-parallel size is loaded. Both return None for what ckptlib does not
reshard (docs/integrations/deepspeed.md, "Another data-parallel size"), and never raise: a
configuration this module does not know only turns resharding off for that tag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ckptlib.integrations.deepspeed.partitions import STYLES, Flat, Layout

log = logging.getLogger("ckptlib")

FP32_KEYS = {
    "DeepSpeedZeroOptimizer": "single_partition_of_fp32_groups",
    "BF16_Optimizer": "single_partition_of_fp32_groups",
    "DeepSpeedZeroOptimizer_Stage3": "fp32_flat_groups",
}
"""Key of the fp32 partitions (one tensor per flat) in each optimizer's state dict."""
BASE_KEYS = {
    "DeepSpeedZeroOptimizer": "base_optimizer_state",
    "BF16_Optimizer": "base_optimizer_state",
    "DeepSpeedZeroOptimizer_Stage3": "optimizer_state_dict",
}
"""Key of the wrapped torch optimizer's state dict (its ``state`` has one entry per flat)."""


@dataclass(slots=True)
class Target:
    """The engine a tag is loaded into: its layout, this rank, and the values of its optimizer
    that differ by rank or data-parallel size (put into the state dict served to it)."""

    layout: Layout
    rank: int
    dp_world_size: int
    """What DeepSpeed compares with the checkpoint's ``dp_world_size``."""
    fp32_lengths: list[int]
    """Length of this rank's saved fp32 tensor per flat (ZeRO 1/2 saves them without padding)."""
    replace: dict[str, Any] = field(default_factory=dict)
    """``optimizer_state_dict`` entries this rank would have saved (paddings, partition count)."""


def describe(engine: Any) -> Layout | None:
    """The partition layout of ``engine``'s ZeRO optimizer, or None (not ZeRO, or a
    configuration ckptlib does not reshard: MoE, pipeline or model parallelism, offload,
    elastic checkpoints, hierarchical partitioning)."""
    try:
        return _describe(engine)
    except (AttributeError, TypeError, ValueError, KeyError) as e:  # another DeepSpeed's internals
        log.warning("ckptlib: cannot describe this DeepSpeed optimizer's partitions (%s: %s); "
                    "its checkpoints load only at the same data-parallel size", type(e).__name__, e)
        return None


def _describe(engine: Any) -> Layout | None:
    opt: Any = getattr(engine, "optimizer", None)
    kind = type(opt).__name__
    if kind not in STYLES or not _plain(engine, opt):
        return None
    import deepspeed.comm as dist

    dp = dist.get_world_size(group=opt.dp_process_group)
    if dp != engine.seq_dp_world_size:
        return None
    names = engine.param_names
    flats = []
    if kind == "DeepSpeedZeroOptimizer":
        if any(dist.get_world_size(group=g) != dp for g in opt.real_dp_process_group):
            return None
        for params, offsets, flat in zip(opt.round_robin_bit16_groups, opt.round_robin_bit16_offsets,
                                         opt.bit16_groups_flat, strict=True):
            flats.append(Flat(tuple(names[p] for p in params), tuple(p.numel() for p in params),
                              tuple(offsets), flat.numel() // dp))
    elif kind == "BF16_Optimizer":
        if any(dist.get_world_size(group=g) != dp for g in opt.real_dp_process_group):
            return None
        for params, flat in zip(opt.bf16_groups, opt.bf16_groups_flat, strict=True):
            offsets, at = [], 0
            for p in params:  # laid end to end (no alignment between parameters)
                offsets.append(at)
                at += p.numel()
            flats.append(Flat(tuple(names[p] for p in params), tuple(p.numel() for p in params),
                              tuple(offsets), flat.numel() // dp))
    else:
        if any(c != dp for c in opt.sub_group_partition_counts):
            return None
        for params in opt.fp16_groups:
            parts = [p.partition_numel() for p in params]
            offsets = [sum(parts[:k]) for k in range(len(parts))]
            flats.append(Flat(tuple(names[p] for p in params), tuple(p.ds_numel for p in params),
                              tuple(offsets), sum(parts), tuple(parts)))
    return Layout(kind, dp, tuple(flats))


def _plain(engine: Any, opt: Any) -> bool:
    """No MoE, pipeline/model parallelism, optimizer offload or elastic checkpoints."""
    if engine.has_moe_layers or engine.mp_world_size != 1 or type(engine).__name__ != "DeepSpeedEngine":
        return False
    if getattr(opt, "elastic_checkpoint", False) or getattr(opt, "cpu_offload", False):
        return False
    return not (getattr(opt, "offload_optimizer", False) or getattr(opt, "offload_param", False))


def target(engine: Any) -> Target | None:
    """The loading side: ``engine``'s layout and this rank's values (None as :func:`describe`)."""
    layout = describe(engine)
    if layout is None:
        return None
    try:
        return _target(engine, layout)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        log.warning("ckptlib: cannot read this DeepSpeed optimizer's partitions (%s: %s); "
                    "checkpoints load only at the data-parallel size that saved them", type(e).__name__, e)
        return None


def _target(engine: Any, layout: Layout) -> Target:
    import deepspeed.comm as dist

    opt = engine.optimizer
    rank = dist.get_rank(group=opt.dp_process_group)
    replace: dict[str, Any] = {"partition_count": opt.partition_count}
    if layout.optimizer == "DeepSpeedZeroOptimizer":
        lengths = [t.numel() - pad for t, pad in zip(opt.single_partition_of_fp32_groups, opt.groups_padding,
                                                      strict=True)]
        replace.update(group_paddings=opt.groups_padding, param_alignment_paddings=opt.round_robin_bit16_padding,
                       param_slice_mappings=opt._param_slice_mappings)
    elif layout.optimizer == "BF16_Optimizer":
        lengths = [t.numel() for t in opt.fp32_groups_flat_partition]
        replace.update(group_paddings=opt.group_paddings, param_slice_mappings=opt._param_slice_mappings)
    else:
        lengths = [f.partition for f in layout.flats]
    return Target(layout, rank, int(engine.seq_dp_world_size), lengths, replace)
