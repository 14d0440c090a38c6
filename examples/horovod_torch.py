"""A Horovod 0.28 PyTorch script, as its users write it (horovod.torch, no hvdp): it runs unchanged on hvdp's
Horovod build with torch 2.13 (docs/porting.md#from-horovod). Run it as Horovod's scripts run:

    horovodrun -np 2 -H localhost:2 python examples/horovod_torch.py

The data: scikit-learn's bundled handwritten digits (no download), each rank reading its shard through a
DistributedSampler. The last line, per rank: `result: {...}` with the first and last epoch's averaged loss,
the test accuracy and a checksum of the weights (the same on every rank when the gradients were averaged).
"""

import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import horovod.torch as hvd

# Horovod: initialize library.
hvd.init()
torch.manual_seed(1 + hvd.rank())  # every rank starts from its own weights ...
torch.set_num_threads(1)

digits = load_digits()
x = torch.tensor(digits.images / 16.0, dtype=torch.float32).reshape(-1, 64)
y = torch.tensor(digits.target, dtype=torch.int64)
train = torch.utils.data.TensorDataset(x[:1437], y[:1437])
test = torch.utils.data.TensorDataset(x[1437:], y[1437:])

# Horovod: use DistributedSampler to partition the training data.
train_sampler = torch.utils.data.distributed.DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train, batch_size=32, sampler=train_sampler)
test_sampler = torch.utils.data.distributed.DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank(),
                                                               shuffle=False)
test_loader = torch.utils.data.DataLoader(test, batch_size=100, sampler=test_sampler)

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

# Horovod: scale learning rate by the number of GPUs.
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)

# Horovod: broadcast parameters & optimizer state (... and this makes them rank 0's).
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


losses = []
for epoch in range(12):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    total = 0.0
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.item()
    losses.append(metric_average(total / len(train_loader), "avg_loss"))
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {losses[-1]:.4f}", flush=True)

model.eval()
correct = 0
with torch.no_grad():
    for data, target in test_loader:
        correct += (model(data).argmax(1) == target).sum().item()
# Horovod: average metric values across workers (the sampler pads the last rank's shard to equal sizes).
test_accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
checksum = float(sum(p.detach().abs().sum() for p in model.parameters()))
print("result: " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "first_loss": losses[0],
                               "last_loss": losses[-1], "test_accuracy": test_accuracy,
                               "weights_checksum": checksum}), flush=True)
