"""Loss spikes (layerwatch.health.spikes): the rule, the loss tap, what a spike says and captures, on every front door."""

import math
import random
import re

import pytest
import torch

from layerwatch.health.alert import Alert
from layerwatch.options import SpikeRule
from layerwatch.health.spikes import ValueTap, SpikeDetector


def test_a_jump_past_six_deviations_of_the_trailing_window_is_a_spike_and_noise_is_not():
    rng = random.Random(0)
    detector = SpikeDetector(SpikeRule())
    losses = [2.0 + 0.01 * rng.gauss(0, 1) for _ in range(500)]
    assert [s for step, v in enumerate(losses) if (s := detector.observe(step, v))] == []
    spike = detector.observe(500, 2.5)
    assert spike is not None and (spike.step, spike.what, spike.value, spike.scale) == (500, "loss", 2.5, "log")
    # judged on the logarithm: the geometric mean, and the deviation of the logarithm (0.01 / 2)
    assert spike.z > 6 and spike.mean == pytest.approx(2.0, abs=0.01) and spike.std == pytest.approx(0.005, rel=0.3)
    assert spike.describe().startswith("loss spike at step 500: 2.5, x1.25 the geometric mean of the 128 steps before it")


def test_a_loss_near_zero_that_varies_by_factors_is_no_spike_but_a_jump_by_a_thousand_is():
    """As the demo's classifier once it fits its data: batch losses of 1e-5 spread over factors of
    ten (on the losses themselves, 6 deviations came every 500 steps there: 15 in 8,000)."""
    rng = random.Random(3)
    detector = SpikeDetector(SpikeRule())
    losses = [1e-5 * math.exp(1.4 * rng.gauss(0, 1)) for _ in range(8000)]
    assert [s for step, v in enumerate(losses) if (s := detector.observe(step, v))] == []
    assert detector.observe(8000, 1e-5 * 1e4) is not None


def test_a_loss_that_is_not_positive_is_judged_as_it_is_from_then_on():
    detector = SpikeDetector(SpikeRule(warmup=8, window=16))
    for step in range(10):
        detector.observe(step, 1.0 + 0.01 * (step % 3))
    assert detector.log
    assert detector.observe(10, 0.0) is None and detector.log  # a classifier sure of every answer: passed over
    detector.observe(10, -0.5)  # an ELBO, a reward: no logarithm
    assert not detector.log
    for step in range(11, 30):
        detector.observe(step, 1.0 + 0.01 * (step % 3))
    spike = detector.observe(30, 50.0)
    assert spike is not None and spike.scale == "linear" and "standard deviations above the mean" in spike.describe()


def test_nothing_is_judged_before_the_warmup_a_flat_window_or_a_falling_loss():
    detector = SpikeDetector(SpikeRule(warmup=8, window=16))
    assert all(detector.observe(step, 1.0) is None for step in range(8))
    assert detector.observe(8, 100.0) is None  # a flat window: no deviation to measure against
    falling = SpikeDetector(SpikeRule(warmup=4, window=8))
    assert all(falling.observe(step, 10.0 / (step + 1)) is None for step in range(50))  # a drop is no spike


def test_a_nan_is_left_to_the_sentinel_and_the_window_forgets_what_left_it():
    detector = SpikeDetector(SpikeRule(warmup=4, window=4, z=3.0))
    for step, v in enumerate([1.0, 1.1, 0.9, 1.0]):
        assert detector.observe(step, v) is None
    assert detector.observe(4, math.nan) is None and detector.observe(5, math.inf) is None
    assert detector.observe(6, 5.0) is not None  # judged against the four before, NaN and Inf not among them
    for step in range(7, 11):  # the spike left the window after four more values
        detector.observe(step, 1.0 + 0.1 * (step % 2))
    assert detector.observe(11, 1.05) is None


def test_the_running_sums_match_the_window_after_many_windows():
    rng = random.Random(1)
    detector = SpikeDetector(SpikeRule(window=16, warmup=16))
    values = [1e4 + rng.random() for _ in range(10_000)]
    for step, v in enumerate(values):
        detector.observe(step, v)
    window = [math.log(v) for v in values[-16:]]  # on the logarithm: every value is positive
    assert detector._sum == pytest.approx(math.fsum(window), rel=1e-12)
    assert detector._squares == pytest.approx(math.fsum(v * v for v in window), rel=1e-12)


@pytest.mark.parametrize("bad", [dict(z=0), dict(z=math.inf), dict(z=True), dict(window=1), dict(warmup=1),
                                 dict(capture=-1), dict(window=8, warmup=9), dict(window=8.0)])
def test_a_bad_rule_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match="SpikeRule"):
        SpikeRule(**bad)


def test_the_tap_averages_a_steps_losses_and_gives_each_closed_step_once(monkeypatch):
    tap = ValueTap()
    tap.offer(0, torch.tensor(2.0))
    tap.offer(0, 4.0)  # a second micro-batch
    tap.offer(1, torch.tensor([1.0, 3.0]))  # several values: their mean
    assert tap.landed(closed=0) == [(0, 3.0, 1)]  # the mean, and the micro-batch with the largest loss
    assert tap.landed(closed=1) == [(1, 2.0, 0)] and tap.landed(closed=1) == []
    with pytest.raises(TypeError, match="loss must be a tensor or a number, got str"):
        tap.offer(2, "2.0")


