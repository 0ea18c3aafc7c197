"""Adam's own state per parameter tensor (the "optimizer" family): exact against the optimizer's
formulas for every implementation torch has, read without changing a bit of the run, said once
for other optimizers; the sign-like and ε-bound alerts each provoked, and each door writes it."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from layerwatch import AlertRules, Inspector
from layerwatch.distributed.sharding import this_ranks_groups
from layerwatch.measure.optimizer_state import AdamState, adam_optimizer, spike_fractions, update_stats
from models import MLP, tab_values, train

IMPLEMENTATIONS = [dict(), dict(foreach=True), dict(foreach=False), dict(fused=True), dict(amsgrad=True)]


def reader() -> tuple[AdamState, dict[str, str]]:
    said: dict[str, str] = {}  # as FailurePolicy.say_once says them: once a key
    return AdamState(lambda pairs, what: this_ranks_groups(pairs, lambda key, message: None),
                     lambda key, message: said.setdefault(key, message)), said


def by_hand(opt: torch.optim.Adam, p: nn.Parameter, v_before: torch.Tensor, grad: torch.Tensor) -> tuple[float, float, float]:
    """The three statistics of ``p`` from the optimizer's own formulas, in float64."""
    state, group = opt.state[p], opt.param_groups[0]
    beta1, beta2 = group["betas"]
    t = float(state["step"])
    v = (state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]).double()
    m_hat, v_hat = state["exp_avg"].double() / (1 - beta1**t), v / (1 - beta2**t)
    update_rms = (m_hat / (v_hat.sqrt() + group["eps"])).pow(2).mean().sqrt().item()
    has_grad = grad != 0
    eps_frac = ((v_hat.sqrt() < 10 * group["eps"]) & has_grad).sum().item() / has_grad.sum().item()
    judged = has_grad & (v_before > 0)
    v_hat_before = v_before.double() / (1 - beta2 ** (t - 1))
    spike_frac = ((grad.double() ** 2 > 5000 * v_hat_before) & judged).sum().item() / judged.sum().item()
    return update_rms, eps_frac, spike_frac


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda kw: ",".join(kw) or "default")
def test_the_three_statistics_are_the_optimizers_own(kind, implementation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = kind(model.parameters(), lr=1e-2, **implementation)
    state, _ = reader()
    params = list(model.named_parameters())
    for k in range(5):
        opt.zero_grad()
        model(torch.randn(16, 6)).pow(2).mean().backward()
        if k == 4:
            with torch.no_grad():
                model[0].weight.grad[0, :3] *= 1e3  # three coordinates spike
        v_before = {name: opt.state[p]["exp_avg_sq"].clone() for name, p in params if p in opt.state}
        grads = {name: p.grad.clone() for name, p in params}
        before = state.before_step(opt, params)
        opt.step()
        after = state.after_step(opt, params)
    (names, rows), = after
    (spike_names, spike_rows), = before
    assert names == spike_names == [name for name, _ in params]
    stats = update_stats(rows.numpy())
    spikes = spike_fractions(spike_rows.numpy())
    expected = np.array([by_hand(opt, p, v_before[name], grads[name]) for name, p in params])
    np.testing.assert_allclose(stats["adam_update_rms"], expected[:, 0], rtol=1e-5)
    np.testing.assert_allclose(stats["adam_eps_frac"], expected[:, 1])
    np.testing.assert_allclose(spikes, expected[:, 2])
    assert spikes[0] >= 3 / model[0].weight.numel()  # read before the step: after it g²/v ≤ 1/(1-β2) = 1000


def test_an_unfamiliar_optimizer_is_said_once_and_nothing_is_read():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state, said = reader()
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        assert state.before_step(opt, list(model.named_parameters())) == []
        opt.step()
        assert state.after_step(opt, list(model.named_parameters())) == []
    (message,) = said.values()
    assert "SGD" in message and "Adam and AdamW" in message


def test_the_wrappers_the_doors_hand_over_are_seen_through():
    opt = torch.optim.AdamW(MLP().parameters())

    class Wrapper:  # as Lightning's LightningOptimizer holds it
        def __init__(self, inner):
            self._optimizer = inner

    class Accelerated:  # as accelerate's AcceleratedOptimizer holds it
        def __init__(self, inner):
            self.optimizer = inner

    assert adam_optimizer(Wrapper(opt)) is opt and adam_optimizer(Accelerated(Wrapper(opt))) is opt
    assert adam_optimizer(torch.optim.SGD(MLP().parameters(), lr=0.1)) is None and adam_optimizer(None) is None


def run(log_dir, model, opt, steps, every, *, loss_of=None, before_step=None, **options):
    """``steps`` steps of ``opt`` watched by an Inspector (``optimizer=opt``); the inspector and the losses."""
    generator = torch.Generator().manual_seed(1)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspector = Inspector(model, log_dir=log_dir, every_n_steps=every, optimizer=opt, **options).start() if log_dir else None
        for k in range(steps):
            x = torch.randn(32, 8, generator=generator)
            loss = (loss_of or (lambda m, x: (m(x) - x[:, :4].sin()).pow(2).mean()))(model, x)
            opt.zero_grad()
            loss.backward()
            if before_step is not None:
                before_step(model, k)
            opt.step()
            losses.append(loss.item())
            if inspector is not None:
                inspector.step()
        if inspector is not None:
            inspector.finish()
    return inspector, losses


def test_the_inspector_writes_them_at_sampled_steps_and_changes_no_bit_of_the_run(tmp_path, events):
    results = []
    for log_dir in (tmp_path, None):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _, losses = run(log_dir, model, opt, 9, 4)
        results.append((losses, [t.clone() for t in model.state_dict().values()],
                        [v.clone() for s in opt.state.values() for v in s.values()]))
    (losses, weights, state), (plain_losses, plain_weights, plain_state) = results
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights + state, plain_weights + plain_state))
    acc = events(tmp_path)
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("adam_")]  # the tab's, not cards: 3 a tensor
    tab = tab_values(acc)
    for key in ("adam_update_rms", "adam_eps_frac", "adam_spike_frac"):
        tags = sorted(t for t in tab if t.startswith(key + "/"))
        assert tags == sorted(f"{key}/{name}" for name, _ in MLP().named_parameters())
        assert sorted(tab[tags[0]]) == ([4, 8] if key == "adam_spike_frac" else [0, 4, 8])  # no v before Adam's first step
    update_rms = tab["adam_update_rms/fc1.weight"]
    assert 0 < update_rms[8] < 0.99 < update_rms[0] <= 1  # every update is sign-like at Adam's first step


