"""A Trainer.fit on HorovodStrategy(preemption=True) in which rank 1 gets SIGTERM as optimizer step 3 begins (a
scheduler's preemption), unless the Trainer's directory (argv[1]) holds Lightning's HPC checkpoint already: then the
run is the requeued one, which fit(ckpt_path=None) resumes from it under Slurm (SLURM_NTASKS set). Prints
"result: {json}" when fit ends: the largest weight difference from one process with the global batch over the
whole run. Run by tests/lightning/test_lightning.py."""

import json
import os
import signal
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdp.torch as ht  # noqa: E402
from tests.lightning import worker_lightning as wl  # noqa: E402  (its Net, data and one-process reference)

warnings.filterwarnings("ignore")
directory = Path(sys.argv[1])
wl.world = ht.init()
requeued = any(directory.glob("hpc_ckpt_*.ckpt"))


class Preempted(wl.Net):
    def training_step(self, batch, batch_idx):
        if not requeued and self.global_rank == 1 and self.trainer.global_step == 3:
            print("rank 1: SIGTERM at step 3", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


dataset = wl.data(wl.n_train())
module = Preempted("sgd", scheduler=True)
trainer = wl.trainer(strategy=wl.hl.HorovodStrategy(seed=wl.SEED, preemption=True), default_root_dir=directory)
trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=wl.B, shuffle=True))
dw = wl.max_dw(module, wl.reference(module, dataset, epochs=2))
if wl.world.rank == 0:
    print("result: " + json.dumps({"max_dw": dw, "requeued": requeued, "global_step": trainer.global_step,
                                   "ckpt_path": str(trainer.ckpt_path)}), flush=True)