def test_the_tap_starts_a_copy_where_reads_are_not_free_and_reads_it_once_landed(monkeypatch):
    """Taking the accelerator's way on the CPU: no value is read at offer time."""
    from layerwatch import stats

    monkeypatch.setattr(stats, "host_reads_free", lambda device: False)
    tap = ValueTap()
    loss = torch.tensor(5.0)
    tap.offer(3, loss)
    loss.fill_(0.0)  # the copy was taken at offer time
    assert tap.landed(closed=3) == [(3, 5.0, 0)]


def test_a_spike_is_said_and_asks_for_the_next_steps_and_a_second_one_soon_after_is_said_only():
    import warnings

    from layerwatch.guards.failures import FailurePolicy
    from layerwatch.health.spikes import Spikes

    asked, now = [], []
    spikes = Spikes(SpikeRule(warmup=8, window=16, capture=3), FailurePolicy(), lambda: asked.append(step))
    rng = random.Random(2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(40):
            loss = {20: 10.0, 30: 1000.0}.get(step, 1.0 + 0.01 * rng.gauss(0, 1))  # the second stands out of a window holding the first
            spikes.offer(step, torch.tensor(loss))
            now.append(spikes.judge(step, closing=True))
    said = [str(w.message) for w in seen]
    assert [s.step for s in spikes.found] == [20, 30]
    assert [step for step, micro in enumerate(now) if micro is not None] == [20]  # found in its own step: sampled now
    assert asked == [20, 21, 22]  # asked at the ends of steps 20-22: steps 21-23 are sampled
    assert len(said) == 2 and "loss spike at step 20: 10" in said[0]
    assert said[0].endswith("step 20 and steps 21 to 23 are sampled in full")
    assert "not captured: the last capture began at step 20, less than 16 steps ago" in said[1]


def test_no_rule_judges_nothing_and_a_bad_loss_is_warned_once_and_skipped():
    import warnings

    from layerwatch.guards.failures import FailurePolicy
    from layerwatch.health.spikes import Spikes

    off = Spikes(None, FailurePolicy(), lambda: pytest.fail("asked"))
    off.offer(0, "not a loss")  # not even looked at
    assert off.judge(0, closing=True) is None
    on = Spikes(SpikeRule(), FailurePolicy(), lambda: None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on.offer(0, "not a loss")
        on.offer(1, object())
    assert [str(w.message) for w in seen] == [
        "layerwatch: could not take the loss at step 0: TypeError('a loss must be a tensor or a number, got str'); skipped"]


def test_the_gradient_norm_is_judged_apart_from_the_loss_and_each_spike_writes_both_lead_ups():
    """A gradient norm that jumps while the loss does not is a spike of its own ("gradient
    norm"); the same step's loss spiking too is captured once; each spike's lead-up is both
    quantities' steps up to it, each step written once."""
    import warnings

    from layerwatch.guards.failures import FailurePolicy
    from layerwatch.health.spikes import Spikes

    asked = []
    spikes = Spikes(SpikeRule(warmup=8, window=16, capture=2), FailurePolicy(), lambda: asked.append(step))
    rng = random.Random(3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(60):
            loss, norm = 1.0 + 0.01 * rng.gauss(0, 1), 2.0 + 0.02 * rng.gauss(0, 1)
            spikes.offer(step, torch.tensor(loss if step != 50 else 40.0))
            spikes.offer(step, torch.tensor(norm if step not in (20, 50) else 300.0), "grad_norm")
            spikes.judge(step, closing=True)
            if step == 30:
                first = spikes.explain(step, {})
    said = [str(w.message) for w in seen]
    assert [(s.step, s.what) for s in spikes.found] == [(20, "grad_norm"), (50, "loss"), (50, "grad_norm")]
    assert said[0].startswith("layerwatch: gradient norm spike at step 20: 300, x1")
    assert said[0].endswith("step 20 and steps 21 to 22 are sampled in full")
    assert said[2].endswith("; captured with the loss spike of its step")  # one capture for the step
    assert asked == [20, 21, 50, 51]
    assert [e["what"] for e in first.spikes] == ["grad_norm"] and first.alerts[0].message.startswith("gradient norm spike")
    assert [at for at, _ in first.history["layerwatch/grad_norm_lead_up"]] == list(range(4, 21))  # its window, then itself
    assert [at for at, _ in first.history["layerwatch/loss"]] == list(range(4, 21))  # the loss's window up to the step
    second = spikes.explain(55, {})
    alert, = second.alerts  # one step, one alert, saying both
    assert alert.step == 50 and "loss spike at step 50" in alert.message and "gradient norm spike at step 50" in alert.message
    assert [e["what"] for e in second.spikes] == ["loss", "grad_norm"]
    assert [at for at, _ in second.history["layerwatch/loss"]] == list(range(34, 51))  # the steps not written before
    assert [at for at, _ in second.history["layerwatch/grad_norm_lead_up"]] == list(range(34, 51))


def test_a_steps_gradient_norms_combine_as_one_norm_and_a_late_explanation_keeps_the_other_lead_up():
    """Two optimizers' norms of one step are the norm of both (3 and 4: 5), where a step's
    losses are averaged; a spike explained long after it (a sample far off) still writes the
    other quantity's steps before it, as they were when it was found; a NaN or Inf is in no lead-up."""
    from layerwatch.guards.failures import FailurePolicy
    from layerwatch.health.spikes import Spikes

    norms, losses = ValueTap("gradient norm", norms=True), ValueTap()
    for tap in (norms, losses):
        tap.offer(0, torch.tensor(3.0))
        tap.offer(0, 4.0)
    assert norms.landed(0) == [(0, 5.0, 1)] and losses.landed(0) == [(0, 3.5, 1)]

    spikes = Spikes(SpikeRule(warmup=8, window=16, capture=0), FailurePolicy(), lambda: None)
    rng = random.Random(4)
    for step in range(200):
        spikes.offer(step, 1.0 + 0.01 * rng.gauss(0, 1) if step != 13 else math.inf)
        spikes.offer(step, torch.tensor(300.0 if step == 40 else 2.0 + 0.02 * rng.gauss(0, 1)), "grad_norm")
        spikes.judge(step, closing=True)
    late = spikes.explain(199, {})  # 159 steps on: the loss's recent values have moved past the spike's window
    assert [at for at, _ in late.history["layerwatch/loss"]] == list(range(24, 41))
    assert [at for at, _ in late.history["layerwatch/grad_norm_lead_up"]] == list(range(24, 41))
    spikes.explain(200, {})
    early = Spikes(SpikeRule(warmup=8, window=16), FailurePolicy(), lambda: None)
    for step in range(30):
        early.offer(step, math.nan if step == 20 else 1.0 + 0.01 * rng.gauss(0, 1))
        early.offer(step, torch.tensor(300.0 if step == 25 else 2.0 + 0.02 * rng.gauss(0, 1)), "grad_norm")
        early.judge(step, closing=True)
    loss_lead_up = [at for at, _ in early.explain(30, {}).history["layerwatch/loss"]]
    assert 20 not in loss_lead_up and loss_lead_up == [at for at in range(9, 26) if at != 20]


def test_a_gradient_norm_of_sharded_gradients_is_not_judged_said_once():
    """torch's clip_grad_norm_ over FSDP2's gradients returns a DTensor whose value is partial
    on each rank: reading it would be a collective one rank issues alone. The loss goes on."""
    import warnings

    from torch.distributed.tensor import DTensor, Partial

    from layerwatch.guards.failures import FailurePolicy
    from layerwatch.health.spikes import Spikes

    class Partly(DTensor):  # placements without a mesh: what the tap reads of it
        def __new__(cls):
            return torch.Tensor._make_subclass(cls, torch.zeros(()))

        placements = (Partial(),)

    spikes = Spikes(SpikeRule(), FailurePolicy(), lambda: None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        spikes.offer(0, Partly(), "grad_norm")
        spikes.offer(1, Partly(), "grad_norm")
        spikes.offer(1, torch.tensor(2.0))
    assert [str(w.message) for w in seen] == [
        "layerwatch: a gradient norm that is a DTensor placed (Partial(sum),) is not judged: reading it is a collective; "
        "gradient norm spikes are not looked for in this run"]
    assert spikes.has_losses


def _train(tmp_path, spike_at=None, steps=80, **options):
    """A small regression under an Inspector given each step's loss; at ``spike_at`` the batch is
    scaled up 30 times (a loss spike). Returns the losses (exact), the steps written and what was said."""
    import warnings

    from torch import nn

    from layerwatch import Inspector

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path, optimizer=opt, **options) as inspector:
            losses = _plain_steps(inspector, model, opt, batches, lambda step, x: x * 30 if step == spike_at else x)
    said = [str(w.message) for w in seen if str(w.message).startswith("layerwatch: loss spike")]
    return losses, said


def _plain_steps(inspector, call, opt, batches, before):
    """The plain loop of these tests: each batch's MSE step (its input as ``before(step, x)``
    makes it), the loss and the gradient norm given to ``inspector.step``; the losses (exact)."""
    from torch import nn

    losses = []
    for step, (x, y) in enumerate(batches):
        x = before(step, x)
        opt.zero_grad()
        loss = nn.functional.mse_loss(call(x), y)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in opt.param_groups[0]["params"]])  # changes nothing
        opt.step()
        losses.append(repr(loss.item()))
        inspector.step(loss=loss, grad_norm=norm)
    return losses


def test_a_loss_spike_at_an_unsampled_step_is_found_and_the_next_steps_are_sampled(tmp_path, events):
    losses, said = _train(tmp_path / "spiked", spike_at=60, every_n_steps=1000)
    assert said[0].startswith("layerwatch: loss spike at step 60: ")
    assert said[0].endswith("step 60 and steps 61 to 63 are sampled in full")  # read at once on the CPU: at its end
    assert all("not captured: the last capture began at step 60" in line for line in said[1:])  # what the jump left
    written = [s.step for s in events(tmp_path / "spiked").Scalars("layerwatch/overhead_ms")]
    assert written == [0, 60, 61, 62, 63]
    plain, _ = _train(tmp_path / "off", spike_at=60, every_n_steps=1000, spikes=False)
    assert losses == plain  # bitwise: judging the loss and the capture change nothing


def test_no_spike_is_said_on_a_healthy_run_at_the_defaults(tmp_path):
    _, said = _train(tmp_path, steps=200)
    assert said == []


def test_lightning_finds_a_spike_in_training_steps_loss_and_samples_the_next_steps(tmp_path, events):
    """At the defaults but a fixed schedule, so that the captured steps are the only others sampled."""
    import warnings

    from layerwatch import InspectCallback
    from models import LitSpike, make_trainer

    runs = {}
    for name, spikes in (("spiked", True), ("off", False)):
        torch.manual_seed(0)
        module = LitSpike(spike_at=60)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            make_trainer(tmp_path / name, [InspectCallback(every_n_steps=1000, spikes=spikes)], max_steps=80).fit(module)
        runs[name] = (module.losses, [str(w.message) for w in seen if str(w.message).startswith("layerwatch: loss spike")])
    losses, said = runs["spiked"]
    assert said and said[0].startswith("layerwatch: loss spike at step 60: "), said
    assert said[0].endswith("step 60 and steps 61 to 63 are sampled in full"), said  # read before its optimizer step
    written = [s.step for s in events(tmp_path / "spiked" / "tb" / "version_0").Scalars("layerwatch/overhead_ms")]
    assert written == [0, 60, 61, 62, 63]
    assert losses == runs["off"][0] and runs["off"][1] == []


def test_the_trainer_finds_a_spike_in_the_models_loss_and_samples_the_next_steps(tmp_path, events):
    """The Hugging Face door takes the loss the model's outputs hold; a hook scales the logits 30
    times at the 60th training forward (step 60: the Trainer's steps count from 1)."""
    import warnings

    transformers = pytest.importorskip("transformers")
    from layerwatch.huggingface import InspectTrainerCallback
    from hf_models import Tokens, event_dirs, tiny

    runs = {}
    for name, spikes in (("spiked", True), ("off", False)):
        model = tiny("gpt2")
        forwards = [0]

        def scale(module, args, output):
            if module.training and torch.is_grad_enabled():
                forwards[0] += 1
                return output * 30 if forwards[0] == 60 else None

        model.lm_head.register_forward_hook(scale)
        settings = dict(max_steps=80, per_device_train_batch_size=4, logging_steps=1, save_strategy="no", use_cpu=True,
                        seed=0, disable_tqdm=True, report_to=["tensorboard"], learning_rate=1e-4)
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(str(tmp_path / name), **settings),
                                       train_dataset=Tokens(), callbacks=[InspectTrainerCallback(every_n_steps=1000, spikes=spikes)])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs[name] = (losses, [str(w.message) for w in seen if str(w.message).startswith("layerwatch: loss spike")], trainer)
    losses, said, _ = runs["spiked"]
    assert said and said[0].startswith("layerwatch: loss spike at step 60: "), said
    assert said[0].endswith("step 60 and steps 61 to 63 are sampled in full"), said  # read before its optimizer step
    accumulators = [events(d) for d in event_dirs(tmp_path / "spiked")]
    written = {s.step for acc in accumulators if "layerwatch/overhead_ms" in acc.Tags()["scalars"]
               for s in acc.Scalars("layerwatch/overhead_ms")}
    assert {60, 61, 62, 63} <= written and not written & set(range(2, 60)), sorted(written)
    assert losses == runs["off"][0] and runs["off"][1] == []


