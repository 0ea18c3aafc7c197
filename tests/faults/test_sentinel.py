"""The NaN sentinel's share of the gradients on the CPU: every gradient, in turn."""

import math

import pytest
import torch
from torch import nn

from layerwatch import Inspector, at_steps
from layerwatch.faults import sentinel as sentinel_module
from layerwatch.stats import norms as fused
from layerwatch.faults.sentinel import NonfiniteSentinel


def params(sizes):
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_shares_cover_every_gradient_value_once_and_hold_at_most_their_budget(monkeypatch):
    monkeypatch.setattr(sentinel_module, "CPU_MIN_BYTES", 1)
    monkeypatch.setattr(sentinel_module, "CPU_ROTATION", 16)
    named = params([100, 100, 100, 100, 800, 50])  # bytes: 400 x4, 3200, 200; total 5,000; budget 313 a share
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    covered = {name: torch.zeros(p.numel()) for name, p in named}
    for share in sentinel._shares:
        size = 0
        for name, p, values in share:
            covered[name][values if values is not None else slice(None)] += 1
            size += covered[name][values if values is not None else slice(None)].numel() * 4
        assert size <= 313
    assert all(bool((c == 1).all()) for c in covered.values())  # every value once
    # slices of 78 values: p0..p3 two shares each, p4 eleven, its last slice shared with p5
    assert sentinel.rotation == len(sentinel._shares) == 4 * 2 + 11


def test_small_models_are_checked_whole_on_every_step():
    sentinel = NonfiniteSentinel()
    sentinel.watch(params([1000, 10]), lambda t: t)
    assert sentinel.rotation == 1


def test_a_cpu_share_holds_at_most_its_tensors_and_a_spread_divides_them_further():
    many = params([4] * 100)  # 1,600 bytes: one share by their bytes
    sentinel = NonfiniteSentinel()
    sentinel.watch(many, lambda t: t)
    assert [len(share) for share in sentinel._shares] == [16] * 6 + [4]  # CPU_MAX_TENSORS
    sentinel.watch(many, lambda t: t, spread=10)
    assert sentinel.rotation == 10 and {len(share) for share in sentinel._shares} == {10}
    assert [name for share in sentinel._shares for name, _, _ in share] == [name for name, _ in many]  # each once


def test_a_spread_rewatch_goes_on_where_the_rotation_was():
    sentinel = NonfiniteSentinel()
    sentinel.watch(params([4] * 64), lambda t: t)
    sentinel.check_next(0, True)
    sentinel.watch(params([4] * 64), lambda t: t, spread=4)  # the next share is the second of the four
    assert sentinel._next % sentinel.rotation == 1


def test_a_nan_that_stays_is_found_within_one_rotation(tmp_path, events, monkeypatch):
    monkeypatch.setattr(sentinel_module, "CPU_MIN_BYTES", 1)
    monkeypatch.setattr(sentinel_module, "CPU_ROTATION", 8)  # 1,152 bytes of gradients: 144 a share
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))  # each weight in two slices, a bias with the second: 8 shares
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found = []
    with pytest.warns(RuntimeWarning, match="the sentinel, each gradient at least every 8 steps") as seen:
        with Inspector(model, log_dir=tmp_path, schedule=at_steps([]), optimizer=opt) as inspector:
            for k in range(20):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if k >= 5:
                    model[2].bias.grad[0] = math.nan  # from step 5 on, and the weights go NaN with it
                opt.step()
                inspector.step()
    found = [s.step for s in events(tmp_path).Scalars("layerwatch/first_nonfinite_step")]
    assert len(found) == 1 and 5 <= found[0] < 5 + 8
    assert any("2.bias" in str(w.message) or "2.weight" in str(w.message) for w in seen)


