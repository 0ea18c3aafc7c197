"""The replay: a NaN that strikes between samples is traced to the module that made it, by
running the bad step's batch again before the optimizer step, and training is left exactly
as it would have been."""

from __future__ import annotations

import random
import tempfile
import warnings
from typing import Optional

import numpy as np
import pytest
import torch
from torch import nn

from layerwatch import Inspector
from layerwatch.faults.replay import SavedState
from layerwatch.schedule import at_steps
from models import FAULT_STEP, BackwardFaultAt, FaultAt, compile_as, make_model, same_tensors, train_steps

STEPS = 10


class FiniteSGD(torch.optim.Optimizer):
    """Plain SGD that applies only the finite values of each gradient (the gradients stay as
    they are): one bad batch leaves the weights finite, so the step after it is clean."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # Lightning's: the forward and backward
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.nan_to_num(0.0, 0.0, 0.0), alpha=-group["lr"])


def run(fault: FaultAt, *, inspect: bool = True, replay: bool = True, optimizer=torch.optim.SGD, log_dir=None,
        steps: int = STEPS, closure_wrapper=None, every: Optional[int] = 50):
    """Train with the fault; returns (losses as exact strings, final weights and buffers, RNG
    states, the inspector's alerts, warnings). ``every=None``: the Inspector's defaults."""
    model = make_model(fault)
    opt = optimizer(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]
    random.seed(3)
    np.random.seed(3)
    alerts = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        log_dir = log_dir or tempfile.mkdtemp()
        inspector = Inspector(model, log_dir=log_dir, every_n_steps=every, optimizer=opt).start() if inspect else None
        losses = train_steps(model, fault, opt, data, inspector, closure_wrapper, replay)
        if inspector is not None:
            alerts = list(inspector.alerts)
            inspector.finish()
    state = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    rng = (torch.get_rng_state(), random.getstate(), repr(np.random.get_state()))
    return losses, state, rng, alerts, [str(w.message) for w in seen]


def offender_alerts(alerts):
    return [a for a in alerts if a.kind == "nonfinite" and not a.message.startswith("NaN/Inf values")]


def test_a_forward_nan_between_samples_is_named_by_replaying_its_step(tmp_path, events):
    losses, _, _, alerts, said = run(FaultAt(), log_dir=tmp_path)
    (alert,) = offender_alerts(alerts)
    assert (alert.step, alert.name) == (FAULT_STEP, "4")
    assert alert.message == ("first offender: step 7, forward: 4 turned finite inputs into a non-finite output "
                             "(replayed from step 7)")
    sentinel = [m for m in said if "the sentinel" in m]
    assert len(sentinel) == 1 and "its batch is run again with every probe armed, before the optimizer step" in sentinel[0]
    acc = events(tmp_path)
    (text,) = acc.Tensors("layerwatch/first_offender/text_summary")
    assert text.step == FAULT_STEP and "(replayed from step 7)" in text.tensor_proto.string_val[0].decode()
    assert [(e.step, e.value) for e in acc.Scalars("layerwatch/first_nonfinite_step")] == [(7, 7.0)]
    # the replayed step is recorded with what its probes saw
    flags = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"] if tag.startswith("nonfinite/")}
    assert all(flags[f"nonfinite/{m}"][FAULT_STEP] == 1.0 for m in "01234567")  # forward from 4 on, backward all
    assert losses[FAULT_STEP] == "nan"


def test_a_one_batch_fault_is_named_though_the_step_after_it_is_clean():
    *_, alerts, said = run(FaultAt(), optimizer=FiniteSGD)
    (alert,) = offender_alerts(alerts)
    assert (alert.step, alert.name) == (FAULT_STEP, "4") and "(replayed from step 7)" in alert.message
    # without the replay the armed step is clean: nothing is named, and the warning says why
    *_, alerts, said = run(FaultAt(), optimizer=FiniteSGD, replay=False)
    assert offender_alerts(alerts) == []
    (sentinel,) = [m for m in said if "the sentinel" in m]
    assert "the next step is sampled with every probe armed; it shows what came after the fault" in sentinel
    assert "Inspector.replay_with(closure)" in sentinel


def test_without_a_replay_the_step_after_a_poisoning_fault_never_names_a_first_offender():
    *_, alerts, _ = run(FaultAt(), replay=False)
    (alert,) = offender_alerts(alerts)
    assert (alert.step, alert.name) == (FAULT_STEP + 1, "0")
    assert alert.message.startswith("first module to use a non-finite weight at step 8: 0 (0.weight, 0.bias, 2.weight "
                                    "and 5 more held NaN/Inf before the step's forward). The fault happened at step 7, "
                                    "between samples; the optimizer carried it into the weights")
    assert "first offender" not in alert.message


def test_a_nan_made_in_backward_is_named_as_a_backward_offender():
    *_, alerts, _ = run(BackwardFaultAt())
    (alert,) = offender_alerts(alerts)
    assert (alert.step, alert.name) == (FAULT_STEP, "4")
    assert alert.message.startswith("first offender: step 7, backward: 4 turned finite gradient with respect to its "
                                    "outputs into a non-finite gradient")


@pytest.mark.parametrize("fault", [FaultAt, BackwardFaultAt])
def test_the_replay_leaves_losses_weights_buffers_and_rng_bitwise_unchanged(fault):
    plain = run(fault(), inspect=False)
    watched = run(fault())
    assert offender_alerts(watched[3])  # the replay ran
    assert watched[0] == plain[0]  # losses, the NaN steps included
    assert same_tensors(watched[1], plain[1])  # weights, BatchNorm's running statistics and count
    assert torch.equal(watched[2][0], plain[2][0]) and watched[2][1:] == plain[2][1:]  # torch, Python, NumPy RNG


def test_a_grad_scaler_overflow_is_not_a_fault_and_is_not_replayed(tmp_path, events):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-60)
    calls = []
    with Inspector(model, log_dir=tmp_path, every_n_steps=50, optimizer=opt) as inspector:
        for k in range(4):
            x = torch.randn(16, 8)

            def compute_loss(x=x):
                calls.append(k)
                return model(x).pow(2).mean() * 1e4

            inspector.replay_with(compute_loss)
            opt.zero_grad()
            scaler.scale(compute_loss()).backward()
            scaler.step(opt)  # step 0 overflows: skipped, so neither checked before the step nor replayed
            scaler.update()
            inspector.step()
    assert scaler.get_scale() < 2.0**127  # the overflow did happen
    assert calls == [0, 1, 2, 3]
    assert "layerwatch/first_nonfinite_step" not in events(tmp_path).Tags()["scalars"]
    assert inspector.alerts == []


def test_a_replay_that_raises_is_warned_and_training_goes_on_unchanged():
    def failing_on_replay(compute_loss):
        def closure():
            raise RuntimeError("the batch is gone")

        return closure

    plain = run(FaultAt(), inspect=False)
    losses, state, _, alerts, said = run(FaultAt(), closure_wrapper=failing_on_replay)
    assert losses == plain[0] and same_tensors(state, plain[1])
    assert any("could not replay step 7's batch at step 7: RuntimeError('the batch is gone')" in m for m in said)
    (alert,) = offender_alerts(alerts)  # what the step after it shows, said as such
    assert alert.step == FAULT_STEP + 1 and alert.message.startswith("first module to use a non-finite weight")


def test_a_fault_the_replay_does_not_make_again_is_said_so():
    class Once(FaultAt):
        def forward(self, x):
            out = super().forward(x)
            self.now = -1  # a fault that does not happen twice
            return out

    *_, alerts, said = run(Once())
    assert any("step 7's batch, run again with every probe armed, made no NaN/Inf" in m for m in said)
    assert all("first offender" not in a.message for a in alerts)


def test_weights_already_non_finite_are_not_replayed_and_the_fault_is_said_to_come_before(tmp_path):
    """On the CPU the sentinel checks a rotating share of the gradients: a fault it misses
    reaches the weights first, and a replay then would only name their first user."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.fault, self.b = nn.Linear(8, 8), FaultAt(3), nn.Linear(8, 1)
            self.pad = nn.Parameter(torch.zeros(4 << 20))  # 16 MiB, never used: the sentinel's share is a 32nd

        def forward(self, x):
            return self.b(self.fault(self.a(x)))

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(40)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(net, log_dir=tmp_path, every_n_steps=1000, optimizer=opt) as inspector:
            train_steps(net, net.fault, opt, batches, inspector)
    assert offender_alerts(inspector.alerts)  # found, rotations later, at step k: never "first offender"
    (alert,) = offender_alerts(inspector.alerts)
    assert alert.message.startswith(f"first module to use a non-finite weight at step {alert.step}: a (a.weight, ")
    assert f"The fault happened before step {alert.step - 1}, between samples" in alert.message
    (sentinel,) = [str(w.message) for w in seen if "(the sentinel, " in str(w.message)]
    assert "the weights held NaN/Inf already, so the fault came earlier" in sentinel


def test_the_gradients_of_parameters_beyond_the_model_are_put_back_too(tmp_path):
    """The Inspector watches ``enc``; the optimizer and the closure also reach ``head``."""

    def run(inspect: bool) -> torch.Tensor:
        torch.manual_seed(0)
        fault = FaultAt(2)
        enc, head = nn.Sequential(nn.Linear(4, 4), fault), nn.Linear(4, 1)
        opt = FiniteSGD(list(enc.parameters()) + list(head.parameters()), lr=0.1)
        batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
        inspector = Inspector(enc, log_dir=tmp_path, every_n_steps=100, optimizer=opt).start() if inspect else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train_steps(lambda x: head(enc(x)), fault, opt, batches, inspector)
        if inspector is not None:
            assert offender_alerts(inspector.alerts)[0].message.endswith("(replayed from step 2)")
            inspector.finish()
        return head.weight.detach().clone()

    assert torch.equal(run(True), run(False))


def test_with_two_optimizers_the_second_ones_gradients_are_checked_before_its_step(tmp_path):
    """A GAN-like loop: G steps, then D's own backward makes the NaN; found at that step."""
    torch.manual_seed(0)
    fault = FaultAt(3)
    g_net, d_net = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), fault, nn.Linear(4, 1))
    model = nn.ModuleDict({"G": g_net, "D": d_net})
    g_opt, d_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (g_net, d_net))
    inspector = Inspector(model, log_dir=tmp_path, every_n_steps=100, optimizer=g_opt).start()
    inspector.track_optimizers([d_opt])
    d_opt.register_step_pre_hook(lambda opt, *_: inspector.before_optimizer_step(opt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(6):
            fault.now = k
            x = torch.randn(8, 4)
            inspector.replay_with(lambda x=x: d_net(g_net(x)).pow(2).mean())
            g_opt.zero_grad()
            g_net(x).pow(2).mean().backward()
            g_opt.step()
            d_opt.zero_grad()
            d_net(g_net(x).detach()).pow(2).mean().backward()
            d_opt.step()
            inspector.step()
    (alert,) = offender_alerts(inspector.alerts)
    inspector.finish()
    assert (alert.step, alert.name) == (3, "D.1") and alert.message.endswith("(replayed from step 3)")


def test_replay_with_needs_the_optimizer_and_a_callable(tmp_path):
    model = nn.Linear(2, 1)
    with Inspector(model, log_dir=tmp_path) as inspector:
        with pytest.raises(ValueError, match=r"replay_with\(\) needs Inspector\(\.\.\., optimizer=opt\)"):
            inspector.replay_with(lambda: model(torch.ones(1, 2)).sum())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, optimizer=opt) as inspector:
        with pytest.raises(TypeError, match="closure must be callable, got Tensor"):
            inspector.replay_with(torch.ones(1))


def test_the_saved_state_restores_reassigned_buffers_gradients_modes_and_every_rng():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model(torch.randn(4, 2)).sum().backward()
    grad = model[0].weight.grad
    before = (torch.get_rng_state(), random.getstate(), repr(np.random.get_state()), model[1].running_mean.clone())
    buffer = model[1].running_mean
    saved = SavedState(model, copy_gradients=True)
    saved.clear_gradients()
    model[1].running_mean = torch.zeros(2)  # a module that swaps its buffer
    buffer.add_(5.0)
    model.eval()
    model(torch.randn(4, 2)).sum().backward()
    torch.rand(3), random.random(), np.random.rand()
    saved.restore()
    assert model[1].running_mean is buffer and torch.equal(buffer, before[3])
    assert model[0].weight.grad is grad and model.training and model[1].training
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert repr(np.random.get_state()) == before[2]


# ---------------------------------------------------------------------- Lightning

L = pytest.importorskip("lightning.pytorch")


class FaultyModule(L.LightningModule):
    """The issue's model under Lightning: ``fault`` makes a NaN at global step ``FAULT_STEP``
    (on the micro-batches with ``batch_idx % accumulate == faulty_micro``)."""

    def __init__(self, accumulate: int = 1, faulty_micro: int = 0, manual: bool = False, optimizer=torch.optim.SGD) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.fault = FaultAt()
        self.body = make_model(self.fault)
        self.accumulate, self.faulty_micro = accumulate, faulty_micro
        self.automatic_optimization = not manual
        self.losses: list[str] = []

    def loss_of(self, batch, batch_idx):
        x, y = batch
        at_fault = batch_idx % self.accumulate == self.faulty_micro
        self.fault.now = self.global_step if at_fault else -1
        return nn.functional.mse_loss(self.body(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss_of(batch, batch_idx)
        self.log("batches_logged", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(repr(outputs["loss"].item()))

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=0.05)


def fit(root, callback=None, *, accumulate: int = 1, faulty_micro: int = 0, manual: bool = False,
        optimizer=torch.optim.SGD):
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32 * STEPS * accumulate, 8, generator=g),
                                          torch.randn(32 * STEPS * accumulate, 1, generator=g))
    module = FaultyModule(accumulate, faulty_micro, manual, optimizer)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[callback] if callback else [],
                        logger=False, default_root_dir=str(root), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=1 if manual else accumulate)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=32))
    state = [t.detach().clone() for t in list(module.parameters()) + list(module.buffers())]
    return module.losses, state, float(trainer.callback_metrics["batches_logged"]), [str(w.message) for w in seen]


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, FiniteSGD], ids=["poisoned-weights", "one-bad-batch"])
def test_lightning_replays_the_bad_step_and_leaves_training_and_its_logs_unchanged(tmp_path, optimizer):
    from layerwatch import InspectCallback

    plain = fit(tmp_path, optimizer=optimizer)
    callback = InspectCallback(every_n_steps=50)
    watched = fit(tmp_path, callback, optimizer=optimizer)
    (alert,) = offender_alerts(callback.alerts)
    assert (alert.step, alert.name) == (FAULT_STEP, "fault")
    assert alert.message == ("first offender: step 7, forward: fault turned finite inputs into a non-finite output "
                             "(replayed from step 7)")
    assert watched[0] == plain[0] and same_tensors(watched[1], plain[1])
    assert watched[2] == plain[2] == STEPS  # the replay's self.log calls were dropped