# ------------------------------------------------------------------ a layer's output scaled: the layer named

SPIKE_STEP = 60  # unsampled under every_n_steps=25 (0, 25, 50, 75 are)


def amplifiable(layer: torch.nn.Module) -> torch.nn.Module:
    """``layer``'s output times its buffer ``amplify`` (1 until a test sets it): a forward hook,
    and a buffer rather than a Python flag, so that compiled code runs one graph either way."""
    layer.register_buffer("amplify", torch.ones(()))
    layer.register_forward_hook(lambda module, args, output: output * module.amplify)
    return layer


def _spike_alerts(alerts):
    return [a for a in alerts if a.kind == "spike"]


def _mlp() -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), amplifiable(nn.Linear(32, 32)), nn.ReLU(), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, 1))


def _plain_amplified(log_dir, compiled=False, amplify=1e3, spikes=True, **options):
    """A plain loop over ``_mlp()`` whose layer 2's output is scaled ``amplify`` times at
    SPIKE_STEP; returns the losses (exact) and the alerts."""
    import warnings

    from layerwatch import Inspector

    model = _mlp()
    call = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(80)]

    def amplified(step, x):
        model[2].amplify.fill_(amplify if step == SPIKE_STEP else 1.0)
        return x

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(call, log_dir=log_dir, optimizer=opt, spikes=spikes, **{"every_n_steps": 25, **options}) as inspector:
            losses = _plain_steps(inspector, call, opt, batches, amplified)
            alerts = inspector.alerts
    return losses, alerts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_plain_loop_names_the_layer_whose_output_was_scaled_at_an_unsampled_step(tmp_path, events, compiled):
    """The loss comes to step(), after the optimizer step: the spiking step is sampled at its
    end (on the CPU), its gradients as they were; no replay (its weights changed since). The
    layer ranked first is the scaled one's neighbour in the graph, the Linear after it (4): every
    gradient grew some 1e5 times, the layers after the scaled one's a little more (their inputs
    grew too); only the forward tells the scaled layer itself (the Lightning and Trainer tests)."""
    losses, alerts = _plain_amplified(tmp_path / "spiked", compiled)
    spike, = [a for a in _spike_alerts(alerts) if a.step == SPIKE_STEP]
    assert spike.name == "4" and "grew most: 4 (gradient x" in spike.message and "2 (gradient x" in spike.message, spike.message
    written = [s.step for s in events(tmp_path / "spiked").Scalars("layerwatch/overhead_ms")]
    assert SPIKE_STEP in written and {61, 62, 63} <= set(written)
    plain, _ = _plain_amplified(tmp_path / "off", compiled, spikes=False)
    assert losses == plain  # bitwise


