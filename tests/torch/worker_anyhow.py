# A training script written as tutorials write them: no `if __name__ == "__main__":` guard, run by
# tests/torch/test_worker_starts.py as a file (under horovodrun), as `python - < this`, as `python -c`, and in a
# notebook kernel. TensorDataset and the default collate are importable, so nothing of this script is sent to
# shard()'s DataLoader workers, and they never import it. With HVDP_TEST_LOCAL_DATASET=1 the dataset is a class
# defined here instead: the workers would need this script, which shard() refuses before the first batch.
import json
import os

import torch

import hvdp.torch as ht

world = ht.init()
torch.manual_seed(0)
x = torch.randn(64, 3)
y = x @ torch.tensor([[1.0], [2.0], [-1.0]])
data = torch.utils.data.TensorDataset(x, y)
if os.environ.get("HVDP_TEST_LOCAL_DATASET") == "1":
    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return x[i], y[i]
    data = Pairs()
loader = ht.shard(data, batch_size=4, seed=0, num_workers=2)
model = torch.nn.Linear(3, 1)
opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
pids = set()
for epoch in range(2):
    for xb, yb in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    pids |= {w.pid for w in getattr(loader._iterator, "_workers", [])}
print("result:", json.dumps({"rank": world.rank, "size": world.size, "weights": model.weight.flatten().tolist(),
                             "workers": len(pids)}), flush=True)