@pytest.mark.parametrize("optimizer_given", [True, False])
def test_gradients_cleared_before_the_step_ends_are_checked_before_the_optimizer_step(optimizer_given, tmp_path, events):
    """``opt.zero_grad()`` after ``opt.step()``, as the Hugging Face Trainer does: with the
    optimizer given, its step pre-hook checks the gradients it steps with. Without it there is
    nothing to check at ``inspector.step()``, and the one-step NaN goes unseen by the sentinel
    (the weights then hold it: the next sample says so)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, schedule=at_steps([0]), optimizer=opt if optimizer_given else None) as inspector:
        for k in range(6):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            if k == 3:
                model[0].bias.grad[0] = math.nan
            opt.step()
            opt.zero_grad()
            inspector.step()
    found = [(s.step, s.value) for s in events(tmp_path).Scalars("layerwatch/first_nonfinite_step")] \
        if "layerwatch/first_nonfinite_step" in events(tmp_path).Tags()["scalars"] else []
    assert found == ([(3, 3.0)] if optimizer_given else [])


@pytest.mark.parametrize("skipped", [True, False])
def test_a_check_made_before_an_optimizer_step_that_is_then_skipped_is_no_fault(skipped, tmp_path, events):
    """A door checks the gradients before the optimizer step (Lightning's and the Hugging Face
    Trainer's hooks come before a GradScaler decides) and learns after it whether the optimizer
    stepped: an Inf it then skipped is a GradScaler's overflow, not a fault."""
    import warnings

    from layerwatch.engine.engine import Engine
    from layerwatch.options import validate_options

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, validate_options(schedule=at_steps([])), log_dir=tmp_path).start()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for k in range(4):
            engine.begin_step(k)
            model(torch.randn(8, 4)).pow(2).mean().backward()
            if k == 2:
                model.weight.grad[0, 0] = math.inf
            engine.before_optimizer_step()
            stepped = not (skipped and k == 2)
            if stepped:
                opt.step()
            engine.after_optimizer_step(stepped=stepped)
            opt.zero_grad()
            engine.end_step()
    engine.finish()
    said = [str(w.message) for w in seen if "the sentinel" in str(w.message)]
    scalars = events(tmp_path).Tags()["scalars"]
    if skipped:
        assert said == [] and "layerwatch/first_nonfinite_step" not in scalars
    else:
        assert len(said) == 1 and "NaN/Inf gradients at step 2" in said[0]
        assert [e.step for e in events(tmp_path).Scalars("layerwatch/first_nonfinite_step")] == [2]


def test_an_unsampled_step_checks_a_bounded_share_and_makes_the_same_calls_for_1000_tensors_as_for_100(
        tmp_path, monkeypatch):
    """The host's work between samples does not grow with the model: the sentinel flags at most
    CPU_MAX_TENSORS gradients a step with one fused kernel (no norm, no tensor per gradient), and
    layerwatch's Python calls are the same (counted, not timed: a count does not vary with the
    machine's load)."""
    import sys

    normed: list[int] = []
    flagged: list[int] = []
    norms, flag = fused.stacked_norms, torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(fused, "stacked_norms", lambda tensors, *a: normed.append(len(tensors)) or norms(tensors, *a))
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda tensors, *a: flagged.append(len(tensors)) or flag(tensors, *a))

    def calls_of_ours(tensors: int) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(tensors // 2)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(8, 4)
        counted = [0]

        def profile(frame, event, arg):
            if event == "call" and "/layerwatch/" in frame.f_code.co_filename:
                counted[0] += 1

        with Inspector(model, log_dir=tmp_path / str(tensors), schedule=at_steps([0]), optimizer=opt) as inspector:
            for step in range(6):
                opt.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
                normed.clear()
                flagged.clear()
                if step == 5:  # an unsampled step, well after the sample
                    sys.setprofile(profile)
                opt.step()
                inspector.step()
                sys.setprofile(None)
        assert flagged == [sentinel_module.CPU_MAX_TENSORS] and normed == []  # one share of the 100 or 1,000 gradients
        return counted[0]

    assert calls_of_ours(1000) == calls_of_ours(100) < 100


def gradients(named, values):
    for (_, p), v in zip(named, values):
        p.grad = torch.tensor(v, dtype=p.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_fused_flag_leaves_every_gradient_bitwise_as_it_was_and_names_the_offender_on_the_cpu(dtype):
    """The flag kernel writes each value back: subnormals, -0.0, the largest finite, NaN and Inf keep
    their bits. A hit read at once (the CPU) is named from the same gradients' norms."""
    tiny = torch.finfo(dtype).tiny / 4  # subnormal
    named = [(f"p{i}", nn.Parameter(torch.zeros(3, dtype=dtype))) for i in range(3)]
    gradients(named, [[tiny, -0.0, torch.finfo(dtype).max], [1.0, 2.0, 3.0], [float("nan"), float("inf"), -tiny]])
    before = [p.grad.clone() for _, p in named]
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    assert sentinel._plans[0][0][2] is not None  # the flag kernel takes the dtype on the CPU
    sentinel.check_next(7, True)
    for (_, p), b in zip(named, before):
        assert torch.equal(p.grad.view(torch.uint8 if dtype.itemsize == 1 else {2: torch.int16, 4: torch.int32,
                                                                                  8: torch.int64}[dtype.itemsize]),
                           b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]))
    [finding] = sentinel.poll()
    assert (finding.step, finding.tensors, finding.nan, finding.unnamed) == (7, ["p2"], True, False)


