"""layerwatch with a plain PyTorch training loop.

    python examples/plain_pytorch.py
    tensorboard --logdir runs/plain_pytorch
"""

import torch
import torch.nn.functional as F
from torch import nn

from layerwatch import Inspector, dense_then_every

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(4096, 20)
y = (x[:, :5].sum(dim=1) > 0).long()

# Every step for the first 20 steps (where things go wrong early), then every 25th.
with Inspector(model, log_dir="runs/plain_pytorch", schedule=dense_then_every(first=20, every=25),
               optimizer=optimizer) as inspector:
    for step in range(300):
        idx = torch.randint(0, len(x), (128,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        inspector.step()  # once per optimizer step, after optimizer.step()
print("logs in runs/plain_pytorch; view with: tensorboard --logdir runs/plain_pytorch")