@pytest.mark.parametrize("door", ["Inspector", "InspectCallback"])
def test_at_the_defaults_a_nan_between_samples_is_replayed_to_its_module(door, tmp_path):
    """The overhead budget's schedule (steps 0 and 1, then its interval): step 7 is not sampled."""
    from layerwatch import InspectCallback

    if door == "Inspector":
        plain, watched = run(FaultAt(), inspect=False), run(FaultAt(), every=None)
        alerts = watched[3]
    else:
        callback = InspectCallback()
        plain, watched = fit(tmp_path), fit(tmp_path, callback)
        alerts = callback.alerts
    name = "4" if door == "Inspector" else "fault"  # the Sequential's 5th module, or the LightningModule's own
    (alert,) = offender_alerts(alerts)
    assert alert.message == f"first offender: step 7, forward: {name} turned finite inputs into a non-finite output (replayed from step 7)"
    assert watched[0] == plain[0] and same_tensors(watched[1], plain[1])


def test_lightning_with_gradient_accumulation_names_the_micro_batch_that_made_it(tmp_path):
    from layerwatch import InspectCallback

    plain = fit(tmp_path, accumulate=2, faulty_micro=1)
    callback = InspectCallback(every_n_steps=50)
    watched = fit(tmp_path, callback, accumulate=2, faulty_micro=1)
    (alert,) = offender_alerts(callback.alerts)
    assert (alert.step, alert.name) == (FAULT_STEP, "fault")
    assert alert.message.endswith("(replayed from step 7, micro-batch 2 of 2)")
    assert watched[0] == plain[0] and same_tensors(watched[1], plain[1])


