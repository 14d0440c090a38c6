"""A Trainer.fit on strategy="hvdp" in which rank 1 SIGKILLs itself as optimizer step 3 begins (a dead rank);
run by tests/lightning/test_lightning.py, which checks that the job ends soon, naming rank 1."""

import os
import signal
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdp.lightning  # noqa: E402, F401  (strategy="hvdp")

warnings.filterwarnings("ignore")


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 2)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.global_step == 3:
            print(f"rank 1: SIGKILL at step {self.trainer.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


x = torch.randn(4096, 6, generator=torch.Generator().manual_seed(0))  # the same data on every rank
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :2]), batch_size=4, shuffle=True)
pl.Trainer(strategy="hvdp", accelerator="cpu", max_epochs=50, logger=False, enable_checkpointing=False,
           enable_progress_bar=False, enable_model_summary=False).fit(Net(), loader)
print("finished without noticing the dead rank", flush=True)