def test_a_plain_loop_names_the_layer_whose_gradient_alone_was_scaled_by_the_gradient_norm(tmp_path, events):
    """Layer 4's weight gradient scaled 1e3 times at an unsampled step, its forward untouched:
    the loss does not spike (its step is over before the update), the gradient norm does,
    and the layer whose gradient grew most is the one scaled. Lead-ups of both are written."""
    import warnings

    from layerwatch import Inspector

    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scale = [1.0]
    model[4].weight.register_hook(lambda grad: grad * scale[0])
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(70)]

    def scaled(step, x):
        scale[0] = 1e3 if step == SPIKE_STEP else 1.0
        return x

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Inspector(model, log_dir=tmp_path, optimizer=opt, every_n_steps=25) as inspector:
            _plain_steps(inspector, model, opt, batches, scaled)
            alerts = inspector.alerts
    said = [str(w.message) for w in seen if " spike at step" in str(w.message)]
    assert said[0].startswith(f"layerwatch: gradient norm spike at step {SPIKE_STEP}: "), said
    assert said[0].endswith(f"step {SPIKE_STEP} and steps 61 to 63 are sampled in full") and "loss spike" not in str(said)
    spike, = _spike_alerts(alerts)
    assert spike.name == "4" and re.search(r"grew most: 4 \(gradient x[\d,]+\)", spike.message), spike.message
    run = events(tmp_path)
    assert [s.step for s in run.Scalars("layerwatch/grad_norm_lead_up")] == list(range(SPIKE_STEP + 1))  # every step before it
    assert [s.step for s in run.Scalars("layerwatch/loss")] == list(range(SPIKE_STEP + 1))