def test_lightning_manual_optimization_is_not_replayed_and_says_why(tmp_path):
    from layerwatch import InspectCallback

    plain = fit(tmp_path, manual=True)
    callback = InspectCallback(every_n_steps=50)
    watched = fit(tmp_path, callback, manual=True)
    assert watched[0] == plain[0] and same_tensors(watched[1], plain[1])
    (alert,) = offender_alerts(callback.alerts)
    assert alert.step == FAULT_STEP + 1 and alert.message.startswith("first module to use a non-finite weight at step 8")
    assert "under manual optimization training_step steps the optimizers itself" in alert.message
    assert "InspectCallback(replay=fn)" in alert.message


def test_lightning_manual_optimization_is_replayed_with_the_loss_function_given(tmp_path):
    from layerwatch import InspectCallback

    plain = fit(tmp_path, manual=True)
    callback = InspectCallback(every_n_steps=50, replay=lambda module, batch, batch_idx: module.loss_of(batch, batch_idx))
    watched = fit(tmp_path, callback, manual=True)
    assert watched[0] == plain[0] and same_tensors(watched[1], plain[1]) and watched[2] == plain[2]
    (alert,) = offender_alerts(callback.alerts)
    assert alert.message == ("first offender: step 7, forward: fault turned finite inputs into a non-finite output "
                             "(replayed from step 7)")


