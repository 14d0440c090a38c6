"""Ranks that block outside the gradient all-reduce, on purpose: `collective_worker.py SCENARIO`.

loader: rank 1's DataLoader never delivers a batch (a worker stuck in __getitem__, as one deadlocked at its
    start would be), while rank 0 reads its epoch and waits in hvd.allgather_object;
mismatch: rank 0 calls hvd.broadcast_object alone, while rank 1 goes on to prepare() (its model check's
    allgather, then its broadcast): both blocked in collectives the other never submits;
shapes: the ranks all-reduce one tensor name with different shapes: Horovod raises on every rank, and each
    writes its last collectives.

Each rank prints how far it got; the watchdog is to end the job naming where each rank is. Run by
tests/faults/test_hangs.py under horovodrun, MPI and Gloo.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

import hvdp.torch as ht  # noqa: E402


class Stalling(torch.utils.data.Dataset):
    """Sample i is i; on a stalling rank every sample a loader worker reads takes an hour."""

    def __init__(self, stall: bool):
        self.stall = stall

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if self.stall and torch.utils.data.get_worker_info() is not None:  # in the loader's workers (shard()
            time.sleep(3600)                                                # reads a few items itself first)
        return torch.tensor([i])


def main() -> None:
    scenario = sys.argv[1]
    world = ht.init()
    hvd = ht.hvd
    if scenario == "loader":
        loader = ht.shard(Stalling(stall=world.rank == 1), batch_size=4, num_workers=2)
        read = [int(i) for batch in loader for i in batch.flatten()]
        print(f"collective: rank {world.rank} read its epoch, entering allgather_object", flush=True)
        hvd.allgather_object(read, name="epoch.samples")
    elif scenario == "mismatch":
        if world.rank == 0:
            print("collective: rank 0 entering broadcast_object", flush=True)
            hvd.broadcast_object({"lr": 0.1}, root_rank=0, name="config")
        else:
            print(f"collective: rank {world.rank} entering prepare()", flush=True)
            model = torch.nn.Linear(4, 2)
            ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    elif scenario == "shapes":  # the same collective with other shapes: Horovod raises on every rank at once
        try:
            hvd.allreduce(torch.zeros(2 + world.rank), name="grads.fc")
        except Exception as e:  # noqa: BLE001
            print(f"collective: rank {world.rank} raised {type(e).__name__}", flush=True)
            raise SystemExit(1)
    print(f"collective: rank {world.rank} finished without noticing", flush=True)


if __name__ == "__main__":
    main()
