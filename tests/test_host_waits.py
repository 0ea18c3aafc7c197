"""No hook makes the host wait for the device: a sampled step (forward, backward, optimizer
step) run under a dispatch mode that records every op that would, on a GPU, block the host
until the device is done (``aten._local_scalar_dense`` behind ``.item()``, ``float()`` and
``bool()`` of a tensor; ``nonzero``, ``masked_select``, ``unique``; boolean-mask indexing; and
``repeat_interleave`` without ``output_size``). Run on the CPU, so that it holds without a GPU."""

import contextlib
import math
import traceback
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from layerwatch import Inspector
from models import Spoiler, spoilable

aten = torch.ops.aten
WAITING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.unique_dim, aten._unique2, aten._unique,
           aten.unique_consecutive, aten.nonzero_static}


class HostWaits(TorchDispatchMode):
    """Every op that makes the host wait, with the layerwatch function (file:function) that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        waits = packet in WAITING or (packet is aten.repeat_interleave and kwargs.get("output_size") is None) or (
            packet is aten.index and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None))
        if waits:
            ours = [f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}" for frame in traceback.extract_stack()
                    if "/layerwatch/" in frame.filename]
            self.seen.append((str(packet), ours[-1] if ours else "-"))
        return func(*args, **kwargs)


@pytest.mark.parametrize("how", ["eager", "torch.compile(model)", "torch.compile(loss_fn)"])
def test_a_sampled_step_makes_the_host_wait_nowhere_but_its_one_transfer(tmp_path, monkeypatch, how):
    """The CPU reads values freely, and layerwatch does there (``stats.host_reads_free``); the
    test takes the accelerator's way instead, so that what it sees is what a GPU run does. The
    sampled step (forward, backward, optimizer step, with every hook of ours) waits nowhere;
    closing it (``inspector.step()``) brings its measurements to the host, one transfer per
    device for each of: the eager probes, the traced probe (where the model runs compiled), the
    parameter families. The NaN sentinel's flag, enqueued in the optimizer's step pre-hook, is read
    once its copy has landed (on a GPU: a pinned copy behind an event, read a step later)."""
    from layerwatch import stats

    for home in (stats, stats.batched):  # the name the probes read, and the batched reduction's
        monkeypatch.setattr(home, "host_reads_free", lambda device: False)
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = spoilable(Spoiler())
    call = torch.compile(model, backend="aot_eager") if how == "torch.compile(model)" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_of = lambda x, y: nn.functional.mse_loss(call(x), y)  # noqa: E731
    if how == "torch.compile(loss_fn)":
        loss_of = torch.compile(loss_of, backend="aot_eager")
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    waits, transfers = HostWaits(), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspector = Inspector(call, log_dir=tmp_path, every_n_steps=2, optimizer=opt).start()
        for step in range(5):
            with waits if step == 4 else contextlib.nullcontext():  # sampled, after its graphs are made
                opt.zero_grad()
                loss = loss_of(x, y)
                loss.backward()
                opt.step()
            if step == 4:
                in_step = list(waits.seen)
                original = stats.to_host
                monkeypatch.setattr(stats, "to_host", lambda pieces: transfers.append(len(pieces)) or original(pieces))
                with waits:
                    inspector.step()
                closing = waits.seen[len(in_step):]
            else:
                inspector.step()
        inspector.finish()
    # No hook of ours (nor the model) made the host wait: the sentinel's check, in the optimizer's step pre-hook, is
    # copied to the host behind an event (a pinned copy on a GPU) and read once it has landed
    assert in_step == [], in_step
    assert all(where.startswith("sentinel.py:") for _, where in closing), closing
    # eager: the probes', the parameters'; a compiled model: the wrapper's eager probe too
    assert len(transfers) == {"eager": 2, "torch.compile(model)": 3, "torch.compile(loss_fn)": 2}[how]
    assert math.isfinite(loss.item())