def test_lightning_replay_can_be_turned_off(tmp_path):
    from layerwatch import InspectCallback

    callback = InspectCallback(every_n_steps=50, replay=False)
    fit(tmp_path, callback)
    (alert,) = offender_alerts(callback.alerts)
    assert alert.step == FAULT_STEP + 1 and "InspectCallback(replay=False)" in alert.message
    with pytest.raises(TypeError, match=r"replay must be a bool or a callable \(module, batch, batch_idx\) -> loss, got str"):
        InspectCallback(replay="yes")


# ---------------------------------------------------------------------- DDP


def ddp_worker(rank: int, world: int, out: str, inspected: bool, sampled: bool = False) -> None:
    """The fault strikes on rank 1 only. Every rank checks the same synchronized gradients, so
    every rank replays, its own batch, and rank 0 writes what rank 1 found. ``sampled``: the
    fault's step is sampled: rank 0's probes are armed, so no rank replays (the replay may issue
    collectives through the closure's DDP forward: every rank replays or none)."""
    import json

    from torch.nn.parallel import DistributedDataParallel

    from ranks import check_collectives_from_here

    fault = FaultAt(FAULT_STEP if rank == 1 else -5)
    model = make_model(fault)
    ddp = DistributedDataParallel(model)
    check_collectives_from_here()  # every group layerwatch makes from here on is checked
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(10 + rank)
    schedule = at_steps([0, FAULT_STEP] if sampled else [0])
    inspector = Inspector(model, log_dir=f"{out}/run", schedule=schedule, optimizer=opt).start() if inspected else None
    batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(STEPS)]
    losses = train_steps(ddp, fault, opt, batches, inspector)
    alerts = [] if inspector is None else [[a.step, a.name, a.message] for a in inspector.alerts]
    if inspector is not None:
        inspector.finish()
    weights = [repr(v) for p in model.state_dict().values() for v in p.flatten().tolist()]
    with open(f"{out}/rank{rank}-{int(inspected)}.json", "w") as f:
        json.dump({"losses": losses, "weights": weights, "alerts": alerts}, f)


