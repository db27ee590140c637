"""A Lightning run that never imports TraceML (unless ``--callback``).

``Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=--steps)`` on a tiny MLP and
a synthetic dataset, under torchrun (Lightning sees torchelastic's variables and uses its
ranks). With ``--callback`` the Trainer gets ``traceml.integrations.lightning.TraceMLCallback``.
"""

import lightning.pytorch as pl
import torch
from synthetic import arguments
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    args = arguments(8, framework=True).parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    callbacks = []
    if args.callback:
        from traceml.integrations.lightning import TraceMLCallback

        callbacks.append(TraceMLCallback())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
