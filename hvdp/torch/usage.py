"""prepare()'s allreduce path for the models people fine-tune and route: which parameters got a gradient in a
step (agreed across the ranks), and parameters that became trainable after prepare().

One process skips a parameter whose `.grad` is None: torch's optimizers neither decay it nor advance its step
count. A parameter no sample of the global batch used (an expert no token was routed to, a task head without
a batch, a conditional branch) has a None gradient there. Horovod's DistributedOptimizer instead fills every
missing gradient with zeros and all-reduces them, so AdamW decayed and moved it. Here the ranks agree on which
parameters any of them used, and those no rank used keep `grad = None` on every rank (and are not all-reduced
at all); one some rank used is averaged as before, the others contributing zeros (as one process's batch
would: its samples that did not use it add nothing).

The agreement is one small all-reduce per step (two floats per parameter: used, and used with a sparse
gradient) submitted at the end of the step's last backward pass, so that Horovod fuses it with the last
gradients still in flight; only when no gradient hook ran (or a short last accumulation window) is it
submitted in synchronize(). The sparse flag lets a rank that did not use an `nn.Embedding(sparse=True)` join
the others' all-gather with an empty sparse gradient, where Horovod's zero fill sent a dense all-reduce
against their all-gathers (a hang).

A parameter unfrozen after prepare() (`requires_grad_(True)`) or in a param group added by
`optimizer.add_param_group()` had no gradient hook: it trained on its rank's own gradient. It is adopted at
the end of the next backward pass (or at add_param_group): named, hooked like the others (Horovod's all-reduce,
hvdp's weighting of an epoch's uneven last step), and its gradient of that pass weighted as the hook would
have; an added group's learning rate is scaled by prepare()'s rule.
"""

from __future__ import annotations

import os

import torch

from hvdp import _stragglers
from hvdp.torch.runtime import hvd
from hvdp.torch.weights import _Batch, _gradient_hook, at_end_of_backward


class _Usage:
    """What prepare() attaches to Horovod's DistributedOptimizer (as `_hvdp_usage`) for the above."""

    def __init__(self, optimizer, schedule, hooks: list, weighted: set):
        """Args:
            optimizer: Horovod's DistributedOptimizer (its hooks registered, or not in a world of 1).
            schedule: prepare()'s optimizer._Schedule.
            hooks: the model's list of hvdp hook handles (removed when the model is prepared again).
            weighted: the parameters that carry hvdp's gradient hook already (the model's trainable ones).
        """
        self.opt, self.schedule, self.hooks, self.weighted = optimizer, schedule, hooks, weighted
        # Horovod registers its hooks and reduces only in a world of more than one, or under elastic.
        self.reducing = hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"
        self.tracked: list = []        # the parameters the mask covers, in name order (the same on every rank)
        self.pending = None            # the mask's all-reduce handle, submitted once per step
        self.passes = 0                # backward passes ended since the last synchronize()
        self.queued = False            # the end-of-backward callback is queued for the running pass
        self.fresh = False             # a gradient arrived since the last synchronize()
        self._retrack()

    # ---------------------------------------------------------------- hooks
    def gradient_arrived(self) -> None:
        """Called by hvdp's gradient hook of every tracked parameter, in the backward pass."""
        self.fresh = True
        if not self.queued and self.reducing:  # outside a pass (a hook called by hand): synchronize() submits
            self.queued = at_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        _stragglers.backward_done()  # hvdp (issue 47): this pass's last gradient is ready
        self.queued = False
        self.passes += 1
        if self.passes >= self.schedule.passes and self.pending is None:
            self.adopt()
            self._submit()

    # ---------------------------------------------------------------- adoption
    def adopt(self) -> None:
        """Hook every trainable parameter of the param groups that lacks a hook (unfrozen after prepare(), added
        by add_param_group, or trainable but outside the optimizer at prepare()): hvdp's weighting hook, the
        gradient it accumulated unhooked in this step weighted as that hook would have, and Horovod's
        all-reduce hook. Named by its place in the param groups when the model did not name it (the same on
        every rank)."""
        passes, opt = self.schedule.passes, self.opt
        changed = False
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                if not p.requires_grad:
                    continue
                if p not in self.weighted:
                    self.weighted.add(p)
                    self.hooks.append(p.register_hook(_gradient_hook(passes, self.schedule, self)))
                    if p.grad is not None:  # accumulated in this step before the hook existed
                        weight = _Batch.factor(passes) / passes
                        if weight != 1.0:
                            p.grad.mul_(weight)
                if self.reducing and p not in opt._requires_update:
                    opt._parameter_names.setdefault(p, f"hvdp.param_group.{g}.{i}")
                    opt._allreduce_delay[p] = passes
                    opt._requires_update.add(p)
                    with torch.enable_grad():  # adopt() may run inside the backward pass, where grad mode is off
                        grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    grad_acc.register_hook(opt._make_hook(p))
                    opt._grad_accs.append(grad_acc)
                    changed = True
        if changed:
            self._retrack()

    def _retrack(self) -> None:
        names = self.opt._parameter_names
        self.tracked = sorted(self.opt._requires_update, key=lambda p: names[p]) if self.reducing else []

    # ---------------------------------------------------------------- the agreement
    def _submit(self) -> None:
        """All-reduce (sum) this rank's mask: per tracked parameter, used at all, and used with a sparse gradient."""
        handles = self.opt._handles
        used = [p in handles or p.grad is not None for p in self.tracked]
        sparse = [p.grad is not None and p.grad.is_sparse for p in self.tracked]
        mask = torch.tensor(used + sparse, dtype=torch.float32)
        self.pending = hvd.allreduce_async(mask, op=hvd.Sum, name="hvdp.used")

    def before_synchronize(self) -> list:
        """Agree on the step's used parameters before Horovod's synchronize(): those no rank used are taken out
        of its missing-gradient all-reduce (returned, for after_synchronize to put back); a rank that did not
        use a parameter some rank used sparsely gets an empty sparse gradient, to join their all-gathers."""
        self.adopt()
        if not self.reducing or not self.tracked:
            self.passes = 0
            return []
        if self.pending is None:
            self._submit()
        counts = hvd.synchronize(self.pending).tolist()
        self.pending, self.passes = None, 0
        n = len(self.tracked)
        unused = []
        for p, used, sparse in zip(self.tracked, counts[:n], counts[n:]):
            if used == 0:
                unused.append(p)
                self.opt._requires_update.discard(p)
            elif sparse and p not in self.opt._handles and (p.grad is None or not p.grad.is_sparse):
                p.grad = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long, device=p.device),
                                                 torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                                 p.shape)
        return unused

    def abandon(self) -> None:
        """zero_grad() without a step: wait for a mask in flight and forget it (every rank submitted one)."""
        if self.pending is not None:
            hvd.synchronize(self.pending)
        self.pending, self.passes, self.fresh = None, 0, False

    def after_synchronize(self, unused: list) -> None:
        for p in unused:
            self.opt._requires_update.add(p)
            self.opt._allreduce_delay[p] = self.schedule.passes
        self.fresh = False
