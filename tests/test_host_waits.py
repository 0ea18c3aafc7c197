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
    sampled step (forward, backward, optimizer step, with every hook of ours, and a compiled
    model's re-run) waits nowhere; closing it (``inspector.step()``) brings its measurements to
    the host, one transfer per device for each of: the probes (of the step, or of its re-run), the
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
                inspector.replay_with(lambda: loss_of(x, y))  # (a compiled function's batch, for its re-run)
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
    assert len(transfers) == 2  # the probes', the parameters'

    assert math.isfinite(loss.item())


def _engine_of(door):
    return door._engine


@pytest.mark.parametrize("door", ["Inspector", "InspectCallback", "InspectTrainerCallback"])
def test_an_unsampled_step_makes_the_host_wait_nowhere_on_every_front_door(tmp_path, monkeypatch, door):
    """At the defaults (the overhead budget, the sentinel, Lightning's replay), taking the
    accelerator's way on the CPU: no unsampled step issues an op that makes the host wait, and
    the sentinel's check is waited for before the optimizer step (for a replay: a device sync)
    only once the budget has measured the checks within their share, never before."""
    from layerwatch import stats
    from layerwatch.faults.sentinel import NonfiniteSentinel

    for home in (stats, stats.batched):
        monkeypatch.setattr(home, "host_reads_free", lambda device: False)
    engines, polled = [], []
    poll = NonfiniteSentinel.poll

    def recorded_poll(self, wait=False, at_hand=None):
        engine = engines[0]
        if wait and not engine.sampled:
            polled.append((engine.current_step, engine._sampling.checks_measured, engine._sampling.sentinel_spread))
        return poll(self, wait, at_hand)

    monkeypatch.setattr(NonfiniteSentinel, "poll", recorded_poll)
    unsampled_waits = []

    class Unsampled(HostWaits):
        """Waits issued by layerwatch's own code (the innermost frame outside torch is ours: the
        loops' own reads of the loss, Lightning's and the Trainer's, are not) on unsampled steps."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = len(self.seen)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if len(self.seen) > before and engines and not engines[0].sampled:
                caller = next(frame for frame in reversed(traceback.extract_stack())
                              if "/torch/" not in frame.filename and "test_host_waits" not in frame.filename)
                if "/layerwatch/" in caller.filename:
                    unsampled_waits.append(self.seen[-1] + (engines[0].current_step,))
            return out

    waits = Unsampled()
    steps = 24  # past the budget's first measures of the checks (every 8 unsampled steps)
    with warnings.catch_warnings(), waits:
        warnings.simplefilter("ignore")
        if door == "Inspector":
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            inspector = Inspector(model, log_dir=tmp_path, optimizer=opt).start()
            engines.append(_engine_of(inspector))
            x, y = torch.randn(16, 8), torch.randn(16, 4)
            for _ in range(steps):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                inspector.step()
            inspector.finish()
        elif door == "InspectCallback":
            from layerwatch import InspectCallback
            from models import LitMLP, make_trainer

            callback = InspectCallback()
            original_setup = type(callback).setup

            def setup(self, *args, **kwargs):
                original_setup(self, *args, **kwargs)
                engines.append(self._engine)

            monkeypatch.setattr(type(callback), "setup", setup)
            make_trainer(tmp_path, [callback], max_steps=steps).fit(LitMLP())
        else:
            transformers = pytest.importorskip("transformers")
            from layerwatch.huggingface import InspectTrainerCallback
            from hf_models import tiny, train

            callback = InspectTrainerCallback()
            original = type(callback).on_train_begin

            def on_train_begin(self, *args, **kwargs):
                out = original(self, *args, **kwargs)
                engines.append(self._engine)
                return out

            monkeypatch.setattr(type(callback), "on_train_begin", on_train_begin)
            assert transformers
            train(tiny("gpt2"), tmp_path, [callback], max_steps=steps)
    assert engines and engines[0].current_step >= steps - 2
    assert unsampled_waits == [], unsampled_waits
    # waited for (the replay Lightning's and the Trainer's doors offer) only once the budget measured the checks
    # within their share, whole (where it spread them, as it may for so short a step, never)
    assert all(measured and spread == 1 for _, measured, spread in polled), polled
    if door == "Inspector":
        assert polled == []  # no replay offered: nothing is ever waited for
