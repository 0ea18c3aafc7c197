"""Faults, driven directly: the NaN sentinel's findings, the vote on them, the replay of a bad
step, and what is said of the first offender. Real collaborators throughout, on the CPU (where
the sentinel's check lands in the same call that enqueued it)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from layerwatch.distributed.agreement import Decision
from layerwatch.distributed.sharding import Layout
from layerwatch.guards.failures import FailurePolicy
from layerwatch.faults.faults import Faults
from layerwatch.guards.hooks import Attachments
from layerwatch.options import validate_options
from layerwatch.engine.output import Output
from layerwatch.probes import Offender, ProbeResult, StepProbes
from layerwatch.faults.sentinel import NonfiniteSentinel, StepCounter
from layerwatch.vocabulary import FIRST_NONFINITE_STEP

REPLAY_HINT = "to find it, let layerwatch replay the bad step: Inspector.replay_with(closure) before each step's forward"


class Parts:
    """A Faults and its real collaborators; ``asked`` counts the samples it asked for."""

    def __init__(self, log_dir=None, *, sentinel: bool = True, voting: bool = False, staged: bool = False,
                 model: nn.Module | None = None) -> None:
        self.options = validate_options(every_n_steps=1000, sentinel=sentinel)
        self.failures = FailurePolicy()
        self.probes = StepProbes(self.options.families, self.options.modules, self.options.stats, self.options.bins,
                                 self.failures)
        self.counter = StepCounter()
        self.output = Output(Attachments(), self.failures)
        if log_dir is not None:
            self.output.open(log_dir)
        self.asked: list[int] = []
        self.faults = Faults(self.options, self.failures, self.probes, self.counter, self.output.write_fault,
                             lambda: self.asked.append(1))
        torch.manual_seed(0)
        self.model = nn.Linear(3, 2) if model is None else model
        self.faults.start(model=lambda: self.model, layout=Layout(), zero=None, within=None, voting=voting, staged=staged)

    def params(self):
        return list(self.model.named_parameters())

    def poison_weight_gradient(self) -> None:
        """A NaN in the weight's gradient; the bias's gradient finite."""
        self.model.weight.grad = torch.zeros_like(self.model.weight)
        self.model.weight.grad[0, 0] = math.nan
        self.model.bias.grad = torch.zeros_like(self.model.bias)

    def clean_gradients(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)


def layerwatch_warnings(seen) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)
            and str(w.message).startswith("layerwatch:")]


def end_step(parts: Parts, step: int) -> tuple[object, list[str]]:
    """Open ``step`` and check its gradients at its end, as engine.end_step does; returns what
    check returned and the layerwatch warnings it gave."""
    parts.faults.open(step)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        returned = parts.faults.check(parts.params, before_optimizer_step=False)
    return returned, layerwatch_warnings(seen)


class PoisonAt(nn.Module):
    """Finite inputs in, a NaN out (in its first output column): the module a replay must name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.where(torch.arange(x.shape[-1]) == 0, math.nan, 1.0)


def poisoned_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), PoisonAt(), nn.Linear(4, 1))


# ---------------------------------------------------------------------- the sentinel's findings


def test_clean_gradients_are_no_finding_and_the_sentinel_stays_on():
    parts = Parts()
    parts.clean_gradients()
    for step in range(3):
        returned, said = end_step(parts, step)
        assert returned is None and said == []
    assert parts.asked == [] and parts.faults.sentinel is not None and parts.faults.fault_step is None


def test_a_nan_gradient_found_at_the_end_of_a_step_asks_one_sample_warns_and_writes_its_step(tmp_path, events):
    parts = Parts(tmp_path)
    parts.poison_weight_gradient()
    returned, said = end_step(parts, 5)
    assert returned is None
    assert parts.asked == [1]
    (message,) = said
    assert message.startswith("layerwatch: NaN/Inf gradients at step 5 (the sentinel, every step) in weight; ")
    assert "bias" not in message
    assert "the next step is sampled with every probe armed; it shows what came after the fault" in message
    assert message.endswith(f"({REPLAY_HINT})")
    assert parts.faults.fault_step == 5 and parts.faults.sentinel is None
    # nothing is checked afterwards: the same NaN at later steps says and asks nothing more
    for step in (6, 7):
        returned, said = end_step(parts, step)
        assert returned is None and said == []
    assert parts.asked == [1]
    parts.output.close(7)
    assert [(e.step, e.value) for e in events(tmp_path).Scalars(FIRST_NONFINITE_STEP)] == [(5, 5.0)]


