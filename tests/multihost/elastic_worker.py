"""Elastic training worker for test_elastic.py, through hvdp.torch's ElasticState and elastic_run.

Every committed step records, in the elastic state itself, which samples it trained on (all ranks'
batches, allgathered), so the final state says exactly what the final model learned from: the test checks
that each epoch covers every sample exactly once although the world changed size mid-epoch. Rank 0 appends
a progress line per step to --progress (the test watches it to act mid-epoch) and writes --result at the end.
"""

import json
import os
import socket
import time

import torch
import torch.nn.functional as F

import hvdp.torch as ht
from elastic_args import parse_args


def main():
    args = parse_args()

    ht.init()
    hvd = ht.hvd
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 8, generator=g)
    y = (x.sum(1) > 0).long()
    data = torch.utils.data.TensorDataset(x, y, torch.arange(args.samples))
    model = torch.nn.Linear(8, 2)
    optimizer = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                           shard_optimizer_state=args.shard)
    loader = ht.shard(data, batch_size=args.batch_size)
    # --shard: the full optimizer state as committed (gathered on every rank just before each commit), and the
    # number of (re)entries at which this rank found the re-sharded state equal to it
    pending, committed, rebuilt = [None], [None], [0]

    class Recorded(ht.ElasticState):
        def save(self):
            """The reference is the commit this rank saved, once saved: a worker lost after that (in the host
            check state.commit() goes on to) rolls the survivors back to this commit, not the one before."""
            super().save()
            committed[0] = pending[0]

        def check_host_updates(self):
            if args.lost_after_save and socket.gethostname() == "hostb" and os.path.exists(args.lost_after_save):
                os.unlink(args.lost_after_save)
                time.sleep(0.5)  # the other rank, its commit saved too, waits in the host check's broadcast
                os._exit(1)
            super().check_host_updates()

    state = Recorded(model, optimizer, loader, seen={}, sizes=[], lrs={})

    def everywhere():
        """The full optimizer state, gathered on every rank (a test-sized model)."""
        mine = None
        for to in range(hvd.size()):
            full = optimizer.gathered_state_dict(to)
            mine = full if to == hvd.rank() else mine
        return mine

    def commit():
        pending[0] = everywhere() if args.shard else None
        state.commit()

    def readmitted(sizes):
        return any(a > b < c for a, b, c in zip(sizes, sizes[1:], sizes[2:]))

    @ht.elastic_run
    def train(state):
        size = hvd.size()
        if args.shard:  # after a reset, the state re-sharded for this world is the committed one
            now = everywhere()
            if committed[0] is not None:  # a rank of the world of that commit
                same(now, committed[0])
                rebuilt[0] += 1
        if not state.sizes or state.sizes[-1] != size:
            state.sizes.append(size)
        state.lrs[size] = optimizer.param_groups[0]["lr"]
        def more():
            if loader.batch_sampler.position()[1]:
                return True  # finish the epoch a reset interrupted
            return state.epoch < args.epochs or (args.until_readmitted and not readmitted(state.sizes)) or (
                args.until_shrunk and not any(a > b for a, b in zip(state.sizes, state.sizes[1:])))

        while more():
            for xb, yb, idx in loader:
                epoch = state.epoch
                optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
                batches = hvd.allgather_object(idx.tolist(), name="test.seen")
                state.seen.setdefault(epoch, []).extend(i for b in batches for i in b)
                if hvd.rank() == 0:
                    with open(args.progress, "a") as f:
                        f.write(json.dumps({"size": size, "epoch": epoch, "offset": loader.batch_sampler.position()[1],
                                            "batches": batches}) + "\n")
                commit()

    train(state)
    rebuilt[0] = max(hvd.allgather_object(rebuilt[0], name="t.rebuilt"))  # a survivor's count
    if hvd.size() > 1:
        ht.check_consistency(model)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"sizes": state.sizes, "lrs": state.lrs, "seen": state.seen, "samples": args.samples,
                       "rebuilt": rebuilt[0]}, f)


def same(now: dict, then: dict) -> None:
    """The optimizer state `now` is `then`, bit for bit (the momentum of every parameter)."""
    assert sorted(now["state"]) == sorted(then["state"]), (sorted(now["state"]), sorted(then["state"]))
    for i, entry in then["state"].items():
        for k, v in entry.items():
            assert torch.equal(now["state"][i][k], v), f"parameter {i}, {k}: the re-sharded state differs"


if __name__ == "__main__":
    main()