def test_under_ddp_every_rank_replays_and_rank_0_names_another_ranks_offender(tmp_path):
    import json

    from ranks import run_ranks

    for inspected in (False, True):
        run_ranks(ddp_worker, str(tmp_path), inspected, tmp=tmp_path, debug="INFO")
    result = {(r, i): json.loads((tmp_path / f"rank{r}-{i}.json").read_text()) for r in (0, 1) for i in (0, 1)}
    for rank in (0, 1):
        assert result[rank, 1]["losses"] == result[rank, 0]["losses"]
        assert result[rank, 1]["weights"] == result[rank, 0]["weights"]
    offenders = [a for a in result[0, 1]["alerts"] if "offender" in a[2]]
    assert offenders == [[FAULT_STEP, "4", "first offender: step 7, forward: 4 turned finite inputs into a non-finite "
                                           "output (replayed from step 7, rank 1's batch)"]]
    assert result[1, 1]["alerts"] == []  # rank 0 alone reports


def test_under_ddp_a_fault_on_a_step_only_rank_0_probes_neither_hangs_nor_misnames(tmp_path):
    import json

    from ranks import run_ranks

    for inspected in (False, True):
        run_ranks(ddp_worker, str(tmp_path), inspected, True, tmp=tmp_path, debug="INFO")
    result = {(r, i): json.loads((tmp_path / f"rank{r}-{i}.json").read_text()) for r in (0, 1) for i in (0, 1)}
    for rank in (0, 1):
        assert result[rank, 1]["losses"] == result[rank, 0]["losses"]
    # no rank replayed (rank 0's probes watched the step itself), and they saw rank 0's batch stay
    # finite: no first offender is named, only the NaN/Inf the synchronized gradients carried
    assert [a for a in result[0, 1]["alerts"] if "offender" in a[2]] == []
    assert {a[0] for a in result[0, 1]["alerts"]} == {FAULT_STEP}


