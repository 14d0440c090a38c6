"""Horovod 0.28.1's own tests that cannot run unmodified on Keras 3, ported: each is the test of
../shared/peer/horovod-0.28.1/test/parallel (Apache License 2.0, Uber Technologies) with only its own Keras-2
code changed, as a Horovod user's script has to change when moving to Keras 3; what Horovod's API does and
what the test asserts are the same. tests/peer_deselect.txt names the originals and why they cannot pass.

Not collected by `pytest tests` (the name has no test_ prefix): tests/test_peer_horovod.py runs it under
`horovodrun -np 2` (Gloo and MPI), as the peer files are run. The changes, everywhere:
- `var.ref()` -> `_key(var)`: Keras 3's variables have no ref() (the test's own dictionaries);
- `lr=` -> `learning_rate=`, `keras.losses.mean_squared_error` -> `keras.losses.MeanSquaredError()`,
  `ThresholdedReLU(0.5)` -> `ReLU(threshold=0.5)`, no `input_length=`, `fused=` nor
  `experimental_run_tf_function=`: Keras 3 removed them;
- the custom optimizers pass `learning_rate` (required by Keras 3's Optimizer) and take update_step's third
  argument (the learning rate), and `optimizer.lr` is `optimizer.learning_rate`.
"""

import numpy as np
import pytest
import tensorflow as tf
from parameterized import parameterized
from tensorflow import keras

import horovod.keras as hvd_keras
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

Optimizer = tf.keras.optimizers.Optimizer


def _key(var):
    """A dictionary key for a Keras 3 variable (the originals use var.ref(), which Keras 3's lack)."""
    return id(var)


class TestingOptimizer(Optimizer):
    """The originals' optimizer: adds the gradient to the variable (learning_rate is unused)."""

    def __init__(self, name, **kwargs):
        kwargs.setdefault("learning_rate", 0.1)  # Keras 3: required
        super().__init__(name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate=None):  # Keras 3 passes the learning rate
        variable.assign_add(gradient)


