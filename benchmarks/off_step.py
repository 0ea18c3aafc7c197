"""The cost of an unsampled step on the smallest model, where nothing hides it.

    python benchmarks/off_step.py

A one-layer model, a zero learning rate; 7 rounds of 3,000 steps of `opt.step()` alone, then of
`opt.step()` + `inspector.step()` with no step sampled (sentinel and alerts off). Prints the
medians and what the inspector adds per step (its optimizer hooks are in both figures).
"""

import statistics
import tempfile
import time

import torch
from torch import nn
from layerwatch import Inspector, at_steps
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.0)
x = torch.randn(2, 8)
ins = Inspector(model, log_dir=tempfile.mkdtemp(), schedule=at_steps([10**9]), optimizer=opt, sentinel=False, alerts=False).start()
def measure(with_ins, n=3000):
    t = time.perf_counter_ns()
    for _ in range(n):
        opt.step()
        if with_ins: ins.step()
    return (time.perf_counter_ns() - t) / n / 1e3
rounds = [(measure(False), measure(True)) for _ in range(7)]
print("opt.step alone %.2f us; with inspector %.2f us; added %.2f us" % (
    statistics.median(a for a, _ in rounds), statistics.median(b for _, b in rounds), statistics.median(b - a for a, b in rounds)))
ins.finish()