def test_under_the_overhead_budget_the_capture_is_taken_and_paid_for(tmp_path, events):
    """At the real defaults (the budget's pacer): the spiking step and the three after it are
    sampled whatever the interval, and their cost is counted against the budget."""
    from layerwatch.engine.budget import Pacer

    Pacer_unscheduled, paid = Pacer.unscheduled, []

    def unscheduled(self, step, cost_s):
        paid.append(step)
        Pacer_unscheduled(self, step, cost_s)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Pacer, "unscheduled", unscheduled)
        _plain_amplified(tmp_path, every_n_steps=None)
    written = [s.step for s in events(tmp_path).Scalars("layerwatch/overhead_ms")]
    interval = [s.value for s in events(tmp_path).Scalars("layerwatch/sample_interval")][-1]
    assert {60, 61, 62, 63} <= set(written) and interval > 1
    assert {step for step in (60, 61, 62, 63) if step % interval} <= set(paid)


def test_a_healthy_plain_loop_says_no_spike_at_the_defaults(tmp_path):
    _, alerts = _plain_amplified(tmp_path, amplify=1.0)
    assert _spike_alerts(alerts) == []


def _lightning_amplified(root, compiled=False, amplify=1e3, spikes=True, gradient=False, **trainer):
    import warnings

    from layerwatch import InspectCallback
    from models import LitAmplified, make_trainer

    module = LitAmplified(spike_at=SPIKE_STEP, amplify=amplify, compiled=compiled, gradient=gradient)
    callback = InspectCallback(every_n_steps=25, spikes=spikes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(root, [callback], max_steps=80, **trainer).fit(module)
    return module.losses, callback.alerts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lightning_replays_the_spiking_step_and_names_the_layer_whose_output_was_scaled(tmp_path, events, compiled):
    """Lightning hands the loss over before the backward: on the CPU the spike is found before
    the optimizer step, and the step's batch is run again with every probe armed (compiled code
    eagerly). The scaled layer itself comes first: its output grew 1000 times more than its
    input's."""
    losses, alerts = _lightning_amplified(tmp_path / "spiked", compiled)
    spike, = [a for a in _spike_alerts(alerts) if a.step == SPIKE_STEP]
    began = re.search(r"began at (\S+) \(its output grew x([\d,]+) more than its input\)", spike.message)
    assert spike.name == "net.2" and began and began[1] == "net.2", spike.message
    assert 800 < int(began[2].replace(",", "")) < 1250  # 1000, as the weights moved a little since the last sample
    run = events(tmp_path / "spiked" / "tb" / "version_0")
    assert SPIKE_STEP in [s.step for s in run.Scalars("activations_norm/net.2")]  # the replay's probes, at the step
    plain, _ = _lightning_amplified(tmp_path / "off", compiled, spikes=False)
    assert losses == plain  # bitwise: the replay restored what it changed


def test_lightning_judges_the_norm_it_clips_at_and_names_the_layer_whose_gradient_grew(tmp_path, events):
    """With ``gradient_clip_val``, Lightning computes the gradient norm each step to clip it:
    the door takes it (before clipping; after the callbacks' on_before_optimizer_step, so the
    spike is found at the step's end). net.4's weight gradient scaled 1000 times: a gradient
    norm spike the loss does not show, the layer named; the losses bitwise those without."""
    losses, alerts = _lightning_amplified(tmp_path / "spiked", gradient=True, gradient_clip_val=1e9)
    spike, = _spike_alerts(alerts)
    assert spike.step == SPIKE_STEP and spike.message.startswith(f"gradient norm spike at step {SPIKE_STEP}: ")
    assert spike.name == "net.4" and "began at" not in spike.message, spike.message
    run = events(tmp_path / "spiked" / "tb" / "version_0")
    assert [s.step for s in run.Scalars("layerwatch/grad_norm_lead_up")] == list(range(SPIKE_STEP + 1))
    assert {SPIKE_STEP, 61, 62, 63} <= {s.step for s in run.Scalars("layerwatch/overhead_ms")}
    plain, _ = _lightning_amplified(tmp_path / "off", gradient=True, spikes=False, gradient_clip_val=1e9)
    assert losses == plain


def test_a_healthy_lightning_run_says_no_spike_at_the_defaults(tmp_path):
    _, alerts = _lightning_amplified(tmp_path, amplify=1.0)
    assert _spike_alerts(alerts) == []
    assert [a for a in alerts if a.kind == "loss_rise"] == []  # the door feeds the loss's progress: it learns, nothing rises


def _trainer_amplified(root, amplify=-1e3, spikes=True, compiled=False, gradient=False):
    """The tiny GPT-2 under the Hugging Face Trainer, learning to count, its final norm
    ``transformer.ln_f``'s output scaled ``amplify`` times at step SPIKE_STEP (the Trainer's
    steps count from 1: its ``global_step`` is one less during the step, its replay included).

    Not a block's layer: GPT-2 normalizes each block's input and its last output, so a block's
    output scaled 1000 times moved the loss 2 times, 3 standard deviations of the window (measured
    with ``transformer.h.1.mlp.c_proj``): no spike to find. The final norm's output goes to the
    head as it is; scaled -1000 times (+1000 makes a model that counts right surer of it: the
    loss fell 10 times), it makes the head sure of the wrong tokens. ``gradient``: the forward
    is left alone, and the first block's ``mlp.c_fc.weight`` gradient is scaled instead."""
    import warnings

    transformers = pytest.importorskip("transformers")
    from layerwatch.huggingface import InspectTrainerCallback
    from hf_models import SEQ, VOCAB, tiny

    class Counting(torch.utils.data.Dataset):  # learnable: each token is the one before it plus one
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = (i + torch.arange(SEQ)) % VOCAB
            return {"input_ids": ids, "labels": ids}

    model = tiny("gpt2")
    layer = amplifiable(torch.nn.Identity() if gradient else model.transformer.ln_f)
    state = []
    if gradient:
        model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda grad: grad * layer.amplify)

    def set_amplify(module, args):
        layer.amplify.fill_(amplify if state and state[0].state.global_step + 1 == SPIKE_STEP else 1.0)

    model.register_forward_pre_hook(set_amplify)
    settings = dict(max_steps=80, per_device_train_batch_size=4, save_strategy="no", use_cpu=True, seed=0,
                    disable_tqdm=True, report_to=["tensorboard"], learning_rate=1e-3, logging_steps=1,
                    **(dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}))
    callback = InspectTrainerCallback(every_n_steps=25, spikes=spikes)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(str(root), **settings),
                                   train_dataset=Counting(), callbacks=[callback])
    state.append(trainer)  # its state is made anew by train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], callback.alerts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_trainer_replays_the_spiking_step_and_names_the_layer_whose_output_was_scaled(tmp_path, compiled):
    """The Trainer's door reads the loss from the model's outputs in a forward hook, before the
    backward: as in Lightning, the step is replayed and the scaled layer comes first."""
    losses, alerts = _trainer_amplified(tmp_path / "spiked", compiled=compiled)
    spike, = [a for a in _spike_alerts(alerts) if a.step == SPIKE_STEP]
    began = re.search(r"began at (\S+) \(its output grew x([\d,]+) more than its input\)", spike.message)
    assert spike.name == "transformer.ln_f" and began and began[1] == spike.name, spike.message
    if not compiled:  # the replay puts back the same state compiled or not; a compiled run twice costs 10 s more
        plain, _ = _trainer_amplified(tmp_path / "off", spikes=False)
        assert losses == plain  # bitwise