class Keras3PortTests(tf.test.TestCase):
    """test_tensorflow2_keras.py's Tf2KerasTests and test_tensorflow.py's tests that need only Keras 3's API."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        hvd.init()

    def test_train_model_lr_schedule(self):
        initial_lr = 0.1 * hvd.size()
        opt = tf.keras.optimizers.Adam()
        opt = hvd.DistributedOptimizer(opt)

        def linear_multiplier(epoch):
            return epoch

        model = keras.models.Sequential()
        model.add(keras.layers.Dense(2, input_shape=(3,)))
        model.add(keras.layers.RepeatVector(3))
        model.add(keras.layers.ReLU(threshold=0.5))
        model.compile(loss=keras.losses.MeanSquaredError(), optimizer=opt,
                      metrics=[keras.metrics.categorical_accuracy])
        x = np.random.random((10, 3))
        y = np.random.random((10, 3, 2))
        # (not in the original) each rank its own data: tf.test.TestCase seeds numpy alike on every rank, and
        # with the same data on every rank the weights would agree without any all-reduce
        x = x + 0.1 * hvd.rank()
        seen = []

        class StoreLearningRateCallback(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                lr = self.model.optimizer.learning_rate.numpy()
                seen.append(lr)
                if epoch >= 0 and epoch < 5:
                    assert lr <= initial_lr or np.isclose(lr, initial_lr)
                if epoch > 5 and epoch < 10:
                    assert lr <= initial_lr * 1e-1 or np.isclose(lr, initial_lr * 1e-1)
                if epoch > 10 and epoch < 15:
                    assert lr < initial_lr * 1e-2 or np.isclose(lr, initial_lr * 1e-2)
                if epoch >= 15 and epoch < 20:
                    assert np.isclose(lr, initial_lr * linear_multiplier(epoch))

        callbacks = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            hvd.callbacks.LearningRateWarmupCallback(initial_lr=initial_lr, warmup_epochs=5),
            hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-1,
                                                       start_epoch=5, end_epoch=10),
            hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-2,
                                                       start_epoch=10, end_epoch=15),
            hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=linear_multiplier,
                                                       start_epoch=15, end_epoch=20),
            StoreLearningRateCallback()]
        train_history = model.fit(x, y, steps_per_epoch=5, callbacks=callbacks, epochs=20, verbose=0)
        assert len(seen) == 20  # (not in the original) the callback's asserts ran

        loss_metrics_tensor = tf.convert_to_tensor(train_history.history["loss"], dtype=tf.float32)
        expected_loss_metrics_tensor = hvd.broadcast(loss_metrics_tensor, root_rank=0)
        self.assertAllClose(expected_loss_metrics_tensor, loss_metrics_tensor)
        # (not in the original) the weights stayed the same on every rank: the gradients were all-reduced
        for w in model.get_weights():
            self.assertAllClose(hvd.broadcast(tf.constant(w), root_rank=0), w)

    def test_sparse_as_dense(self):
        opt = keras.optimizers.RMSprop(learning_rate=0.0001)
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=True)

        model = keras.models.Sequential()
        model.add(keras.layers.Embedding(1000, 64))
        model.compile(loss=keras.losses.MeanSquaredError(), optimizer=opt)

        x = np.random.randint(1000, size=(32, 10))
        y = np.random.random((32, 10, 64))
        # (not in the original) each rank its own data, as above; opposite signs, as RMSprop's first step is
        # about lr * sign(gradient) whatever its size
        y = y * (-1) ** hvd.rank()
        model.train_on_batch(x, y)
        # (not in the original) the ranks' different batches gave one step: the same weights everywhere
        w = model.get_weights()[0]
        self.assertAllClose(hvd.broadcast(tf.constant(w), root_rank=0), w)

    def test_sparse_as_dense_with_grad_aggregation(self):
        backward_passes_per_step = 2
        opt = keras.optimizers.RMSprop(learning_rate=0.0001)
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=True,
                                       backward_passes_per_step=backward_passes_per_step)

        model = keras.models.Sequential()
        model.add(keras.layers.Embedding(1000, 64))
        model.compile(loss=keras.losses.MeanSquaredError(), optimizer=opt)

        x = np.random.randint(1000, size=(32, 10))
        y = np.random.random((32, 10, 64))

        training_steps = 3
        for _ in range(training_steps):
            model.train_on_batch(x, y)

        aggregation_counter = opt._agg_helper.counter.numpy()
        assert aggregation_counter == training_steps % backward_passes_per_step

    @parameterized.expand([[True], [False]])
    def test_gradient_aggregation(self, average_aggregated_gradients):
        backward_passes_per_step = 4
        hvd_optimizer = hvd.DistributedOptimizer(
            optimizer=TestingOptimizer("test"),
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            sparse_as_dense=True,
        )
        _ = hvd_optimizer.iterations

        x_0 = 0.0
        y_0, y_1 = 1.0, 2.0
        x = tf.Variable([x_0])
        y = tf.Variable([y_0, y_1])
        variables = [x, y]

        def loss():
            gathered_y_1 = tf.gather(y, [0])
            return x - gathered_y_1

        def compute_expected_value(batch_id):
            num_of_steps = (batch_id + 1) // backward_passes_per_step
            gradient_of_x = num_of_steps * 1.0
            gradient_of_y_0 = num_of_steps * -1.0
            if not average_aggregated_gradients:
                gradient_of_x *= backward_passes_per_step
                gradient_of_y_0 *= backward_passes_per_step
            return np.array(x_0 + gradient_of_x), np.array([y_0 + gradient_of_y_0, y_1])

        @tf.function
        def compute_and_apply_gradients_in_tf_function(var_list, **kwargs):
            grads_and_vars = hvd_optimizer._compute_gradients(loss, var_list=var_list)
            hvd_optimizer.apply_gradients(grads_and_vars, **kwargs)

        total_num_of_steps = 10
        for idx in range(total_num_of_steps):
            compute_and_apply_gradients_in_tf_function(var_list=variables, experimental_aggregate_gradients=False)
            expected_x, expected_y = compute_expected_value(idx)
            assert np.isclose(variables[0].numpy(), expected_x)
            assert np.isclose(variables[1].numpy(), expected_y).all()
            assert idx + 1 == hvd_optimizer.iterations.numpy()

        aggregation_counter = hvd_optimizer._agg_helper.counter.numpy()
        assert aggregation_counter == total_num_of_steps % backward_passes_per_step

    @parameterized.expand([[True], [False]])
    def test_gradient_aggregation_with_local_vars(self, average_aggregated_gradients):
        backward_passes_per_step = 4
        hvd_optimizer = hvd.DistributedOptimizer(
            optimizer=TestingOptimizer("test"),
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            sparse_as_dense=True,
        )
        _ = hvd_optimizer.iterations

        total_num_variables = 8
        num_local_vars = 4
        X_0 = [0.0] * total_num_variables
        Y_0, Y_1 = [1.0] * total_num_variables, [2.0] * total_num_variables
        X = [tf.Variable([x_0]) for x_0 in X_0]
        Y = [tf.Variable([y_0, y_1]) for y_0, y_1 in zip(Y_0, Y_1)]
        variables = [X, Y]
        flatten_variables = [item for sublist in variables for item in sublist]
        for i in range(num_local_vars):
            hvd_optimizer.register_local_var(X[i])
            hvd_optimizer.register_local_var(Y[i])

        def loss():
            gathered_y_1 = tf.gather(Y, [0], axis=1)
            return X - (float(hvd.rank() + 1) * gathered_y_1)

        def compute_expected_value(batch_id):
            num_of_steps = (batch_id + 1) // backward_passes_per_step
            gradient_of_x = num_of_steps * 1.0
            gradient_of_y_multiplier = float(hvd.size() + 1) / 2
            gradient_of_y_0 = num_of_steps * gradient_of_y_multiplier * -1.0
            if not average_aggregated_gradients:
                gradient_of_x *= backward_passes_per_step
                gradient_of_y_0 *= backward_passes_per_step
            expected_x = np.array(X_0)
            for i in range(len(X_0)):
                expected_x[i] += gradient_of_x / hvd.size() if i < num_local_vars else gradient_of_x
            expected_y_0 = np.array(Y_0)
            for i in range(len(Y_0)):
                if i < num_local_vars:
                    expected_y_0[i] += ((gradient_of_y_0 / gradient_of_y_multiplier) * float(hvd.rank() + 1)) / hvd.size()
                else:
                    expected_y_0[i] += gradient_of_y_0
            expected_y = [[ey0, ey1] for ey0, ey1 in zip(expected_y_0, np.array(Y_1))]
            return np.reshape(expected_x, (-1, 1)), np.array(expected_y)

        @tf.function
        def compute_and_apply_gradients_in_tf_function(var_list, **kwargs):
            grads_and_vars = hvd_optimizer._compute_gradients(loss, var_list=var_list)
            hvd_optimizer.apply_gradients(grads_and_vars, **kwargs)

        total_num_of_steps = 10
        for idx in range(total_num_of_steps):
            compute_and_apply_gradients_in_tf_function(var_list=flatten_variables,
                                                       experimental_aggregate_gradients=False)
            expected_x, expected_y = compute_expected_value(idx)
            assert np.isclose(np.array(variables[0]), expected_x).all()
            assert np.isclose(np.array(variables[1]), expected_y).all()
            assert idx + 1 == hvd_optimizer.iterations.numpy()

        aggregation_counter = hvd_optimizer._agg_helper.counter.numpy()
        assert aggregation_counter == total_num_of_steps % backward_passes_per_step

    def test_partial_distributed_optimizer(self):
        if hvd.size() == 1:
            self.skipTest("Only one worker available")
        for num_local_layers in range(3):
            model = tf.keras.models.Sequential()
            initializer = tf.keras.initializers.Constant(hvd.rank())
            model.add(tf.keras.layers.Dense(2, input_shape=(3,), kernel_initializer=initializer,
                                            bias_initializer=initializer))
            model.add(tf.keras.layers.RepeatVector(3))
            model.add(tf.keras.layers.TimeDistributed(tf.keras.layers.Dense(
                3, kernel_initializer=initializer, bias_initializer=initializer)))
            opt = tf.keras.optimizers.Adam()
            model.compile(loss=tf.keras.losses.MSE, metrics=[tf.keras.metrics.categorical_accuracy])

            X = np.random.random((1, 3))
            Y = np.random.random((1, 3, 3))
            with tf.GradientTape(persistent=True) as tape:
                p = model(X, training=True)
                l = model.loss(Y, p)
            gradients_tape = tape.gradient(l, model.trainable_weights)

            local_layers = model.layers[:num_local_layers]
            opt = hvd_keras.PartialDistributedOptimizer(opt, sparse_as_dense=True, local_layers=local_layers)
            gradients_vars_opt = opt._compute_gradients(l, model.trainable_weights, tape=tape)

            var_grad_tape = {_key(var): grad for var, grad in zip(model.trainable_weights, gradients_tape)}
            var_grad_opt = {_key(var): grad for grad, var in gradients_vars_opt}
            local_vars = [_key(var) for layer in local_layers for var in layer.trainable_weights]
            for var in model.trainable_weights:
                if _key(var) in local_vars:
                    self.assertAllClose(var_grad_tape[_key(var)], hvd.size() * var_grad_opt[_key(var)])
                else:
                    self.assertNotAllClose(var_grad_tape[_key(var)], var_grad_opt[_key(var)])

    def test_broadcast_global_variables_callback_with_local_vars(self):
        if hvd.size() == 1:
            self.skipTest("Only one worker available")
        root_rank = hvd.size() - 1
        X = np.random.random((1, 3))
        Y = np.random.random((1, 3, 3))
        model = tf.keras.models.Sequential()
        initializer = tf.keras.initializers.Constant(hvd.rank())
        dense = dict(kernel_initializer=initializer, bias_initializer=initializer, trainable=False)
        model.add(tf.keras.layers.Dense(3, input_shape=(3,), **dense))
        for _ in range(3):
            model.add(tf.keras.layers.Dense(3, **dense))
        model.add(tf.keras.layers.RepeatVector(3))
        model.add(tf.keras.layers.Dense(3, **dense))
        model.compile(loss=tf.keras.losses.MSE, metrics=[tf.keras.metrics.categorical_accuracy])

        local_variables = [var for var in model.layers[0].variables]
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=root_rank,
                                                                    local_variables=local_variables)]
        model.fit(X, Y, callbacks=callbacks, verbose=0)
        local_variables_ref = [_key(var) for var in local_variables]
        for var in model.variables:
            if _key(var) in local_variables_ref:
                self.assertAllClose(var, tf.constant(float(hvd.rank()), shape=var.shape))
            else:
                self.assertAllClose(var, tf.constant(float(root_rank), shape=var.shape))

    # test_tensorflow.py's (TensorFlowTests; run there in graph and eager mode, here eagerly: Keras 3 models
    # are not built in TF1 graphs)

    def test_partial_distributed_gradient_tape(self):
        if hvd.size() == 1:
            self.skipTest("Only one worker available")
        for num_local_layers in range(3):
            model = tf.keras.models.Sequential()
            initializer = tf.keras.initializers.Constant(hvd.rank())
            model.add(tf.keras.layers.Dense(2, input_shape=(3,), kernel_initializer=initializer,
                                            bias_initializer=initializer))
            model.add(tf.keras.layers.RepeatVector(3))
            model.add(tf.keras.layers.TimeDistributed(tf.keras.layers.Dense(
                3, kernel_initializer=initializer, bias_initializer=initializer)))
            model.compile(loss=tf.keras.losses.MSE, metrics=[tf.keras.metrics.categorical_accuracy])

            X = np.random.random((1, 3))
            Y = np.random.random((1, 3, 3))
            with tf.GradientTape(persistent=True) as tape:
                p = model(X, training=True)
                l = model.loss(Y, p)
            gradients = tape.gradient(l, model.trainable_weights)

            local_layers = model.layers[:num_local_layers]
            var_grad = {_key(var): grad for var, grad in zip(model.trainable_weights, gradients)}
            local_vars = [_key(var) for layer in local_layers for var in layer.trainable_weights]

            tape = hvd_tf.PartialDistributedGradientTape(tape, local_layers=local_layers)
            allreduced_gradients = tape.gradient(l, model.trainable_weights)
            local_vars_grads, global_vars_grads = tape.get_local_and_global_gradients(l, model.trainable_weights)

            for var, grad in zip(model.trainable_weights, allreduced_gradients):
                if _key(var) in local_vars:
                    self.assertAllClose(grad, var_grad[_key(var)] / hvd.size())
                else:
                    self.assertNotAllClose(grad, var_grad[_key(var)])
            for var, grad in local_vars_grads:
                self.assertAllClose(grad, var_grad[_key(var)] / hvd.size())
            for var, grad in global_vars_grads:
                self.assertNotAllClose(grad, var_grad[_key(var)])
            # (not in the original) every layer counted, local or global
            assert len(local_vars_grads) + len(global_vars_grads) == len(model.trainable_weights)
            assert len(local_vars_grads) == len(local_vars)

    def test_horovod_syncbn_cpu(self):
        with tf.device("/cpu:0"):
            x_list = [
                tf.convert_to_tensor(np.stack([
                    np.array([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]],
                             dtype=np.float32)
                    for r in range(hvd.size())]), np.float32),
                tf.convert_to_tensor(np.stack([
                    np.array([[r + 1], [r * 2 + 1], [r * 3 + 1], [r * 4 + 1]], dtype=np.float32)
                    for r in range(hvd.size())]), np.float32),
            ]
            for x in x_list:
                bn = tf.keras.layers.BatchNormalization(axis=1)  # Keras 3: no fused=False (never fused)
                sync_bn = hvd_tf.SyncBatchNormalization(axis=1)
                bn_out = bn(x, training=True)
                sync_bn_out = sync_bn(tf.expand_dims(x[hvd.rank()], 0), training=True)
                self.assertAllClose(sync_bn_out, np.expand_dims(bn_out[hvd.rank()], 0))
                self.assertAllClose(sync_bn.moving_mean, bn.moving_mean)
                self.assertAllClose(sync_bn.moving_variance, bn.moving_variance)


if __name__ == "__main__":
    pytest.main([__file__])
