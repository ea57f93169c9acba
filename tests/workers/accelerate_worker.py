"""A tiny Accelerate training run checkpointed through ckptlib (tests/integrations/test_accelerate.py).

usage: accelerate_worker.py ROOT EPOCHS [SEEDABLE]
Trains EPOCHS epochs (shuffling loader, dropout, AdamW, a scheduler, a registered custom
object) and saves the whole accelerator state at the end of every epoch through an async
CheckpointManager; resumes first with ``load_state``. A test kills it inside a save with
CKPTLIB_TEST_KILL_AT. Writes ROOT/result.json: resumed step, final weights (hex), counter.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

import ckptlib
from ckptlib.integrations.accelerate import load_state, save_state


class Counter:
    """A custom object registered for checkpointing; its state holds NumPy values."""

    def __init__(self) -> None:
        self.seen = 0
        self.history = np.zeros(3)

    def state_dict(self) -> dict:
        return {"seen": np.int64(self.seen), "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])
        self.history = np.asarray(state["history"])


def main() -> None:
    root, epochs = Path(sys.argv[1]), int(sys.argv[2])
    seedable = len(sys.argv) > 3 and sys.argv[3] == "seedable"
    warnings.filterwarnings("ignore")
    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, opt, loader, sched = accelerator.prepare(model, opt, DataLoader(data, batch_size=8, shuffle=True), sched)
    with ckptlib.CheckpointManager(root / "ckpt", keep_last=2) as mgr:
        start = load_state(accelerator, mgr) or 0
        for epoch in range(start, epochs):
            if seedable:
                loader.set_epoch(epoch)
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                counter.seen += 1
                counter.history[counter.seen % 3] += float(loss)
            save_state(accelerator, mgr, epoch + 1, metrics={"loss": float(loss)})
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    (root / "result.json").write_text(json.dumps({
        "resumed": start, "weights": weights.numpy().tobytes().hex(), "seen": counter.seen,
        "history": counter.history.tolist(), "lr": sched.get_last_lr(),
    }))


if __name__ == "__main__":
    main()
