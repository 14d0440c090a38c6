"""SyncBatchNorm: batch normalisation over the global batch, on CPU and GPU, and the in-place conversion
prepare(sync_batchnorm=True) does."""

from __future__ import annotations

import torch

from hvdp.torch.runtime import hvd
from hvdp.torch.weights import _Batch


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalisation whose training statistics are those of the global batch (all ranks together).

    Works on CPU and GPU (Horovod's own SyncBatchNorm is GPU-only). One all-reduce of (sum, sum of
    squares, count) per call; gradients flow back through it. In eval mode, before init() and in a world
    of size 1 it is plain BatchNorm. A batch of shard()'s that only tops up an epoch's last global batch (a
    repeated sample, weight 0) adds nothing to the statistics and passes no gradient back through them.
    Takes torch's BatchNorm arguments (num_features, eps, momentum, affine, track_running_stats);
    prepare(sync_batchnorm=True) converts a model's BatchNorm layers.
    """

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x` of shape (N, C, ...) over the global batch (training) or the running statistics.

        In training mode with 2+ ranks every rank must call it, the same number of times in the same
        order (one all-reduce each). Updates the running statistics from the global batch.

        Raises:
            ValueError: `x` has fewer than 2 dimensions.
        """
        if not self.training or not hvd.is_initialized() or hvd.size() == 1:
            return super().forward(x)
        self._check_input_dim(x)
        channels = x.size(1)
        dims = [0, *range(2, x.dim())]
        # Statistics in float32 at least (a bf16/fp16 input under autocast would lose them to rounding), on
        # the input's device; the variance clamped at 0 (E[x^2] - E[x]^2 can round below it).
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        # A top-up batch (shard() repeats a sample so that no rank is empty-handed) weighs 0: it contributes
        # zeros, and the statistics it is normalised with pass it no gradient, while every rank still takes
        # part in the all-reduce and its backward.
        top_up = _Batch.is_top_up()
        count = torch.tensor([0 if top_up else x.numel() // channels], dtype=xf.dtype, device=x.device)
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        stats = _WeightedSum.apply(local * 0 if top_up else local, _Batch.factor(_Batch.current))
        if top_up:
            stats = stats.detach() + stats * 0
        n = stats[-1]
        mean = stats[:channels] / n
        var = (stats[channels:2 * channels] / n - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * n / max(float(n) - 1, 1.0), alpha=m)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


class _WeightedSum(torch.autograd.Function):
    """The all-reduce (sum) of the ranks' statistics, whose backward weights each rank's share of the gradient
    as prepare()'s hooks weight that rank's parameters.

    At an epoch's uneven last step each rank's gradients are multiplied by its batch's weight w (_Batch: its
    share of the step's samples), so that the average over the ranks is one process's mean. A gradient that
    reaches this rank's input through the global statistics comes from every rank's loss; the plain sum sent
    it back unweighted, and this rank's hook then weighted all of it by this rank's w (the zoo's syncbn case:
    1.9e-4 off one process at 8 and 7 samples). Here each rank sends w times its share, and the sum is divided
    by this rank's w, which its hooks multiply back. A top-up batch (w = 0) passes no gradient back, as before,
    and still takes part in the all-reduce."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return hvd.allreduce(local, op=hvd.Sum)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.weight
        total = hvd.allreduce(grad * w, op=hvd.Sum)
        return (total / w if w else torch.zeros_like(grad)), None


def _convert_sync_batchnorm(module: torch.nn.Module) -> None:
    """Replace BatchNorm layers in place by SyncBatchNorm, sharing parameters and buffers."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(child, SyncBatchNorm):
            sync = SyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                 child.track_running_stats)
            if child.affine:
                sync.weight, sync.bias = child.weight, child.bias
            if child.track_running_stats:
                sync.running_mean, sync.running_var = child.running_mean, child.running_var
                sync.num_batches_tracked = child.num_batches_tracked
            sync.train(child.training)
            setattr(module, name, sync)
        else:
            _convert_sync_batchnorm(child)
