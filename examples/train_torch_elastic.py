"""Train the digits CNN with Horovod elastic: the job survives a lost worker and grows when hosts come back.

    horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script ./discover.sh \
        --network-interface eth1 --blacklist-cooldown-range 60 300 python examples/train_torch_elastic.py
    python examples/train_torch_elastic.py                            # one process, same code

`discover.sh` prints the usable hosts, one `host:slots` per line. On a failure every rank rolls back to the
last commit, the survivors re-form the world, and training resumes mid-epoch where the commit was: no
sample of the epoch is skipped or repeated, and the learning rate follows the new world size. Lines that
elasticity costs are tagged `# hvdp:`. The last line printed is `result: {json}`. train(cfg) is the job as a
function, which examples/train_on_cluster.py runs on Spark (run_elastic) and Ray (run_elastic).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import hvdp.torch as hvdp_torch
from common import DEFAULTS, digest, fail, load_data, num_classes, parse_config, print_result, summary
from hvdp.core.errors import ConfigError, HvdpError
from train_torch import Net

COMMIT_EVERY = 10  # steps; a failure loses at most this many steps of work


def train(cfg, on_epoch=None) -> dict:
    """Train elastically and evaluate; every rank must call it. Returns this rank's summary, with its rank,
    the digest of its final weights and the world size at each (re)start of training, in order (e.g.
    [2, 1, 2]: two ranks, one lost, one added back).

    on_epoch(epoch, rank, size), if given, is called on every rank after each committed epoch (a job
    manager's progress hook).
    """
    if cfg.files:  # rank 0 writes them while the others wait: a worker joining later would wait alone
        raise ConfigError("--files is for train_torch.py; the elastic example reads the data from memory: drop "
                          "--files (or --data FILE.npz)")
    hvdp_torch.init(device=cfg.device)
    device = hvdp_torch.device()  # hvdp: this rank's GPU or the CPU
    torch.manual_seed(cfg.seed)
    x_train, y_train, x_test, y_test = load_data(cfg.data)
    train_set = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    test_set = torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test))
    model = Net(x_train.shape[1], num_classes(y_train, y_test)).to(device)
    loader = hvdp_torch.shard(train_set, batch_size=cfg.batch_size, seed=cfg.seed)
    optimizer = hvdp_torch.prepare(
        model, torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9), lr_scaling=cfg.lr_scaling,
        warmup_steps=round(cfg.warmup_epochs * len(loader)), compression=cfg.compression)
    state = hvdp_torch.ElasticState(model, optimizer, loader, samples=0, sizes=[])  # hvdp: what survives a reset

    @hvdp_torch.elastic_run  # hvdp: on a lost or added worker: roll back, re-form, sync, call again
    def run(state):
        hvdp_torch.log(f"training on {hvdp_torch.world().size} rank(s) from epoch {state.epoch}")
        state.sizes.append(hvdp_torch.world().size)  # committed with the next commit
        while state.epoch < cfg.epochs:
            epoch = state.epoch
            model.train()
            for step, (x, y) in enumerate(loader, 1):  # after a reset: the rest of the interrupted epoch
                optimizer.zero_grad()
                F.cross_entropy(model(x.to(device)), y.to(device)).backward()
                optimizer.step()
                state.samples += len(y) * hvdp_torch.world().size
                if step % COMMIT_EVERY == 0:
                    state.commit()  # hvdp: a failure rolls back to here
            state.commit()
            metrics = hvdp_torch.evaluate(model, test_set)
            hvdp_torch.log(f"epoch {epoch}: test accuracy {metrics['accuracy']:.4f} on {hvdp_torch.world().size} rank(s)")
            if on_epoch is not None:
                on_epoch(epoch, hvdp_torch.world().rank, hvdp_torch.world().size)

    started = time.perf_counter()
    run(state)
    seconds = time.perf_counter() - started
    if hvdp_torch.world().size > 1:
        hvdp_torch.check_consistency(model)
    metrics = hvdp_torch.evaluate(model, test_set)
    return summary(metrics, framework="torch", world_size=hvdp_torch.world().size, epochs=cfg.epochs,
                   samples=state.samples, seconds=seconds, rank=hvdp_torch.world().rank, world_sizes=state.sizes,
                   weights_sha256=digest(w.cpu().numpy() for w in model.state_dict().values()))


def main() -> None:
    result = train(parse_config(__doc__.splitlines()[0], **DEFAULTS))
    if result["rank"] == 0:
        print_result(result)


if __name__ == "__main__":
    try:
        main()
    except HvdpError as e:
        fail(e)
