"""A tiny Lightning training run checkpointed through ckptlib (tests/integrations/test_lightning.py).

usage: lightning_worker.py ROOT IO EPOCHS
IO: ``sync`` (CkptlibCheckpointIO) or ``async`` (wrapped in Lightning's AsyncCheckpointIO).
Trains EPOCHS epochs with a shuffling data loader and dropout (so resuming bitwise needs the
RNG states too), saving a checkpoint every epoch under ROOT/ckpt; resumes from
``newest_checkpoint`` if there is one. A test kills it mid-run with CKPTLIB_TEST_KILL_AT.
Writes ROOT/result.json: the resumed-from path and the final weights' bytes (hex).
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from ckptlib.integrations.lightning import CkptlibCheckpointIO, RNGCallback, newest_checkpoint


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)]


def main() -> None:
    root, io, epochs = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    plugin = CkptlibCheckpointIO() if io == "sync" else AsyncCheckpointIO(CkptlibCheckpointIO())
    ckpt_dir = root / "ckpt"
    resume_from = newest_checkpoint(ckpt_dir) if ckpt_dir.exists() else None
    trainer = L.Trainer(
        max_epochs=epochs, plugins=[plugin], logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, deterministic=True,
        callbacks=[RNGCallback(), ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)],
    )
    model = Tiny()
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=resume_from)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    (root / "result.json").write_text(json.dumps({
        "resumed_from": resume_from, "weights": weights.numpy().tobytes().hex(),
        "global_step": trainer.global_step,
    }))


if __name__ == "__main__":
    main()
