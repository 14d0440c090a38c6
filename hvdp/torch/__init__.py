"""PyTorch adapter: plain functions over the core and horovod.torch.

    import hvdp.torch as hvdp_torch
    world = hvdp_torch.init()
    optimizer = hvdp_torch.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loader = hvdp_torch.shard(train_set, batch_size=32)
    for epoch in range(epochs):
        for x, y in loader:               # a new order every epoch, no set_epoch to forget
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    metrics = hvdp_torch.evaluate(model, test_set)   # every test sample counted exactly once

Run the same script on every rank (horovodrun, mpirun, srun; plain python is a world of size 1). Functions
marked "every rank must call it" run a collective: a rank that skips one, or calls them in another order,
leaves the others waiting (hvdp's watchdog then ends the job). Errors are hvdp.core.errors classes
(ConfigError, SetupError, CheckpointError, DivergenceError, NonFiniteLossError), raised on every rank where
the check is collective. Importing this module imports torch and horovod.torch, and raises SetupError when
Horovod is missing or was built without PyTorch.

The adapter, one module per concern: runtime (init, world, device, log), optimizer (prepare, the LR
hooks), weights (an epoch's uneven last step), data and streams (shard), workers (shard's DataLoader workers:
forkserver, kept, checked), collectives, evaluation, checkpoint, compiled (compile), sync_batchnorm, elastic,
preemption (preempted, exit_for_requeue), tracking (what the watchdog knows of each Horovod collective),
sharded (prepare's shard_optimizer_state: ZeRO-1/2).
"""

from hvdp.core.errors import HvdpError
from hvdp.torch.runtime import device, hvd, init, log, progress, world  # noqa: F401  (hvd: Horovod itself, for scripts)
from hvdp.torch.collectives import average, barrier, broadcast, check_consistency, check_finite
from hvdp.torch.optimizer import current_lr, prepare
from hvdp.torch.compiled import compile
from hvdp.torch.sync_batchnorm import SyncBatchNorm
from hvdp.torch.data import PeekWarning, ShardSampler, shard
from hvdp.torch.evaluation import evaluate
from hvdp.torch.checkpoint import load_checkpoint, save_checkpoint
from hvdp.torch.preemption import exit_for_requeue, preempted
from hvdp.torch.elastic import ElasticState, elastic_run

__all__ = ["init", "world", "device", "prepare", "compile", "broadcast", "current_lr", "shard", "ShardSampler", "PeekWarning",
           "barrier", "average", "evaluate", "log", "progress", "SyncBatchNorm", "check_consistency", "check_finite",
           "save_checkpoint", "load_checkpoint", "preempted", "exit_for_requeue", "ElasticState", "elastic_run",
           "HvdpError"]
