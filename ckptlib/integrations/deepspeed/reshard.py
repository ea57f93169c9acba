"""Serve DeepSpeed, inside one ``load_checkpoint``, a ZeRO tag saved at another data-parallel size.

Every tag saved through ckptlib records its ZeRO partition layout (:mod:`.partitions`, built by
:mod:`.zero`). When the engine that loads it runs at another data-parallel size, the checkpoint
engine (:mod:`.engine`, on the training thread, while DeepSpeed's ``load_checkpoint`` runs)
opens a :class:`Reshard` for the tag (:func:`open_reshard`) and hands DeepSpeed the files this
rank would have written at its own size, so that DeepSpeed's own same-size load path restores
them:

- the model-states file, with ``dp_world_size`` set to the loading size
  (:meth:`Reshard.model_states`): DeepSpeed's size check passes and it asks for this rank's
  optimizer-states file;
- that file, built by :meth:`Reshard.optimizer_states`: what is not partitioned (loss scaler,
  Adam's ``step``, hyperparameters, ``ds_config``) from saved rank 0's file; every partitioned
  tensor (fp32 weights, Adam's moments) filled range by range from the saved ranks' tensors that
  hold its elements (:func:`.partitions.copy_plan`), read by ckptlib's one reader (each range a
  ``Shard`` of the saved tensor, checksums verified); the values that depend on the rank
  (paddings, partition count) from the loading optimizer (:class:`.zero.Target`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptlib.engine.load import Merge, resolve_lazy, run_plan
from ckptlib.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ckptlib.format.dtypes import DTYPES
from ckptlib.format.leaves import Shard
from ckptlib.format.tree import TensorRef
from ckptlib.integrations.deepspeed.codec import decode_value
from ckptlib.integrations.deepspeed.partitions import Copy, Layout, copy_plan
from ckptlib.integrations.deepspeed.tags import TagView
from ckptlib.integrations.deepspeed.zero import BASE_KEYS, FP32_KEYS, Target

log = logging.getLogger("ckptlib")

OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
"""DeepSpeed's per-rank optimizer-states file (``_get_rank_zero_ckpt_name``)."""


def saved_layout(view: TagView) -> Layout | None:
    """The partition layout stored with the tag (None: saved without one)."""
    if view.zero is None:
        return None
    return Layout.from_json(view.zero, f"{view.storage.url.rstrip('/')}/{view.folder}")


def open_reshard(view: TagView, target: Callable[[], Target | None]) -> Reshard | None:
    """A :class:`Reshard` when the tag was saved at another data-parallel size than the
    loading engine's (``target``: its :class:`.zero.Target`, built only when the tag has a
    layout); None when DeepSpeed loads the tag as saved (its layout is then not even read)."""
    if view.zero is None:
        return None
    t = target()
    if t is None or (isinstance(view.zero, dict) and view.zero.get("dp") == t.layout.dp):
        return None
    saved = saved_layout(view)
    assert saved is not None
    if t.layout.optimizer != saved.optimizer:
        raise StateMismatchError(
            f"DeepSpeed tag saved with {saved.optimizer}, loading into {t.layout.optimizer}: "
            "resume with the ZeRO stage and precision it was saved with"
        )
    if len(t.layout.flats) != len(saved.flats):
        raise StateMismatchError(
            f"the checkpoint has {len(saved.flats)} optimizer partitions (parameter groups, or ZeRO-3 "
            f"sub-groups), this engine {len(t.layout.flats)}: keep the parameter groups (and ZeRO-3's "
            "sub_group_size large enough for one sub-group per group)"
        )
    return Reshard(view, saved, t)


