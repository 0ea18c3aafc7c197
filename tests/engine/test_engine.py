"""The engine's public driving protocol, as a third front door would use it."""

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from layerwatch.engine.engine import Engine
from layerwatch.options import validate_options
from models import MLP, HiddenMiddle, Sluggish, hook_count


def drive(engine, model, opt, steps, x=None):
    """A loop that calls every step of the protocol, as the Lightning and Hugging Face adapters do."""
    torch.manual_seed(0)
    written, grads = [], {}
    for k in range(steps):
        engine.begin_step(k)
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        grads[k] = {n: p.grad.clone() for n, p in model.named_parameters()}
        engine.before_optimizer_step()
        opt.step()
        engine.after_optimizer_step()
        written.append(engine.end_step())
    return written, grads


def test_the_protocol_reads_gradients_before_the_step_and_weights_after_it(tmp_path, events):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = Engine(model, validate_options(every_n_steps=2), log_dir=tmp_path).start()
    written, grads = drive(engine, model, opt, 4)
    engine.finish()
    assert written == [0, None, 2, None]
    acc = events(tmp_path)
    for name, p in model.named_parameters():
        norms = [s.value for s in acc.Scalars(f"grads_norm/{name}")]
        np.testing.assert_allclose(norms, [grads[k][name].norm().item() for k in (0, 2)], rtol=1e-5)
        assert [s.step for s in acc.Scalars(f"update_ratio/{name}")] == [0, 2]
    last = [s.value for s in acc.Scalars("weights_norm/fc1.weight")][-1]
    assert last != pytest.approx(model.fc1.weight.norm().item())  # step 3 changed them again: read at step 2


def test_a_step_that_may_not_be_sampled_is_not(tmp_path, events):
    model = MLP()
    engine = Engine(model, validate_options(every_n_steps=1), log_dir=tmp_path).start()
    assert engine.begin_step(0, may_sample=False) is False and not engine.sampled
    assert engine.end_step() is None
    assert engine.begin_step(1) is True and engine.sampled
    engine.finish()


def test_misuse_is_refused_with_the_bad_value(tmp_path):
    model = MLP()
    with pytest.raises(TypeError, match="options must be an Options from validate_options\\(\\), got dict"):
        Engine(model, {"every_n_steps": 5})
    engine = Engine(model, validate_options(), log_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"begin_step\(\) called on an engine that is new"):
        engine.begin_step(0)
    engine.start()
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        engine.begin_step(-1)
    with pytest.raises(ValueError, match="step must be an int >= 0, got '3'"):
        engine.begin_step("3")
    engine.finish()
    with pytest.raises(RuntimeError, match="that is finished"):
        engine.end_step()


def test_overhead_ms_counts_the_time_spent_in_the_hooks(tmp_path, events):
    model = HiddenMiddle(Sluggish)  # each function the probes call on its hidden activation sleeps
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, validate_options(every_n_steps=1, families=("grads", "activations")), log_dir=tmp_path).start()
    drive(engine, model, opt, 2)
    engine.finish()
    reported = [s.value for s in events(tmp_path).Scalars("layerwatch/overhead_ms")]
    assert len(reported) == 2 and all(ms >= 1e3 * Sluggish.DELAY for ms in reported), reported


@pytest.mark.parametrize("adapter", ["inspector.py", "lightning.py", "huggingface.py"])
def test_the_front_doors_use_no_private_member_of_the_engine(adapter):
    """The adapters hold an engine and drive its public protocol: a subclass of it, or any
    ``x._engine._name``, is a defect."""
    source = Path(__file__).resolve().parents[2] / "src" / "layerwatch" / adapter
    tree = ast.parse(source.read_text())
    bases = [ast.unparse(base) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for base in node.bases]
    assert "Engine" not in bases
    private = [
        node.attr for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and isinstance(node.value, ast.Attribute) and node.value.attr == "_engine"
    ]
    assert private == []


def test_every_front_door_takes_every_option_with_validate_options_default():
    """The doors keep explicit signatures (help, completion) and hand ``locals()`` on: a name or
    default that drifted from ``validate_options`` would go unnoticed without this."""
    from layerwatch import InspectCallback, Inspector
    from layerwatch.options import OPTION_NAMES, validate_options

    pytest.importorskip("transformers")
    from layerwatch.huggingface import InspectTrainerCallback

    reference = inspect.signature(validate_options).parameters
    for door in (Inspector, InspectCallback, InspectTrainerCallback):
        parameters = inspect.signature(door).parameters
        for name in OPTION_NAMES:
            assert name in parameters, (door.__name__, name)
            assert parameters[name].default == reference[name].default, (door.__name__, name)
    assert reference["overhead_budget"].default is None  # None: 0.01 unless every_n_steps or schedule is given
    assert reference["memory_budget"].default is None  # None: no limit but a GPU's free memory


def test_the_engine_stays_a_coordinator_and_no_class_grows_past_350_lines():
    """The engine drives the protocol and its parts decide (docs/architecture.md): a new concern
    gets a home of its own, not more lines here."""
    import ast
    from pathlib import Path

    import layerwatch

    src = Path(layerwatch.__file__).parent
    assert len((src / "engine" / "engine.py").read_text().splitlines()) <= 400
    long = {f"{path.relative_to(src)}:{node.name}": node.end_lineno - node.lineno + 1
            for path in src.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 350}
    assert not long, long


def test_a_sampled_steps_hooks_come_off_when_the_next_step_begins_even_one_begun_again(tmp_path):
    """A sampled step's module hooks stay on to its end and come off when the next step begins;
    an unsampled step puts none on and takes none off; a sampled step begun again (no end_step
    between) is armed once, not twice."""
    model = MLP()
    engine = Engine(model, validate_options(every_n_steps=2, sentinel=False), log_dir=tmp_path).start()
    bare = hook_count(model)
    assert engine.begin_step(0) and hook_count(model) > bare
    armed = hook_count(model)
    assert engine.begin_step(0) and hook_count(model) == armed  # begun again: armed once
    model(torch.randn(4, 8)).sum().backward()
    engine.end_step()
    assert not engine.begin_step(1) and hook_count(model) == bare
    engine.end_step()
    assert engine.begin_step(2) and hook_count(model) > bare  # (fewer than step 0's: the layer table is made once)
    engine.finish()
    assert hook_count(model) == bare
