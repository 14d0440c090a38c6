"""hvdp for PyTorch Lightning 2.x: HorovodStrategy, a Trainer strategy that runs one process per rank under
horovodrun, mpirun or srun (the Trainer spawns nothing) and trains as one process with the global batch would.

    import lightning.pytorch as pl
    import hvdp.lightning                      # registers strategy="hvdp" (Trainer and Fabric)
    trainer = pl.Trainer(strategy="hvdp", max_epochs=10)   # or strategy=hvdp.lightning.HorovodStrategy(...)
    trainer.fit(model, train_loader, val_loader)           # batch_size of the loaders: per rank

What it does to the Trainer's run (docs/lightning.md):
- initializes hvdp (hvdp.torch.init: Horovod, the watchdog, the rank's device) when it is built, and makes
  Lightning's rank-zero-only output (loggers, progress bar, prints) rank 0's;
- prepares the optimizer configure_optimizers returns with hvdp.torch.prepare (the learning-rate rule and
  warmup, gradients averaged by Horovod, rank 0's weights and state broadcast); the LR schedulers keep
  stepping the same param groups, their rates scaled by the same multiplier;
- replaces the training loader's sampler by hvdp's exact sharding (every sample once per epoch, an epoch's
  uneven last batch weighted so that the step is one process's step on the global batch) and splits the
  validation and test loaders into contiguous unpadded slices, so that self.log(..., sync_dist=True) over an
  epoch is the mean over every sample counted once;
- maps reduce, all_gather, barrier and broadcast onto Horovod's collectives, writes checkpoints from rank 0
  atomically (every rank learns of a failed write), resumes a checkpoint written within an epoch at the first
  sample not trained on (the training loader is resumable), and rescales the rates of a checkpoint written at
  another world size, or by another strategy (one process's rates).
accumulate_grad_batches, gradient_clip_val/algorithm and precision="bf16-mixed" (or fp16 with a GradScaler, through
Lightning's MixedPrecision plugin) keep one process's meaning. One optimizer (configure_optimizers returning more is
a ConfigError). HorovodStrategy(shard_optimizer_state=True) prepares it with hvdp.torch's sharded optimizer
(ZeRO-1/2): gradient_clip_val clips by the norm across the shards; accumulate_grad_batches sums its passes'
gradients in the model and reduces them to the shards after the last.
HorovodStrategy(preemption=True) (or HVDP_PREEMPTION=1): a stop signal on any rank makes every rank write
Lightning's HPC checkpoint after the same step and exit 75 (requeue); a fit under Slurm resumes from it.

HorovodFabricStrategy (Fabric(strategy="hvdp")) does the same for Lightning Fabric's loops: setup(model,
optimizer) prepares the optimizer, setup_dataloaders() shards, clip_gradients() clips the averaged gradients.

The package: _package (which Lightning), common (what both strategies share), trainer (HorovodStrategy),
fabric (HorovodFabricStrategy), verify (`hvdp verify --framework lightning`'s experiment; imported by it only).

Importing this package imports Lightning (lightning.pytorch, else pytorch_lightning: the one already imported
when both are installed), torch and horovod.torch; nothing else in hvdp imports it.
"""


from hvdp.lightning._package import PACKAGE, fabric as _fabric, strategies as _strategies
from hvdp.lightning.common import EvalBatches, HorovodEnvironment
from hvdp.lightning.fabric import HorovodFabricStrategy
from hvdp.lightning.trainer import HorovodStrategy

# strategy="hvdp" for the Trainer and for Fabric, once this package is imported
HorovodStrategy.register_strategies(_strategies.StrategyRegistry)
HorovodFabricStrategy.register_strategies(_fabric.strategies.STRATEGY_REGISTRY)

__all__ = ["HorovodStrategy", "HorovodFabricStrategy", "HorovodEnvironment", "EvalBatches", "PACKAGE"]