@dataclass
class Reshard:
    """One tag served at the loading engine's data-parallel size (see the module docstring)."""

    view: TagView
    saved: Layout
    target: Target
    stats: dict[str, int] = field(default_factory=dict)
    """``bytes_needed`` / ``bytes_read`` of the last :meth:`optimizer_states` (ckptlib's reader)."""

    def model_states(self, name: str, sd: Any) -> None:
        """Adjust a loaded model-states file in place: ``dp_world_size`` is the loading size."""
        if not isinstance(sd, dict):
            return
        if self.saved.style == "per_param" and sd.get("frozen_param_fragments"):
            raise StateMismatchError(
                f"{name}: frozen parameters under ZeRO-3 are saved as per-rank partitions, which "
                "ckptlib does not reshard; resume at the data-parallel size that saved the tag "
                f"({self.saved.dp})"
            )
        sd["dp_world_size"] = self.target.dp_world_size

    def optimizer_states(self, name: str) -> dict[str, Any]:
        """This rank's optimizer-states file at the loading size (see the module docstring)."""
        m = OPTIM_FILE.match(name)
        assert m is not None  # the caller checks with OPTIM_FILE
        if int(m.group(2)) != self.target.rank:
            raise CheckpointError(f"DeepSpeed asked for {name} on data-parallel rank {self.target.rank}")
        where = f"{self.view.storage.url.rstrip('/')}/{self.view.folder}"
        names = [f"{m.group(1) or ''}zero_pp_rank_{r}_mp_rank_{m.group(3)}_optim_states.pt"
                 for r in range(self.saved.dp)]
        lost = [n for n in names if n not in self.view.files]
        if lost:
            raise CorruptCheckpointError(f"ZeRO tag saved by {self.saved.dp} ranks lacks {', '.join(lost)}", where)
        osds = [_at(self.view.files[n], where, "optimizer_state_dict") for n in names]
        fp32_key, base_key = FP32_KEYS[self.saved.optimizer], BASE_KEYS[self.saved.optimizer]
        merge = Merge(self.view.manifest, where=f"{where} [{name}]")
        plans = copy_plan(self.saved, self.target.layout, self.target.rank)
        flats = self.target.layout.flats

        def fill(j: int, source: Callable[[int, int], Any], path: str) -> torch.Tensor:
            return _fill(merge, plans[j], source, flats[j].partition, source(0, j), f"{path}/{j}", where)

        fp32 = [fill(j, lambda r, i: _at(osds[r], where, fp32_key, i), f"{name}/{fp32_key}")
                .narrow(0, 0, self.target.fp32_lengths[j]) for j in range(len(flats))]
        base0 = _at(osds[0], where, base_key)
        state0 = _at(base0, where, "state")
        state = {}
        for j in range(len(flats)):
            if j not in state0:
                continue  # no optimizer step yet
            entry = {}
            for key, v in _at(state0, where, j).items():
                if self._partitioned(v, j):
                    def moment(r: int, i: int, key: Any = key) -> Any:
                        return _at(osds[r], where, base_key, "state", i, key)

                    v = fill(j, moment, f"{name}/{base_key}/state/{key}")
                entry[key] = v
            state[j] = entry
        node = dict(self.view.files[names[0]])
        node["optimizer_state_dict"] = {**osds[0], fp32_key: fp32, base_key: {**base0, "state": state}}
        value = merge.fresh(node)  # what is not partitioned: saved rank 0's, read as saved
        run_plan(merge, self.view.storage, self.view.folder, self.view.manifest, verify=True, stats=self.stats)
        sd = decode_value(resolve_lazy(value), where)
        sd["optimizer_state_dict"].update(self.target.replace)
        log.info("ckptlib: rebuilt %s of DeepSpeed tag saved at data-parallel size %d for size %d "
                 "(%d bytes requested)", name, self.saved.dp, self.target.layout.dp, self.stats.get("bytes_needed", 0))
        return sd

    def _partitioned(self, v: Any, j: int) -> bool:
        """A saved state tensor one element per partition element (Adam's moments), not a
        scalar (``step``)."""
        if not isinstance(v, TensorRef):
            return False
        return self.view.manifest.tensors[v.name].shape == (self.saved.flats[j].partition,)


def _at(node: Any, where: str, *keys: Any) -> Any:
    """``node[k0][k1]...`` of a saved tree, or ``CorruptCheckpointError``."""
    for k in keys:
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            raise CorruptCheckpointError(
                f"ZeRO optimizer state has no {'/'.join(map(str, keys))} (at {k!r})", where
            ) from None
    return node


def _fill(merge: Merge, copies: list[Copy], source: Callable[[int, int], Any], size: int, like: Any,
          path: str, where: str) -> torch.Tensor:
    """A zeroed tensor of ``size`` elements (the dtype of ``like``, a saved tensor) whose
    ``copies`` ``merge`` reads from ``source(saved rank, saved flat)``."""
    if not isinstance(like, TensorRef):
        raise CorruptCheckpointError(f"{path} is not a tensor", where)
    out = torch.zeros(size, dtype=DTYPES[merge.m.tensors[like.name].dtype])
    for c in copies:
        ref = source(c.rank, c.flat)
        if not isinstance(ref, TensorRef):
            raise CorruptCheckpointError(f"{path}: saved rank {c.rank}'s partition {c.flat} is not a tensor", where)
        shape = merge.m.tensors[ref.name].shape
        if len(shape) != 1 or c.src + c.length > shape[0]:
            raise CorruptCheckpointError(
                f"{path}: the partition layout puts elements [{c.src}, {c.src + c.length}) in saved rank "
                f"{c.rank}'s tensor of shape {list(shape)}", where,
            )
        merge.tensor(Shard(out.narrow(0, c.dst, c.length), shape, (c.src,)), ref.name, path)
    return out