def test_the_trainer_judges_its_own_gradient_norm_and_names_the_layer_whose_gradient_grew(tmp_path, events):
    """The Trainer computes the gradient norm each step (to clip it): the door takes that value,
    before clipping. A weight's gradient scaled 1000 times spikes it, not the loss; the step is
    found before its optimizer step and sampled there, and the layer is named by its gradient."""
    _, alerts = _trainer_amplified(tmp_path, amplify=1e3, gradient=True)
    spike, = [a for a in _spike_alerts(alerts) if a.step == SPIKE_STEP]
    assert spike.message.startswith(f"gradient norm spike at step {SPIKE_STEP}: "), spike.message
    assert spike.name == "transformer.h.0.mlp.c_fc" and "began at" not in spike.message, spike.message
    from hf_models import event_dirs

    lead_up = {s.step for d in event_dirs(tmp_path) for acc in [events(d)]
               if "layerwatch/grad_norm_lead_up" in acc.Tags()["scalars"] for s in acc.Scalars("layerwatch/grad_norm_lead_up")}
    assert lead_up == set(range(1, SPIKE_STEP + 1))  # every step before it: the Trainer's steps count from 1


def test_a_gradient_norm_is_taken_from_its_method_for_the_runs_life_only():
    """The method that computes the norm (an accelerator's clip_grad_norm_; Lightning's
    clip_grad_by_norm, which keeps it: ``compute``) is wrapped while the engine runs and put
    back after: its own method again, or a wrapper that was there before; what it returns is
    what it returned."""
    from layerwatch.guards.hooks import GradNormTaken

    class Accelerator:
        def clip_grad_norm_(self, parameters, max_norm):
            return torch.tensor(3.0)

    class Engine:
        state, seen = "running", []

        def observe(self, value, what="loss"):
            self.seen.append((float(value), what))

    engine, accelerator = Engine(), Accelerator()
    taken = GradNormTaken(engine, accelerator, "clip_grad_norm_")
    assert float(accelerator.clip_grad_norm_([], 1.0)) == 3.0 and engine.seen == [(3.0, "grad_norm")]
    taken.remove()
    taken.remove()  # safe twice
    assert "clip_grad_norm_" not in vars(accelerator) and float(accelerator.clip_grad_norm_([], 1.0)) == 3.0
    assert engine.seen == [(3.0, "grad_norm")]
    before = accelerator.clip_grad_norm_ = lambda parameters, max_norm: None  # someone's wrapper: put back as it was
    GradNormTaken(engine, accelerator, "clip_grad_norm_").remove()
    assert vars(accelerator)["clip_grad_norm_"] is before
    kept = GradNormTaken(engine, accelerator, "clip_grad_norm_", compute=lambda parameters, max_norm: 5.0)
    assert accelerator.clip_grad_norm_([], 1.0) is None and engine.seen[-1] == (5.0, "grad_norm")
    kept.remove()
    engine.state = "finished"
    GradNormTaken(engine, accelerator, "clip_grad_norm_", compute=lambda parameters, max_norm: 7.0)
    accelerator.clip_grad_norm_([], 1.0)
    assert engine.seen[-1] == (5.0, "grad_norm")  # a finished engine is handed nothing