def test_an_inf_value_found_by_the_flag_is_said_as_such_and_an_infinite_norm_as_possibly_an_explosion():
    """The fused flag sees values: an Inf is an Inf. A norm (the check of what the kernel does not
    take) also turns infinite when finite values are large enough, and the warning says so."""
    parts = Parts()
    parts.clean_gradients()
    parts.model.bias.grad[1] = math.inf
    _, (message,) = end_step(parts, 2)
    assert "at step 2 (the sentinel, every step) in bias;" in message and "explosion" not in message
    sentinel = NonfiniteSentinel()
    sentinel.check(3, [("big", torch.full((4,), 1e30))], True)  # finite, but its float32 norm overflows
    [finding] = sentinel.poll()
    assert finding.tensors == ["big"] and not finding.nan


def test_a_finding_whose_optimizer_step_was_skipped_is_no_fault():
    parts = Parts()
    parts.counter.add(False)  # a GradScaler skip: the optimizer did not step
    parts.poison_weight_gradient()
    returned, said = end_step(parts, 3)
    assert returned is None and said == [] and parts.asked == []
    assert parts.faults.fault_step is None and parts.faults.sentinel is not None
    # the sentinel is still on: the same NaN on a step the optimizer took is a fault
    parts.counter.add(True)
    _, said = end_step(parts, 4)
    assert len(said) == 1 and said[0].startswith("layerwatch: NaN/Inf gradients at step 4 ")
    assert parts.asked == [1] and parts.faults.fault_step == 4


def test_with_the_sentinel_off_nothing_is_checked_or_said():
    parts = Parts(sentinel=False)
    parts.poison_weight_gradient()
    assert parts.faults.sentinel is None
    returned, said = end_step(parts, 1)
    assert returned is None and said == [] and parts.asked == []
    parts.faults.open(2)
    assert parts.faults.check(parts.params, before_optimizer_step=True) is None