def test_a_run_without_the_optimizer_known_says_how_to_give_it(tmp_path, events, capsys):
    model = MLP()
    with Inspector(model, log_dir=tmp_path, every_n_steps=2) as inspector:
        train(model, 3, inspector, optimizer=torch.optim.Adam(model.parameters()))
    assert capsys.readouterr().err.count("pass optimizer= to the Inspector") == 1
    assert not [t for t in tab_values(events(tmp_path)) if t.startswith("adam_")]


def test_the_family_can_be_turned_off(tmp_path, events):
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt,
                   families=("weights", "grads", "updates")) as inspector:
        train(model, 2, inspector, optimizer=opt)
    assert not [t for t in tab_values(events(tmp_path)) if t.startswith("adam_")]


# ---------------------------------------------------------------------- the alerts, each provoked


def kinds(inspector) -> dict[str, list]:
    found: dict[str, list] = {}
    for alert in inspector.alerts:
        found.setdefault(alert.kind, []).append(alert)
    return found


def test_gradients_that_turn_constant_in_sign_raise_sign_like_once_for_their_layer(tmp_path):
    """Noise first (targets drawn afresh each step: a normalized update RMS that settles near
    0.25), then from step 80 each of fc2's gradients a constant of the same size and sign: Adam
    moves every coordinate by the learning rate, the RMS climbs to ~0.85."""

    def constant_after(step):
        def before_step(model, k):
            if k >= step:
                with torch.no_grad():
                    for p in model.fc2.parameters():
                        p.grad.copy_(torch.full_like(p.grad, p.grad.abs().mean().item()))
        return before_step

    noise = lambda m, x: (m(x) - torch.randn(x.shape[0], 4)).pow(2).mean()  # noqa: E731
    found = {}
    for case, before_step in (("turned", constant_after(80)), ("healthy", None)):
        torch.manual_seed(0)
        model = MLP()
        inspector, _ = run(tmp_path / case, model, torch.optim.Adam(model.parameters(), lr=1e-3), 140, 4, loss_of=noise,
                           before_step=before_step)
        found[case] = kinds(inspector)
    (alert,) = found["turned"]["sign_like"]
    assert alert.name == "fc2" and 80 < alert.step <= 120
    assert "turned sign-like" in alert.message and "AlertRules.sign_like_rms" in alert.message
    assert "sign_like" not in found["healthy"]


