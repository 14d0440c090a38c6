"""The benchmark models, defined here so every implementation trains exactly the same thing (no downloads)."""

from torch import nn

# name -> (factory, input shape of one sample, per-rank batch)
MODELS = {
    # Compute-bound: ~94K parameters, lots of convolution per byte communicated.
    "cnn": (lambda: nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10)), (3, 32, 32), 32),
    # Communication-heavy: 6.4M parameters, little compute per parameter.
    "mlp": (lambda: nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)),
        (1024,), 64),
}


def parameters(name: str) -> int:
    return sum(p.numel() for p in MODELS[name][0]().parameters())