def ddp_wrapper_worker(rank: int, world: int, out: str) -> None:
    """The Inspector watches the DDP wrapper itself, so the replay runs with its gradient sync
    off; after it DDP's sync flags are as before, and the next forward broadcasts buffers."""
    import json

    from torch.nn.parallel import DistributedDataParallel

    result = {}
    for inspected in (False, True):
        fault = FaultAt()
        ddp = DistributedDataParallel(make_model(fault))
        opt = FiniteSGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(10 + rank)
        batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(STEPS)]
        inspector = Inspector(ddp, log_dir=f"{out}/run", every_n_steps=50, optimizer=opt).start() if inspected else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = train_steps(ddp, fault, opt, batches, inspector)
        flags = [ddp.require_backward_grad_sync, ddp.require_forward_param_sync]
        alerts = [] if inspector is None else [a.message for a in inspector.alerts if "offender" in a.message]
        if inspector is not None:
            inspector.finish()
        state = [repr(v) for t in ddp.state_dict().values() for v in t.flatten().tolist()]
        result[inspected] = {"losses": losses, "state": state, "flags": flags, "alerts": alerts}
    with open(f"{out}/wrapper{rank}.json", "w") as f:
        json.dump(result, f)


def test_a_replay_through_the_ddp_wrapper_puts_its_sync_flags_back(tmp_path):
    import json

    from ranks import run_ranks

    run_ranks(ddp_wrapper_worker, str(tmp_path), tmp=tmp_path, debug="INFO")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"wrapper{rank}.json").read_text())
        plain, watched = result["false"], result["true"]
        assert watched["flags"] == plain["flags"] == [True, True]
        assert watched["losses"] == plain["losses"] and watched["state"] == plain["state"]  # BatchNorm's buffers too
    assert watched["alerts"] == []  # rank 1's: rank 0 alone reports
    rank0 = json.loads((tmp_path / "wrapper0.json").read_text())["true"]["alerts"]
    assert rank0 == ["first offender: step 7, forward: module.4 turned finite inputs into a non-finite output "
                     "(replayed from step 7)"]


# ---------------------------------------------------------------------- compiled code


@pytest.mark.parametrize("how, backend", [("torch.compile(model)", "aot_eager"), ("model.compile()", "aot_eager"),
                                          ("torch.compile(loss_fn)", "aot_eager"), ("torch.compile(model)", "inductor")])
