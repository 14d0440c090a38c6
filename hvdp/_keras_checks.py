"""What hvdp.keras's callbacks check and adjust at fit's start, before the first step (issue 50 rows 5, 9, 11):
losses that are not a per-sample mean, a steps_per_epoch other than the shard's, LearningRateScheduler's rates,
and a fit run without the callbacks at all. Each refusal is a ConfigError raised on every rank (the same model,
data and fit arguments on every rank, or compared across them) that says what to change."""

from __future__ import annotations

import sys

import keras

from hvdp._horovod import agree
from hvdp.core.errors import ConfigError


def refuse_other_steps(steps, plan_steps: int, horovod) -> None:
    """ConfigError on every rank unless fit's steps per epoch (`steps`, fit's steps_per_epoch or the dataset's
    length) is the shard's `plan_steps`: fit would otherwise end its epochs inside the shard's epochs (or run
    past them), so the epochs' data orders, last-step weights and checkpoint positions would be other than those
    of the shard's epoch, which is what hvdp records and resumes. `steps` is compared across the ranks first."""
    if horovod.size() > 1:
        agree(horovod, lambda: {"steps_per_epoch": steps}, call="model.fit()")
    if steps is not None and steps != plan_steps:
        raise ConfigError(
            f"model.fit(steps_per_epoch={steps}) does not match the shard's {plan_steps} batches per epoch: fit's "
            f"epochs would cut the shard's epochs (the next epoch starts where the last one stopped, or a pass is "
            f"cut short), and a checkpoint could not say where training is. Leave steps_per_epoch out (shard() "
            f"tells fit its length: every rank gets {plan_steps} batches per epoch, the global batch split over "
            f"the ranks), or shard fewer samples", rank=horovod.rank())


def scale_lr_schedulers(fit_list, optimizer, rank: int) -> None:
    """Make each keras.callbacks.LearningRateScheduler of fit's callbacks `fit_list` set the rate one process
    would at the scaled rate: its schedule sees the base rate (the optimizer's rate divided by the
    DistributedOptimizer's multiplier, hvdp.core.scaling.lr_multiplier) and what it returns is multiplied by it,
    so a schedule returning absolute rates (0.1, then 0.01) and one scaling the rate it is given both keep the
    x N of lr_scaling. With warmup_steps the rate is a schedule Keras cannot set: ConfigError with the fix."""
    multiplier = getattr(optimizer, "multiplier", None)
    for callback in fit_list or []:
        callback = getattr(callback, "hvdp_inner", callback)  # ElasticState.fit's _Continued
        if not isinstance(callback, keras.callbacks.LearningRateScheduler) or multiplier is None:
            continue
        if getattr(optimizer, "warmup_steps", 0):
            raise ConfigError(
                f"a LearningRateScheduler cannot set the rate of DistributedOptimizer(warmup_steps="
                f"{optimizer.warmup_steps}): the warmup makes the rate a schedule, which Keras does not let a "
                f"callback set. Give the wrapped optimizer a keras.optimizers.schedules.LearningRateSchedule "
                f"instead (DistributedOptimizer scales and warms it up), or warmup_steps=0", rank=rank)
        if not getattr(callback.schedule, "_hvdp_multiplier", None):
            callback.schedule = _scaled(callback.schedule, multiplier)


def _scaled(schedule, multiplier: float):
    """`schedule` (Keras's schedule(epoch, lr) or schedule(epoch)) on the base rate, its result scaled."""

    def scaled(epoch, lr):
        try:
            base = schedule(epoch, lr / multiplier)
        except TypeError:  # a schedule of the epoch alone, as Keras's own fallback calls it
            base = schedule(epoch)
        return float(base) * multiplier

    scaled._hvdp_multiplier = multiplier
    scaled.__wrapped__ = schedule
    return scaled


def mark_fitting(optimizer) -> None:
    """Record that hvdp.keras's callbacks set up a fit of `optimizer` (refuse_fit_without_callbacks reads it)."""
    optimizer._hvdp_callbacks = True


