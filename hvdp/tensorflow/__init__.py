"""TensorFlow adapter (custom training loops): plain functions over the core and horovod.tensorflow.

    import hvdp.tensorflow as hvdp_tf
    world = hvdp_tf.init()
    optimizer = hvdp_tf.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))  # LR x size, all-reduce
    data = hvdp_tf.shard((x, y), batch_size=32)       # this rank's batches; a new order every epoch
    hvdp_tf.broadcast(model, optimizer)                # rank 0's weights (and optimizer state) everywhere

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))   # averaged across ranks
        return loss

    for epoch in range(epochs):
        for x, y in data:
            train_step(x, y)
    metrics = hvdp_tf.evaluate(model, (x_test, y_test))    # every test sample counted exactly once

Horovod's own Keras layer (horovod.tensorflow.keras) does not work on Keras 3 (horovod#4290), so nothing
here uses it: gradients are averaged with horovod.tensorflow.grouped_allreduce inside the optimizer's
apply(), which both custom loops and Keras 3's model.fit call inside their compiled step. hvdp.keras builds
its callbacks on the functions of this module.

Run the same script on every rank. Functions marked "every rank must call it" run a collective: a rank that
skips one, or calls them in another order, leaves the others waiting (hvdp's watchdog then ends the job).
Errors are hvdp.core.errors classes, raised on every rank where the check is collective. Importing this
module imports TensorFlow, Keras and horovod.tensorflow, and raises SetupError when Horovod is missing or was
built without TensorFlow.
"""

# The package, one module per concern: runtime (horovod.tensorflow, init, world, GPU placement), gradients
# (allreduce_gradients, DistributedGradientTape), optimizer (DistributedOptimizer, ScaledSchedule,
# scale_learning_rate), data (shard, ShardPosition), collectives (broadcast, barrier, average, check_finite,
# log, check_consistency), evaluation (evaluate), checkpoint (save_checkpoint, load_checkpoint), tracking (what
# the watchdog knows: eager collectives, an eager loop's wait for a batch), preemption (preempted,
# exit_for_requeue).

from hvdp.core.errors import HvdpError
from hvdp.core.records import index_records
from hvdp.tensorflow.runtime import hvd, init, world  # noqa: F401  (hvd: not API; hvdp.keras and tests use it)
from hvdp.tensorflow.gradients import DistributedGradientTape, allreduce_gradients
from hvdp.tensorflow.optimizer import DistributedOptimizer, ScaledSchedule, scale_learning_rate
from hvdp.tensorflow.data import ShardPosition, shard
from hvdp.tensorflow.collectives import average, barrier, broadcast, check_consistency, check_finite, log
from hvdp.tensorflow.evaluation import evaluate
from hvdp.tensorflow.checkpoint import FRAMEWORK, load_checkpoint, save_checkpoint  # noqa: F401  (FRAMEWORK: the same)
from hvdp.tensorflow.preemption import exit_for_requeue, preempted

__all__ = ["init", "world", "barrier", "allreduce_gradients", "DistributedGradientTape", "DistributedOptimizer",
           "ScaledSchedule", "scale_learning_rate", "broadcast", "shard", "index_records", "ShardPosition",
           "average", "check_finite", "evaluate", "log", "check_consistency", "save_checkpoint", "load_checkpoint",
           "preempted", "exit_for_requeue", "HvdpError"]