def test_a_check_before_the_optimizer_step_without_a_replay_is_read_at_the_end_of_the_step():
    parts = Parts()
    parts.poison_weight_gradient()
    parts.faults.open(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert parts.faults.check(parts.params, before_optimizer_step=True) is None
        assert layerwatch_warnings(seen) == [] and parts.asked == []  # not read yet: no replay was offered
        assert parts.faults.check(parts.params, before_optimizer_step=False) is None
    (message,) = layerwatch_warnings(seen)
    assert message.startswith("layerwatch: NaN/Inf gradients at step 4 ")
    assert parts.asked == [1] and parts.faults.fault_step == 4


def test_close_stops_the_sentinel_and_drops_the_offered_batches():
    parts = Parts()
    parts.faults.open(0)
    parts.faults.offer(lambda: parts.model(torch.ones(1, 3)).sum(), voting=False)
    parts.faults.close()
    assert parts.faults.sentinel is None and parts.faults.step_replay.micro_batches == []
    parts.poison_weight_gradient()
    assert end_step(parts, 1) == (None, [])


# ---------------------------------------------------------------------- the vote


def test_with_voting_a_finding_waits_for_the_vote_and_is_reported_once_after_it():
    parts = Parts(voting=True)
    parts.poison_weight_gradient()
    returned, said = end_step(parts, 5)
    assert returned is None and said == [] and parts.asked == []
    finding = parts.faults.unvoted()
    assert finding is not None and (finding.step, finding.tensors, finding.nan) == (5, ["weight"], True)
    assert parts.faults.fault_step is None
    # the ranks vote at the next step's begin: every rank knows it now, and the writer reports it
    parts.faults.open(6)
    with pytest.warns(RuntimeWarning, match=r"^layerwatch: NaN/Inf gradients at step 5 ") as seen:
        parts.faults.on_voted(Decision(sampled=True, finding_step=5, finding_nan=True), 6)
    (message,) = layerwatch_warnings(seen)
    assert "(the sentinel, every step) in weight; step 6 is sampled with every probe armed" in message
    assert message.endswith("agree on a finding a step later, after the optimizer step, so the bad step is not replayed)")
    assert parts.faults.unvoted() is None and parts.faults.fault_step == 5 and parts.faults.sentinel is None
    assert parts.asked == []  # the vote decides the sample, not ask_sample
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        parts.faults.on_voted(Decision(sampled=True, finding_step=5, finding_nan=True), 7)
    assert layerwatch_warnings(again) == [] and parts.faults.fault_step == 5


def test_with_voting_only_the_first_finding_waits_for_the_vote():
    parts = Parts(voting=True, staged=True)
    parts.poison_weight_gradient()
    end_step(parts, 2)
    end_step(parts, 3)
    assert parts.faults.unvoted().step == 2


def test_a_vote_carrying_another_ranks_finding_names_no_tensor_of_this_rank():
    parts = Parts(voting=True, staged=True)
    parts.clean_gradients()
    end_step(parts, 3)
    assert parts.faults.unvoted() is None
    parts.faults.open(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parts.faults.on_voted(Decision(sampled=True, finding_step=3, finding_nan=False), 4)
    (message,) = layerwatch_warnings(seen)
    assert message.startswith("layerwatch: NaN/Inf gradients at step 3 (the sentinel, every step) in gradients "
                              "(shards, or a pipeline stage's) held by another rank (or finite gradients whose norm "
                              "passes ~1.8e19: an explosion); step 4 is sampled")
    assert message.endswith("(a pipelined run's ranks agree on a finding a step later, after the optimizer step, so "
                            "the bad step is not replayed)")
    assert parts.faults.fault_step == 3


# ---------------------------------------------------------------------- the first offender


def test_the_first_offender_is_one_alert_once_a_run():
    parts = Parts()
    offender = Offender("fc", "forward")
    alerts, named = parts.faults.offender_alerts(3, ProbeResult([], offender), True)
    (alert,) = alerts
    assert (alert.kind, alert.name, alert.step) == ("nonfinite", "fc", 3)
    assert alert.message == "first offender: step 3, forward: fc turned finite inputs into a non-finite output"
    assert named is offender
    assert parts.faults.offender_alerts(4, ProbeResult([], Offender("other", "backward")), True) == ([], None)


def test_a_probed_offender_on_a_step_the_optimizer_skipped_is_no_alert_and_the_next_one_counts():
    parts = Parts()
    assert parts.faults.offender_alerts(3, ProbeResult([], Offender("fc", "forward")), False) == ([], None)
    assert parts.faults.offender_alerts(3, None, True) == ([], None)
    alerts, named = parts.faults.offender_alerts(4, ProbeResult([], Offender("fc", "backward")), True)
    assert [a.message for a in alerts] == ["first offender: step 4, backward: fc turned finite gradient with respect "
                                           "to its outputs into a non-finite gradient with respect to its inputs (or "
                                           "parameters)"]
    assert named is not None and named.phase == "backward"


def test_a_replayed_offender_is_the_first_offender_whatever_the_optimizer_did():
    parts = Parts()
    offender = Offender("fc", "forward", replayed_from=3, replayed_what="micro-batch 2 of 4")
    (alert,), named = parts.faults.offender_alerts(3, ProbeResult([], offender), False)
    assert alert.message == ("first offender: step 3, forward: fc turned finite inputs into a non-finite output "
                             "(replayed from step 3, micro-batch 2 of 4)")
    assert named is offender


def test_an_offender_seen_after_an_unreplayed_fault_is_not_called_the_first_offender():
    parts = Parts()
    parts.poison_weight_gradient()
    end_step(parts, 5)
    assert parts.faults.fault_step == 5
    (alert,), named = parts.faults.offender_alerts(6, ProbeResult([], Offender("fc", "forward")), True)
    assert named is None
    assert alert.message == ("first module with a non-finite forward output at step 6: fc. The fault happened at step "
                             "5, between samples; step 6 shows what came after it, which need not be where it began "
                             f"({REPLAY_HINT})")
    assert "first offender" not in alert.message


def test_an_offender_on_the_faults_own_step_is_still_the_first_offender():
    parts = Parts()
    parts.poison_weight_gradient()
    end_step(parts, 5)
    (alert,), named = parts.faults.offender_alerts(5, ProbeResult([], Offender("fc", "forward")), True)
    assert alert.message.startswith("first offender: step 5, forward: fc") and named is not None


def test_a_module_using_a_non_finite_weight_is_said_to_use_the_fault_not_to_make_it():
    parts = Parts()
    result = ProbeResult([], None, weight_user=Offender("fc", "forward"), nonfinite_weights=["fc.weight", "fc.bias"])
    (alert,), named = parts.faults.offender_alerts(4, result, True)
    assert named is None and (alert.kind, alert.name, alert.step) == ("nonfinite", "fc", 4)
    assert alert.message == ("first module to use a non-finite weight at step 4: fc (fc.weight, fc.bias held NaN/Inf "
                             "before the step's forward). The fault happened before step 4, where no probe saw it; the "
                             "optimizer carried it into the weights, so the module that made it is not known (the "
                             "sentinel had not checked those gradients yet)")


def test_a_weight_user_after_a_found_fault_names_the_faults_step_and_many_weights_are_cut_short():
    parts = Parts()
    parts.poison_weight_gradient()
    end_step(parts, 2)
    weights = [f"w{i}" for i in range(5)]
    (alert,), _ = parts.faults.offender_alerts(3, ProbeResult([], None, Offender("fc", "forward"), weights), True)
    assert alert.message.startswith("first module to use a non-finite weight at step 3: fc (w0, w1, w2 and 2 more held "
                                    "NaN/Inf before the step's forward). The fault happened at step 2, between samples")
    assert alert.message.endswith(f"({REPLAY_HINT})")


def test_a_weight_user_with_the_sentinel_off_says_so():
    parts = Parts(sentinel=False)
    (alert,), _ = parts.faults.offender_alerts(1, ProbeResult([], None, Offender("fc", "forward"), ["fc.weight"]), True)
    assert alert.message.endswith("(the sentinel is off; with sentinel=True it is found at its step)")


# ---------------------------------------------------------------------- what is said of an unreplayed fault


def test_the_front_doors_replay_hint_replaces_the_replay_with_advice():
    parts = Parts()
    parts.faults.describe_replay(unreplayable="this loop clears the gradients before the step ends")
    parts.poison_weight_gradient()
    _, (message,) = end_step(parts, 5)
    assert message.endswith("(this loop clears the gradients before the step ends)")
    assert "replay_with" not in message
    (alert,), _ = parts.faults.offender_alerts(6, ProbeResult([], Offender("fc", "forward")), True)
    assert alert.message.endswith("(this loop clears the gradients before the step ends)")


def test_a_fault_found_after_its_offered_step_passed_says_so():
    parts = Parts()
    parts.faults.open(5)
    parts.faults.offer(lambda: parts.model(torch.ones(1, 3)).sum(), voting=False)
    parts.poison_weight_gradient()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parts.faults.check(parts.params, before_optimizer_step=False)  # the end of the step: too late to replay
    (message,) = layerwatch_warnings(seen)
    assert message.endswith("(the sentinel saw it after the step it happened in had passed, so that step was not replayed)")
    assert parts.asked == [1]


# ---------------------------------------------------------------------- offering and replaying a step


def test_a_micro_batch_is_kept_only_when_the_sentinel_is_on_and_the_ranks_do_not_vote():
    parts = Parts()
    parts.faults.open(0)
    closure = lambda: parts.model(torch.ones(1, 3)).sum()  # noqa: E731
    parts.faults.offer(closure, voting=False)
    parts.faults.offer(closure, voting=False)
    assert [micro.closure for micro in parts.faults.step_replay.micro_batches] == [closure, closure]
    parts.faults.offer(closure, voting=True)
    assert len(parts.faults.step_replay.micro_batches) == 2
    parts.faults.open(1)  # a new step: the last one's micro-batches go
    assert parts.faults.step_replay.micro_batches == []
    off = Parts(sentinel=False)
    off.faults.open(0)
    off.faults.offer(closure, voting=False)
    assert off.faults.step_replay.micro_batches == []


def test_a_step_replayed_before_its_optimizer_step_names_the_module_that_made_the_nan():
    model = poisoned_model()
    parts = Parts(model=model)
    x = torch.randn(8, 3)
    closure = lambda: model(x).sum()  # noqa: E731
    parts.faults.open(7)
    parts.faults.offer(closure, voting=False)
    closure().backward()
    grads = [p.grad for p in model.parameters()]
    assert not torch.isfinite(grads[0]).all()
    with pytest.warns(RuntimeWarning, match=r"^layerwatch: NaN/Inf gradients at step 7 ") as seen:
        returned = parts.faults.check(parts.params, before_optimizer_step=True)
    assert returned is not None
    result, seconds = returned
    assert isinstance(result, ProbeResult) and seconds >= 0
    assert (result.offender.name, result.offender.phase) == ("1", "forward")
    assert result.offender.replayed_from == 7 and result.offender.replayed_what == ""
    (message,) = layerwatch_warnings(seen)
    assert "its batch is run again with every probe armed, before the optimizer step, to find the module that made it" in message
    # a named fault asks no sample (the step is sampled with the replay's probes), and is no unreplayed fault
    assert parts.asked == [] and parts.faults.fault_step is None and parts.faults.sentinel is None
    assert [p.grad for p in model.parameters()] == grads  # the very tensors the optimizer steps with, put back
    (alert,), named = parts.faults.offender_alerts(7, result, True)
    assert alert.message == "first offender: step 7, forward: 1 turned finite inputs into a non-finite output (replayed from step 7)"
    assert named is result.offender
    assert end_step(parts, 8) == (None, [])  # the end of the step checks nothing more


def test_a_replay_that_makes_no_nan_again_says_so_and_samples_the_next_step():
    parts = Parts()
    parts.faults.open(7)
    parts.faults.offer(lambda: parts.model(torch.ones(2, 3)).sum(), voting=False)  # a finite loss
    parts.poison_weight_gradient()  # the NaN came from somewhere the closure does not run
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert parts.faults.check(parts.params, before_optimizer_step=True) is None
    said = layerwatch_warnings(seen)
    assert len(said) == 2
    assert "its batch is run again with every probe armed, before the optimizer step" in said[0]
    assert said[1] == ("layerwatch: step 7's batch, run again with every probe armed, made no NaN/Inf (the fault is "
                       "outside what the replay runs, or does not happen again); the next step is sampled instead")
    assert parts.asked == [1] and parts.faults.fault_step == 7
    (alert,), named = parts.faults.offender_alerts(8, ProbeResult([], Offender("fc", "forward")), True)
    assert named is None and alert.message.endswith("(step 7's batch, run again, made no NaN/Inf)")


def test_weights_already_non_finite_are_not_replayed_and_the_fault_is_said_to_come_earlier():
    parts = Parts()
    ran = []
    parts.faults.open(4)
    parts.faults.offer(lambda: ran.append(1) or parts.model(torch.ones(2, 3)).sum(), voting=False)
    with torch.no_grad():
        parts.model.weight[0, 0] = math.nan
    parts.poison_weight_gradient()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert parts.faults.check(parts.params, before_optimizer_step=True) is None
    assert ran == []
    (message,) = layerwatch_warnings(seen)
    assert ("the weights held NaN/Inf already, so the fault came earlier, in gradients the sentinel had not checked yet; "
            "the next step is sampled with every probe armed") in message
    assert parts.asked == [1] and parts.faults.fault_step == 4
    (alert,), _ = parts.faults.offender_alerts(5, ProbeResult([], Offender("fc", "forward")), True)
    assert "The fault happened before step 4, between samples" in alert.message


@pytest.mark.parametrize("lands_later, spread, measured, waited",
                         [(True, 1, True, [True]), (True, 3, True, []), (True, 1, False, []), (False, 3, False, [True])])
def test_a_check_that_lands_later_is_not_waited_for_once_the_budget_spread_it(monkeypatch, lands_later, spread, measured,
                                                                              waited):
    """On a GPU the sentinel's check lands a step later, and replaying the step means waiting for
    it before the optimizer step: a device sync a step. It is waited for only once the budget
    measured the checks within their share: not before it measured them, nor once it spread the
    check (the CPU's check costs no wait: it stays)."""
    from layerwatch.faults.messages import spread_message

    watch, poll, polled = NonfiniteSentinel.watch, NonfiniteSentinel.poll, []

    def watching(self, *args, **kwargs):
        watch(self, *args, **kwargs)
        self.lands_later = lands_later  # as on a GPU (or not)

    monkeypatch.setattr(NonfiniteSentinel, "watch", watching)
    monkeypatch.setattr(NonfiniteSentinel, "poll", lambda self, wait=False, at_hand=None: polled.append(wait) or poll(self, wait, at_hand))
    parts = Parts()
    parts.clean_gradients()
    end_step(parts, 3)  # the sentinel watches the gradients (spread comes later in a run: after measuring)
    polled.clear()
    parts.faults.open(4, spread, measured)
    parts.faults.offer(lambda: parts.model(torch.ones(1, 3)).sum(), voting=False)
    assert parts.faults.check(parts.params, before_optimizer_step=True) is None
    assert polled == waited
    assert "Nor is its check waited for" in spread_message(5, True) and "waited" not in spread_message(5, False)


def test_the_first_check_is_not_waited_for_before_the_budget_measured_it(monkeypatch):
    """Before its first check the sentinel does not know where the gradients are: taken as a GPU's,
    whose check is not waited for (a sync) until the budget measured it; known once watched."""
    poll, polled = NonfiniteSentinel.poll, []
    monkeypatch.setattr(NonfiniteSentinel, "poll", lambda self, wait=False, at_hand=None: polled.append(wait) or poll(self, wait, at_hand))
    parts = Parts()
    parts.clean_gradients()
    assert parts.faults.sentinel.lands_later is None
    for step, waited in ((0, []), (1, [True])):  # the CPU's: known after the first check, and free to read
        polled.clear()
        parts.faults.open(step, 1, False)
        parts.faults.offer(lambda: parts.model(torch.ones(1, 3)).sum(), voting=False)
        assert parts.faults.check(parts.params, before_optimizer_step=True) is None
        assert polled == waited, step
        parts.faults.check(parts.params)


def test_the_sentinels_shares_are_made_again_only_for_other_tensors_or_a_new_spread(monkeypatch):
    """A sample walks the parameters again (FSDP may have swapped them): the same tensors keep
    their shares, whose making is work per tensor."""
    from layerwatch.faults.sentinel import NonfiniteSentinel

    watch, watched = NonfiniteSentinel.watch, []
    monkeypatch.setattr(NonfiniteSentinel, "watch", lambda self, params, *a: watched.append(len(params)) or watch(self, params, *a))
    parts = Parts()
    parts.clean_gradients()
    end_step(parts, 0)
    assert watched == [2]
    end_step(parts, 1)  # walked again (Parts.params makes a new list each time): the same tensors
    assert watched == [2]
    parts.model.bias = nn.Parameter(torch.zeros(2))  # another tensor
    parts.clean_gradients()
    end_step(parts, 2)
    assert watched == [2, 2]
    parts.faults.open(3, spread=2)
    parts.faults.check(parts.params)
    assert watched == [2, 2, 2]


def test_the_warning_says_which_gradients_the_flag_did_not_name():
    from layerwatch.faults.messages import where_found
    from layerwatch.faults.sentinel import Finding

    assert where_found(Finding(3, ["a"], True, True)) == " in a"
    assert where_found(Finding(3, [], True, True, unnamed=True)) == " in this step's share of the gradients (its one flag names none)"
    assert where_found(Finding(3, ["a"], True, True, unnamed=True)) == (
        " in a and this step's share of the gradients (its one flag names none)")  # a norms group named a, a flag none
    assert where_found(Finding(3, [], True, True)) == " in gradients (shards, or a pipeline stage's) held by another rank"