def test_a_flag_that_lands_later_names_its_gradients_only_while_they_are_at_hand(monkeypatch):
    """Where reads are not free (a GPU's: taken here on the CPU), the flag is read once it has
    landed: in the same step, before the optimizer step (a replay's wait), its gradients still
    name the offender; a step later they are gone, and the finding says it names none."""
    from layerwatch import stats

    monkeypatch.setattr(stats, "host_reads_free", lambda device: False)
    named = params([2, 2])
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    assert sentinel.lands_later
    gradients(named, [[0.0, 1.0], [float("inf"), 0.0]])
    sentinel.check_next(3, None)
    [waited] = sentinel.poll(wait=True, at_hand=3)
    assert (waited.tensors, waited.unnamed, waited.nan) == (["p1"], False, True)
    sentinel.check_next(4, None)
    [later] = sentinel.poll(at_hand=5)
    assert (later.step, later.tensors, later.unnamed, later.nan) == (4, [], True, True)
    gradients(named, [[0.0, 1.0], [2.0, 0.0]])
    sentinel.check_next(6, None)
    assert sentinel.poll() == []


def test_a_missing_gradient_or_a_dtype_the_kernel_does_not_take_is_checked_by_norms():
    """A parameter unused this step (no gradient) or a complex one is checked by its norm: the
    others still are, and a NaN in them is named."""
    named = params([2, 2]) + [("c", nn.Parameter(torch.zeros(2, dtype=torch.complex64)))]
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    assert [ones is not None for _, _, ones, _ in sentinel._plans[0]] == [True, False]
    named[1][1].grad = torch.tensor([float("nan"), 0.0])
    named[2][1].grad = torch.tensor([float("inf"), 0.0], dtype=torch.complex64)
    sentinel.check_next(1, True)  # p0 has no gradient
    [finding] = sentinel.poll()
    assert sorted(finding.tensors) == ["c", "p1"] and finding.nan


def test_the_flag_is_float32_whatever_the_default_dtype():
    """The fused kernel takes float32 flags only: a run under torch.set_default_dtype(float64) is checked too."""
    was = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        named = params([2, 2])
        sentinel = NonfiniteSentinel()
        sentinel.watch(named, lambda t: t)
        gradients(named, [[0.0, 1.0], [float("nan"), 0.0]])
        sentinel.check_next(2, True)
        [finding] = sentinel.poll()
    finally:
        torch.set_default_dtype(was)
    assert finding.tensors == ["p1"] and finding.nan


def test_a_gradient_the_kernel_cannot_write_back_is_checked_by_norms():
    """An expanded gradient (one memory location for several values, as a user may assign) cannot
    be written in place: that step's share is checked by norms, and its NaN is found."""
    named = params([4, 2])
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    named[0][1].grad = torch.tensor([float("nan")]).expand(4)
    named[1][1].grad = torch.zeros(2)
    sentinel.check_next(5, True)
    [finding] = sentinel.poll()
    assert finding.tensors == ["p0"]


def test_a_frozen_parameter_is_not_watched_and_its_share_keeps_the_fused_flag(monkeypatch):
    """A parameter that requires no gradient never has one: left out of the shares, it does not
    send a frozen backbone's every share to the norms (a missing gradient would)."""
    named = params([2, 2, 2])
    named[1][1].requires_grad_(False)
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    assert [name for share in sentinel._shares for name, _, _ in share] == ["p0", "p2"]
    normed = []
    norms = fused.stacked_norms
    monkeypatch.setattr(fused, "stacked_norms", lambda t, *a: normed.append(len(t)) or norms(t, *a))
    gradients([named[0], named[2]], [[0.0, 1.0], [float("nan"), 0.0]])
    sentinel.check_next(1, True)
    assert normed == []  # the flag, not the norms
    [finding] = sentinel.poll()
    assert finding.tensors == ["p2"]


def test_a_copied_sentinel_reads_its_own_kept_flag():
    """The CPU's kept flag is a tensor over a Python array the host reads: a copy of the sentinel
    gets a flag whose tensor and array still share their memory, and finds a NaN as the original does."""
    import copy

    named = params([2, 2])
    sentinel = NonfiniteSentinel()
    sentinel.watch(named, lambda t: t)
    gradients(named, [[0.0, 1.0], [2.0, 3.0]])
    sentinel.check_next(0, True)
    assert sentinel.poll() == []
    copied = copy.deepcopy(sentinel)
    copied_named = [(name, p) for name, p, _ in copied._shares[0]]
    gradients(copied_named, [[0.0, float("nan")], [2.0, 3.0]])
    copied.check_next(1, True)
    [finding] = copied.poll()
    assert (finding.step, finding.tensors, finding.nan) == (1, ["p0"], True)
    sentinel.check_next(2, True)  # the original's own flag was left alone
    assert sentinel.poll() == []