def test_gradients_of_1e_10_raise_eps_bound_for_every_layer(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    tiny = lambda m, x: 1e-10 * (m(x) - x[:, :4].sin()).pow(2).mean()  # noqa: E731
    inspector, _ = run(tmp_path, model, torch.optim.Adam(model.parameters(), lr=1e-3), 12, 2, loss_of=tiny)
    alerts = kinds(inspector)["eps_bound"]
    assert sorted(a.name for a in alerts) == ["fc1", "fc2"]
    assert all(a.step == 8 for a in alerts)  # the window's fifth sample in a row
    assert "100% of layer fc1's coordinates" in alerts[0].message


def test_the_rules_take_their_thresholds_from_alert_rules(tmp_path):
    with pytest.raises(ValueError, match=r"AlertRules.sign_like_rms must be a number in \(0, 1\], got 1.5"):
        AlertRules(sign_like_rms=1.5)
    with pytest.raises(ValueError, match=r"AlertRules.eps_bound_frac must be a number in \(0, 1\], got 0"):
        AlertRules(eps_bound_frac=0)
    with pytest.raises(ValueError, match="AlertRules.sign_like_factor must be a number > 1, got 1"):
        AlertRules(sign_like_factor=1)
    torch.manual_seed(0)
    model = MLP()
    tiny = lambda m, x: 1e-10 * (m(x) - x[:, :4].sin()).pow(2).mean()  # noqa: E731
    inspector, _ = run(tmp_path, model, torch.optim.Adam(model.parameters(), lr=1e-3), 12, 2, loss_of=tiny,
                       alerts=AlertRules(window=2))
    assert {a.step for a in kinds(inspector)["eps_bound"]} == {2}


# ---------------------------------------------------------------------- every door


def test_the_hugging_face_trainer_writes_them_through_accelerates_optimizer(tmp_path, events):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch.utils.data import Dataset

    from layerwatch.huggingface import InspectTrainerCallback

    class Tokens(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = transformers.TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=4, save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, report_to=[])
    callback = InspectTrainerCallback(every_n_steps=2)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
    (run,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    scalars = tab_values(events(run))
    rms = [t for t in scalars if t.startswith("adam_update_rms/")]
    assert "adam_update_rms/transformer.h.0.attn.c_attn.weight" in rms
    assert len(rms) == len(list(model.named_parameters()))  # lm_head is tied to wte: one tensor
    assert [t for t in scalars if t.startswith("adam_spike_frac/")]


def test_lightning_writes_them_through_its_optimizer_wrapper(tmp_path, events):
    pytest.importorskip("lightning")
    from layerwatch import InspectCallback
    from lit_models import LitTransformer, make_trainer

    make_trainer(tmp_path, [InspectCallback(every_n_steps=2)], max_steps=3).fit(LitTransformer())
    tab = tab_values(events(tmp_path / "tb" / "version_0"))
    for key in ("adam_update_rms", "adam_eps_frac", "adam_spike_frac"):
        assert [t for t in tab if t.startswith(key + "/")], key
    assert all(math.isfinite(v) for t, by_step in tab.items() if t.startswith("adam_update_rms/") for v in by_step.values())


# ---------------------------------------------------------------------- sharded


def fsdp2_worker(rank: int, world: int, out: str) -> None:
    """An MLP under FSDP2 per layer (10 rows over 2 ranks: uneven shards), AdamW, every step
    sampled; rank 0 keeps the whole tensors the statistics must be of."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=10, d_out=3)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    whole = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=f"{out}/run", every_n_steps=1, optimizer=opt) as inspector:
            for step in range(3):
                torch.manual_seed(100 + 10 * step + rank)  # each rank its own data
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                v_before = {n: opt.state[p]["exp_avg_sq"].full_tensor().clone() for n, p in model.named_parameters()
                            if p in opt.state}  # every rank: full_tensor is a collective
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                opt.step()
                inspector.step()
                state = {n: {k: v.full_tensor() if k != "step" else v.clone() for k, v in opt.state[p].items()}
                         for n, p in model.named_parameters()}
                whole[step] = (state, v_before, grads)
    if rank == 0:
        torch.save(whole, f"{out}/whole.pt")


def test_fsdp2_per_layer_reads_the_whole_tensors_state(tmp_path, events):
    from ranks import run_ranks

    run_ranks(fsdp2_worker, str(tmp_path), tmp=tmp_path)
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    tab = tab_values(events(tmp_path / "run"))
    names = [name for name, _ in MLP(d_in=8, hidden=10, d_out=3).named_parameters()]
    for step, (state, v_before, grads) in whole.items():
        for name in names:
            m, v, t = state[name]["exp_avg"].double(), state[name]["exp_avg_sq"].double(), float(state[name]["step"])
            rms = ((m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)).pow(2).mean().sqrt().item()
            assert tab[f"adam_update_rms/{name}"][step] == pytest.approx(rms, rel=1e-5), (step, name)
            assert tab[f"adam_eps_frac/{name}"][step] == 0.0
            if name in v_before:
                judged = (grads[name] != 0) & (v_before[name] > 0)
                spikes = (grads[name].double() ** 2 > 5000 * v_before[name].double() / (1 - 0.999 ** (t - 1))) & judged
                assert tab[f"adam_spike_frac/{name}"][step] == pytest.approx(spikes.sum().item() / judged.sum().item())
    assert sorted(tab["adam_spike_frac/fc1.weight"]) == [1, 2]


def test_a_sample_a_spike_asks_for_after_the_step_reads_the_tracked_optimizers_state(tmp_path, events, capsys):
    """A plain loop hands its loss over after the optimizer's step: a spike there samples the
    step at its end, after the optimizer's hooks ran; Adam's state is read all the same."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1000, optimizer=opt) as inspector:
        for k in range(45):
            loss = model(torch.randn(8, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            inspector.step(loss=torch.tensor(1000.0 if k == 40 else 1.0 + 0.01 * math.sin(k)))
    assert "pass optimizer=" not in capsys.readouterr().err
    assert [a.step for a in inspector.alerts if a.kind == "spike"] == [40]
    tab = tab_values(events(tmp_path))
    assert 40 in tab["grads_norm/fc1.weight"] and 40 in tab["adam_update_rms/fc1.weight"]