def test_a_healthy_trainer_run_says_no_spike_at_the_defaults(tmp_path):
    _, alerts = _trainer_amplified(tmp_path, amplify=1.0)
    assert _spike_alerts(alerts) == []
    assert [a for a in alerts if a.kind == "loss_rise"] == []  # the door feeds the loss's progress: it learns, nothing rises


# ------------------------------------------------------------------ sharded: the same spikes and captures on every rank

def sharded_spike_worker(rank: int, world: int, out: str, how: str, spiking_rank: int) -> None:
    """60 Adam steps of an MLP (FSDP2 per layer, or DDP), each rank its own data; at step 40 the
    batch of ``spiking_rank`` alone is scaled up 30 times. Each rank records what it judged a
    spike, the steps it sampled, and its losses."""
    import json
    import warnings

    from torch import nn

    from layerwatch import Inspector

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampled, losses = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=f"{out}/run", optimizer=opt, every_n_steps=25) as inspector:
            for step in range(60):
                sampled += [step] if inspector.sampled else []
                g = torch.Generator().manual_seed(100 + 10 * step + rank)
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
                x = x * 30 if step == 40 and rank == spiking_rank else x
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # scales the gradients by 1: none
                opt.step()
                losses.append(loss.item())
                inspector.step(loss=loss, grad_norm=norm.full_tensor() if how == "fsdp2" else norm)
            found = [(s.step, s.what, s.value) for s in inspector._engine._spikes.found]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"found": found, "sampled": sampled, "losses": losses}, f)


def _sharded(tmp_path, how, spiking_rank):
    import json

    from ranks import run_ranks

    run_ranks(sharded_spike_worker, str(tmp_path), how, spiking_rank, tmp=tmp_path,
              debug="INFO" if how == "ddp" else "DETAIL")  # DETAIL crashes DDP's constructor (see run_ranks)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_fsdp2_the_ranks_judge_their_largest_loss_alike_and_capture_the_same_steps(tmp_path, events):
    """Rank 1's batch alone spikes: the ranks vote on each step with their losses, so both judge
    the largest, see the same spike, and sample the same steps (a step or two later than a
    single process: the losses ride on the next votes); rank 0 writes it. Each judges the
    global gradient norm (``full_tensor()`` of clip_grad_norm_'s, as torchtitan does)."""
    zero, one = _sharded(tmp_path, "fsdp2", spiking_rank=1)
    assert zero["found"] == one["found"], (zero["found"], one["found"])
    assert [(step, what) for step, what, _ in zero["found"]][:2] == [(40, "grad_norm"), (40, "loss")], zero["found"]
    assert max(one["losses"][40], zero["losses"][40]) == zero["found"][1][2]  # the largest of the ranks' losses
    assert zero["sampled"] == one["sampled"] and {0, 25, 50} < set(zero["sampled"])
    captured = sorted(set(zero["sampled"]) - {0, 25, 50})
    # the gradient norm (global: every rank judges its own) spiked at step 40, judged at its end: the capture's asks
    # go out in the next ballots; the loss went out in step 42's vote, judged there, with the same step captured already
    assert captured == [42, 43, 44]
    run = events(tmp_path / "run")
    assert [s.step for s in run.Scalars("layerwatch/overhead_ms")] == [0, 25, *captured, 50]
    assert [s.step for s in run.Scalars("layerwatch/loss")] == list(range(41))  # the lead-up: the 40 steps before, the spike
    assert [s.step for s in run.Scalars("layerwatch/grad_norm_lead_up")] == list(range(41))


@pytest.mark.parametrize("spiking_rank", [0, 1])
def test_ddp_rank_zero_judges_its_own_losses_and_no_rank_waits(tmp_path, events, spiking_rank):
    """Under DDP rank 0 alone samples and writes (sampling is no collective there): it alone
    judges, its own losses; a spike in another rank's batch is seen where it reaches rank 0's:
    at once in the gradient norm (of the averaged gradients)."""
    zero, one = _sharded(tmp_path, "ddp", spiking_rank)
    assert one["found"] == []  # not judged off rank 0
    found = [(step, what) for step, what, _ in zero["found"]]
    assert found[:2] == ([(40, "loss"), (40, "grad_norm")] if spiking_rank == 0 else [(40, "grad_norm")])  # averaged
    written = [s.step for s in events(tmp_path / "run").Scalars("layerwatch/overhead_ms")]
    assert {40, 41, 42, 43} <= set(written)  # the step itself, at its end, and the three after


# ------------------------------------------------------------------ what the review found

def test_a_loss_offered_after_its_step_was_given_out_is_not_taken():
    """Manual optimization with two optimizers: the first one's step judged the step's loss; the
    second optimizer's loss, offered after, would make the step's window hold two losses."""
    tap = ValueTap()
    tap.offer(4, 1.0)
    assert tap.landed(closed=4) == [(4, 1.0, 0)]
    tap.offer(4, 9.0)  # the discriminator's, after the generator's step
    assert tap.landed(closed=4) == []
    tap.offer(5, 2.0)
    assert tap.landed(closed=5) == [(5, 2.0, 0)]