def refuse_fit_without_callbacks(optimizer, size: int, rank: int) -> None:
    """ConfigError at the first apply of a DistributedOptimizer inside Keras's model.fit (before any update,
    on every rank: every rank runs the same fit) when fit got none of hvdp.keras.callbacks(): nothing then
    broadcast rank 0's initial weights, so the replicas train from their own random weights and drift apart
    silently, and the epochs' metrics are each rank's. A custom loop or train_on_batch is not refused."""
    if size == 1 or getattr(optimizer, "_hvdp_callbacks", False) or not _inside_keras_fit():
        return
    raise ConfigError(
        "model.fit runs without hvdp.keras.callbacks(): nothing broadcast rank 0's initial weights, so each rank "
        "would train its own replica from its own initial weights (and log its own metrics). Pass them first "
        "in fit's list: model.fit(data, callbacks=[*hvdp.keras.callbacks(data=data), ...your callbacks])",
        rank=rank)


def _inside_keras_fit() -> bool:
    """Whether the caller runs inside Keras's Trainer.fit (its train step, traced or eager)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "fit" and "keras" in code.co_filename and code.co_filename.endswith("trainer.py"):
            return True
        frame = frame.f_back
    return False


_PER_SAMPLE_MEAN = ("sum_over_batch_size", "mean")


def refuse_inexact_losses(model, rank: int) -> None:
    """ConfigError, before the first step (the same model on every rank: every rank raises), for a loss that is
    not a per-sample mean over this rank's batch, whose average over the ranks is then not one process's loss
    on the global batch (issue 50 row 5): a compiled Loss with reduction "sum" or "mean_with_sample_weight" (a
    per-rank divisor), an output that carries a Keras mask into the loss (the mean over each rank's own
    valid tokens), a layer's activity_regularizer (a penalty on each rank's batch, added as it is)."""
    import keras.src.tree as tree

    for loss in tree.flatten(model.loss) if model.loss is not None else []:
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if isinstance(loss, keras.losses.Loss) and reduction not in _PER_SAMPLE_MEAN:
            raise ConfigError(
                f"the compiled loss {type(loss).__name__}(reduction={reduction!r}) is not a per-sample mean over "
                f"the batch: averaged over the ranks it is not one process's loss on the global batch (with "
                f"'sum' the step is 1/size of it; with 'mean_with_sample_weight' each rank divides by its own "
                f"weights). Compile with reduction='sum_over_batch_size' (the default); put any normalisation in "
                f"the sample weights", rank=rank)
    regularized = [layer.name for layer in model._flatten_layers(include_self=False)
                   if getattr(layer, "activity_regularizer", None) is not None]
    if regularized:
        raise ConfigError(
            f"layer(s) {regularized} have an activity_regularizer: its penalty is taken on each rank's batch and "
            f"added to the loss as it is, so the ranks' average is not one process's penalty on the global batch. "
            f"Use a kernel_regularizer, or add the penalty to the loss as a per-sample mean (a custom loss "
            f"returning each sample's value)", rank=rank)
    # a functional or Sequential model's symbolic outputs hold their masks (a subclassed model has none to see)
    outputs = getattr(model, "outputs", None) if getattr(model, "_is_graph_network", True) else None
    try:
        outputs = tree.flatten(outputs) if outputs else []
    except (AttributeError, ValueError):
        outputs = []
    if any(getattr(o, "_keras_mask", None) is not None for o in outputs):
        raise ConfigError(
            "the model's output carries a Keras mask (Masking, Embedding(mask_zero=True) with return_sequences): "
            "the loss is then the mean over each rank's own valid tokens, and the ranks' average is not one "
            "process's mean over the global batch's valid tokens. Drop the mask before the output (a layer that "
            "does not pass it on) and pass per-token sample weights, 1 on valid tokens and 0 elsewhere: the loss "
            "is then the weighted sum over the batch's tokens divided by their number, the same divisor on every "
            "rank, so N ranks equal one process", rank=rank)