def test_a_compiled_model_is_replayed_eagerly_with_no_recompile_and_bitwise_losses(tmp_path, how, backend):
    """The replay runs compiled code eagerly (``torch.compiler.set_stance("force_eager")``), so
    the probes see every module; the compiled graphs are neither remade nor thrown away. With
    Inductor too: its dropout draws its seeds from torch's generator, which the replay puts back."""
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    if not hasattr(torch.compiler, "set_stance"):
        pytest.skip("torch.compiler.set_stance needs torch 2.6")

    def run(inspect: bool):
        dynamo.reset()
        counters.clear()
        fault = FaultAt()
        model = make_model(fault)
        call = compile_as(model, how, backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(STEPS)]
        inspector = Inspector(call, log_dir=tmp_path, every_n_steps=50, optimizer=opt).start() if inspect else None
        forward = call
        if how == "torch.compile(loss_fn)":
            forward = torch.compile(lambda x: model(x), backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = train_steps(forward, fault, opt, batches, inspector)
        alerts = [] if inspector is None else [a.message for a in offender_alerts(inspector.alerts)]
        if inspector is not None:
            inspector.finish()
        counts = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                  sum(counters["recompiles"].values()) if "recompiles" in counters else 0)
        return losses, [t.detach().clone() for t in model.state_dict().values()], alerts, counts

    plain, watched = run(False), run(True)
    assert watched[0] == plain[0] and same_tensors(watched[1], plain[1])
    assert watched[3][0] == plain[3][0] and watched[3][2] == plain[3][2]  # graph breaks, recompiles: as without layerwatch
    assert watched[3][1] <= plain[3][1] + 1  # graphs: the traced probe's armed variant at most
    assert watched[2] == ["first offender: step 7, forward: 4 turned finite inputs into a non-finite output "
                          "(replayed from step 7)"]


@pytest.mark.parametrize("how", ["torch.compile(model)", "torch.compile(loss_fn)"])
def test_a_compiled_models_layer_table_comes_from_one_eager_forward_of_its_batch(tmp_path, events, how):
    """A compiled model gets its layer table (names as uncompiled, MACs) from its first sampled
    step's re-run (a compiled function's batch given by ``replay_with``), with the very graphs and
    bitwise losses."""
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    if not hasattr(torch.compiler, "set_stance"):
        pytest.skip("torch.compiler.set_stance needs torch 2.6")

    def run(log_dir):
        dynamo.reset()
        counters.clear()
        fault = FaultAt(-1)  # never
        model = make_model(fault)
        call = torch.compile(model, backend="aot_eager") if how == "torch.compile(model)" else model
        forward = torch.compile(lambda x: model(x), backend="aot_eager") if how == "torch.compile(loss_fn)" else call
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(4)]
        inspector = None if log_dir is None else Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt).start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = train_steps(forward, fault, opt, batches, inspector)
        if inspector is not None:
            inspector.finish()
        return losses, (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                        sum(counters["recompiles"].values()) if "recompiles" in counters else 0)

    plain, watched = run(None), run(tmp_path)
    assert watched[0] == plain[0]
    assert watched[1] == plain[1]  # graph breaks, graphs, recompiles
    acc = events(tmp_path)
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert table.step == 0 and "Sequential" in text and "  0 (Linear)  " in text and "4 (FaultAt)" in text
    assert "_orig_mod" not in text and "OptimizedModule" not in text
    assert [e.value for e in acc.Scalars("layerwatch/macs_per_step")][0] > 0


LIGHTNING_DDP = """
import lightning.pytorch as L
from lightning.pytorch.loggers import TensorBoardLogger
from pathlib import Path

from ranks import tolerate_abort_at_exit
from layerwatch import InspectCallback
from models import LitFaultOnRankOne

if __name__ == "__main__":
    out = Path({out!r})
    for tag, callbacks in (("plain", []), ("watched", [InspectCallback(every_n_steps=50)])):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=6, callbacks=callbacks,
            logger=TensorBoardLogger(out, name=tag, version=0), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        )
        with tolerate_abort_at_exit(out / f"{{tag}}0.json", out / f"{{tag}}1.json"):
            trainer.fit(LitFaultOnRankOne(str(out), tag))
"""


def test_lightning_ddp_replays_on_every_rank_and_names_rank_ones_module(tmp_path, events):
    import json

    from ranks import run_python

    run_python(LIGHTNING_DDP.format(out=str(tmp_path)))
    for rank in (0, 1):
        plain, watched = (json.loads((tmp_path / f"{tag}{rank}.json").read_text()) for tag in ("plain", "watched"))
        assert watched == plain  # losses and final state (BatchNorm's buffers too), bitwise, on both ranks
    (text,) = events(tmp_path / "watched" / "version_0").Tensors("layerwatch/first_offender/text_summary")
    assert text.step == 3 and text.tensor_proto.string_val[0].decode() == (
        "step 3, forward: fault turned finite inputs into a non-finite output (replayed from step 3, rank 1's batch)")