def test_a_loss_on_a_device_the_host_cannot_read_freely_turns_the_check_off_said_once():
    import warnings

    from layerwatch.guards.failures import FailurePolicy
    from layerwatch.health.spikes import Spikes

    spikes = Spikes(SpikeRule(), FailurePolicy(), lambda: None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        spikes.offer(0, torch.zeros((), device="meta"))
        spikes.offer(1, torch.zeros((), device="meta"))
    assert [str(w.message) for w in seen] == [
        "layerwatch: a loss on meta is not judged: its host copy would wait for the device; loss spikes are not looked "
        "for in this run"]


def test_spikes_explained_at_one_sample_are_alerts_of_their_own_steps():
    """On a GPU two spikes can land before the next sample: each is an alert at its own step,
    though the ranking (one a sample) names the same layer."""
    from layerwatch.health.check import HealthCheck
    from layerwatch.health.findings import Findings
    from layerwatch.options import AlertRules
    from layerwatch.guards.failures import FailurePolicy

    health = HealthCheck(AlertRules(), FailurePolicy())
    found = [Alert("spike", "fc1", 60, "loss spike at step 60"), Alert("spike", "fc1", 62, "loss spike at step 62")]
    findings = health.judge(64, {}, False, [], None, spiked=Findings(alerts=found))
    assert [(a.kind, a.name, a.step) for a in findings.alerts] == [("spike", "fc1", 60), ("spike", "fc1", 62)]


def test_a_spike_found_as_the_run_ends_is_written_then_unranked():
    import warnings

    from layerwatch.guards.failures import FailurePolicy
    from layerwatch.health.spikes import Spikes

    from layerwatch.sinks import record as R

    class Sink:  # Output.write_findings: the record built as the output builds it, the alerts said
        records, announced = [], []

        def write_findings(self, step, findings, alerts):
            self.records.append(R.build(step, findings=findings))
            self.announced += alerts

    sink = Sink()
    spikes = Spikes(SpikeRule(warmup=8, window=16), FailurePolicy(), lambda: None, sink.write_findings)
    rng = random.Random(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(20):
            spikes.offer(step, 1.0 + 0.01 * rng.gauss(0, 1))
            spikes.judge(step, closing=True)
        spikes.offer(20, 50.0)  # the run ends before step 20 closes
        spikes.close(20)
    assert [str(w.message) for w in seen][-1].endswith("found as the run ended: not captured")
    (rec,) = sink.records
    assert rec.step == 20 and [s["step"] for s in rec.spikes] == [20] and rec.spikes[0]["layers"] == []
    assert [(a.kind, a.step) for a in sink.announced] == [("spike", 20)] and rec.history["layerwatch/loss"][-1] == (20, 50.0)


def vote_worker(rank: int, world: int, out: str) -> None:
    """The loss lanes of the ranks' vote: each case, what each rank's ballot holds, and what the
    decision says, recorded by rank 0."""
    import json

    from layerwatch.distributed.agreement import Ballot, RankSync, StepVote

    cases = {  # rank 0's loss, rank 1's (None: it has none; "pending": its loss is on its way)
        "both": ((5, 1.0), (5, 3.0)),
        "a stage without a loss stands aside": ((5, 1.0), None),
        "a rank waiting for its loss holds the others": ((5, 1.0), "pending"),
        "a rank lacked the earlier steps": ((5, 1.0), (7, 2.0)),
        "no rank has a loss": (None, None),
        "a negative loss": ((5, -2.0), (5, -0.5)),
    }
    sync = RankSync(30)
    vote = StepVote(sync)
    seen = {}
    for step, (name, losses) in enumerate(cases.items()):
        mine = losses[rank]
        ballot = Ballot(False, loss=None if mine in (None, "pending") else mine, loss_pending=mine == "pending")
        decision = vote.decide(step, lambda at: ballot)
        seen[name] = [decision.loss and list(decision.loss), decision.losses_from]
    vote.remove()
    if rank == 0:
        with open(f"{out}/votes.json", "w") as f:
            json.dump(seen, f)


def test_the_vote_carries_the_largest_loss_of_one_step_and_lets_ranks_without_one_stand_aside(tmp_path):
    import json

    from ranks import run_ranks

    run_ranks(vote_worker, str(tmp_path), tmp=tmp_path)
    assert json.loads((tmp_path / "votes.json").read_text()) == {
        "both": [[5, 3.0], None],
        "a stage without a loss stands aside": [[5, 1.0], None],
        "a rank waiting for its loss holds the others": [None, None],
        "a rank lacked the earlier steps": [None, 7],
        "no rank has a loss": [None, None],
        "a negative loss": [[5, -0.5], None],
    }


def test_lightning_under_gradient_accumulation_judges_the_steps_mean_loss(tmp_path, events):
    """Lightning divides each micro-batch's loss by their number before the backward: the door
    multiplies it back, so the loss judged (and its lead-up, written) is the step's mean loss."""
    import warnings

    from layerwatch import InspectCallback
    from models import LitSpike, make_trainer

    torch.manual_seed(0)
    module = LitSpike(spike_at=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path, [InspectCallback(every_n_steps=1000)], max_steps=50, accumulate_grad_batches=2).fit(module)
    written = {s.step: s.value for s in events(tmp_path / "tb" / "version_0").Scalars("layerwatch/loss")}
    assert sorted(written) == list(range(41))  # the 40 steps before the spike, and the spike
    losses = [float(loss) for loss in module.losses]  # each micro-batch's, divided by 2 in the outputs too
    for step in (0, 20, 40):
        assert written[step] == pytest.approx(losses[2 * step] + losses[2 * step + 1], rel=1e-6)  # their mean
