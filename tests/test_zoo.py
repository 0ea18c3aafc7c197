"""Every awkward model of the zoo, sampled on every step: it trains exactly as without the
inspector, leaves no hook, writes its charts, and gets at most its expected one-time messages."""

import re
import warnings

import pytest
import torch

from layerwatch import Inspector
from models import hook_count, layerwatch_messages, train_through_scaler_overflow
from models import CASES, Case

STEPS = 12  # two windows of samples at the default AlertRules: the window rules judge them too


def run(case: Case, log_dir=None):
    torch.manual_seed(0)
    model = case.make()
    optimizers = case.optimizers(model)
    inspector = None
    if log_dir is not None:
        optimizer = optimizers[0] if len(optimizers) == 1 else None
        inspector = Inspector(model, log_dir=log_dir, every_n_steps=1, optimizer=optimizer).start()
    torch.manual_seed(1)
    losses = []
    for k in range(STEPS):
        losses.append(case.step(model, optimizers, k))
        if inspector is not None:
            inspector.step()
    if inspector is not None:
        inspector.finish()
    return model, optimizers, losses, inspector


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports torch.jit
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_awkward_model(case, tmp_path, events):
    _, _, plain, _ = run(case)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, optimizers, watched, inspector = run(case, tmp_path)
    assert watched == plain  # bitwise: the same floats
    assert all(hook_count(model, opt) == 0 for opt in optimizers or [torch.optim.SGD([torch.zeros(1)], lr=0)])
    ours = layerwatch_messages(seen)
    for message in ours:
        assert any(re.search(expected, message) for expected in case.messages), message
    for expected in case.messages:
        assert sum(bool(re.search(expected, m)) for m in ours) == 1, (expected, ours)
    assert inspector.alerts == []
    scalars = events(tmp_path).Tags()["scalars"]
    if any(True for _ in model.parameters()):
        assert len(events(tmp_path).Scalars("layerwatch/overhead_ms")) == STEPS
        assert any(tag.startswith("weights_norm/") for tag in scalars)


def test_grad_scaler_overflow_is_a_skip_not_a_fault(tmp_path, events):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(RuntimeWarning, match="at step 0 the optimizer skipped its step .* GradScaler overflow skip"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
            # 5 steps: the sixth forward diverges to NaN, a real fault, named as the first offender
            train_through_scaler_overflow(model, opt, 5, inspector)
    assert inspector.alerts == []
    skipped = [e.step for e in events(tmp_path).Scalars("layerwatch/optimizer_skipped")]
    assert skipped[0] == 0 and len(skipped) < 5  # overflow steps only; a real NaN still alerts (test_alerts)


def test_complex_parameter_is_measured_through_real_and_imaginary_parts(tmp_path, events):
    from models import ComplexWeights

    model = ComplexWeights()
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, families=("weights",)) as inspector:
        inspector.step()
    norm = events(tmp_path).Scalars("weights_norm/filter")[0].value
    assert norm == pytest.approx(torch.linalg.vector_norm(model.filter).item(), rel=1e-6)


@pytest.mark.parametrize("case", ["structured outputs", "LSTM and GRU", "checkpoint", "frozen backbone"])
def test_awkward_models_through_the_callback(case, tmp_path, events):
    from layerwatch import InspectCallback
    from models import LitZoo
    from models import make_trainer

    def fit(callbacks, root):
        torch.manual_seed(0)
        module = LitZoo(case)
        make_trainer(root, callbacks, max_steps=6).fit(module)
        return module

    plain = fit([], tmp_path / "plain")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        watched = fit([InspectCallback(every_n_steps=1)], tmp_path / "watched")
    assert watched.losses == plain.losses
    assert not layerwatch_messages(seen)
    assert hook_count(watched, watched.trainer.optimizers) == 0
    acc = events(tmp_path / "watched" / "tb" / "version_0")
    assert len(acc.Scalars("layerwatch/overhead_ms")) == 6 and acc.Tensors("layerwatch/structure/text_summary")
