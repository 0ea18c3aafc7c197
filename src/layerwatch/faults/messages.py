"""What is said of a fault: pure functions from a finding (and what they need, passed in) to
its text. Nothing here warns, logs or writes: :class:`~layerwatch.faults.faults.Faults` and
:class:`~layerwatch.faults.step_replay.StepReplay` say what these return.

- the finding's warning (:func:`nonfinite_message`), and where its NaN/Inf was (:func:`where_found`);
- why its step was not replayed (:func:`unreplayed`, and the hints the replay leaves behind);
- what a replay that named nothing says (:func:`replay_fruitless`);
- at the next sample, the offender, or what a module seen after an unreplayed fault is
  (:func:`after_fault`, :func:`weights_came_first`): never "the first offender";
- the overhead budget's spread of the sentinel's check (:func:`spread_message`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from layerwatch.faults.sentinel import Finding
from layerwatch.probes.result import Offender


def nonfinite_message(finding: Finding, sampled_step: Optional[int], step: int, sees_nonfinite: bool,
                      fault_before: bool, why_unreplayed: str) -> str:
    """The sentinel's first hit at open step ``step``: the step, and what comes next: the replay
    of that step (``sampled_step`` None), or every probe armed at ``sampled_step``
    (``sees_nonfinite``: the probes armed at the open step see the NaN appear; ``fault_before``:
    the weights held NaN/Inf already; ``why_unreplayed``: :func:`unreplayed`)."""
    where = where_found(finding)
    overflow = "" if finding.nan else " (or finite gradients whose norm passes ~1.8e19: an explosion)"
    every = "every step" if finding.rotation == 1 else f"each gradient at least every {finding.rotation} steps"
    if sampled_step is None:
        then = "its batch is run again with every probe armed, before the optimizer step, to find the module that made it"
    elif finding.step == step and sees_nonfinite:
        then = "this step is sampled with every probe armed, so they name the module that made it"
    else:
        which = "the next step" if sampled_step == step + 1 else f"step {sampled_step}"
        before = ("the weights held NaN/Inf already, so the fault came earlier, in gradients the sentinel had not "
                  "checked yet; " if fault_before else "")
        then = (f"{before}{which} is sampled with every probe armed; it shows what came after the fault, not the "
                f"module that made it ({why_unreplayed})")
    seen = f"(the sentinel, {every}){where}{overflow}" if not finding.seen_by else f"({finding.seen_by})"
    return f"NaN/Inf gradients at step {finding.step} {seen}; {then}"


def where_found(finding: Finding) -> str:
    """Where the warning says the NaN/Inf was: the gradients named, those a flag did not name, or another rank's."""
    names = ", ".join(finding.tensors[:5]) + (f" and {len(finding.tensors) - 5} more" if len(finding.tensors) > 5 else "")
    if finding.unnamed:
        return f"{f' in {names} and' if names else ' in'} this step's share of the gradients (its one flag names none)"
    return f" in {names}" if names else " in gradients (shards, or a pipeline stage's) held by another rank"


def scaler_skip(step: int) -> str:
    """The log line of a finding whose step the optimizer skipped (a GradScaler's overflow): no fault."""
    return f"layerwatch: step {step}: NaN/Inf gradients and no optimizer step (a GradScaler skip)"


# ---------------------------------------------------------------------- why a step was not replayed


def unreplayed(hint: Optional[str], offered: bool) -> str:
    """Why the fault's step was not replayed: ``hint`` (the front door's words, or the replay's), or
    what is known (``offered``: the step's batches were offered for a replay in this run)."""
    if hint is not None:
        return hint
    if offered:
        return "the sentinel saw it after the step it happened in had passed, so that step was not replayed"
    return "to find it, let layerwatch replay the bad step: Inspector.replay_with(closure) before each step's forward"


def voting_hint(staged: bool, sharded: bool = True) -> str:
    """Why a fault's step is not replayed where the ranks vote (``staged``: they are pipeline
    stages; ``sharded``: their parameters are, else they sample together to add up their MoE
    routers' counts)."""
    ranks = ("a pipelined run's ranks" if staged else "a sharded run's ranks" if sharded else
             "the ranks, which sample together to add up their MoE routers' tokens,")
    return f"{ranks} agree on a finding a step later, after the optimizer step, so the bad step is not replayed"


COMPILED_HINT = ("the model is compiled, and this torch (before 2.6) cannot run it eagerly for the "
                 "probes to see inside, so it is not replayed")


def replayed_nothing_hint(step: int, ran: bool) -> str:
    """Why a fault is not known after its step was replayed (``ran``: to its end) and named nothing."""
    return f"step {step}'s batch, run again, {'made no NaN/Inf' if ran else 'could not be run'}"


def replay_fruitless(step: int, ran: bool, note: str) -> str:
    """The warning of a replay that named no module (``ran``: it ran to its end, else its failure
    was warned about); ``note``: what a replay runs differently from the step, or ""."""
    note = f"; {note}" if note else ""
    what = ("made no NaN/Inf (the fault is outside what the replay runs, or does not happen again" if ran
            else "could not be run again (said above")
    return (f"layerwatch: step {step}'s batch, run again with every probe armed, {what}{note}); "
            "the next step is sampled instead")


def replayed_what(index: int, micro_batches: int, rank: int) -> str:
    """Which batch a replay named its module in: micro-batch ``index`` of ``micro_batches``, on ``rank``."""
    parts = ([f"micro-batch {index + 1} of {micro_batches}"] if micro_batches > 1 else []) + (
        [f"rank {rank}'s batch"] if rank != 0 else [])
    return ", ".join(parts)


# ---------------------------------------------------------------------- the offender, at a sample


def offender_scaler_skip(step: int, offender: Offender) -> str:
    """The log line of an offender the probes saw at a step the optimizer then skipped: no fault."""
    return (f"layerwatch: step {step}: {offender.name} made a non-finite {offender.phase} value and no optimizer "
            "step followed (a GradScaler skip): not a fault")


def after_fault(step: int, offender: Offender, fault_step: int, fault_before: bool, why_unreplayed: str) -> str:
    """What an offender seen at ``step``, after an unreplayed fault at ``fault_step``, is: never "the first offender"."""
    when = "before step" if fault_before else "at step"
    return (f"first module with a non-finite {offender.phase} output at step {step}: {offender.name}. The fault "
            f"happened {when} {fault_step}, between samples; step {step} shows what came after it, which "
            f"need not be where it began ({why_unreplayed})")


def weight_user(step: int, user: Offender, weights: Sequence[str], fault_step: Optional[int], fault_before: bool,
                sentinel: bool, why_unreplayed: str) -> str:
    """What a module that computed with a weight non-finite already at ``step`` is: ``fault_step``,
    the fault the sentinel found (None: none found; ``sentinel``: it is on)."""
    if fault_step is not None:
        when = f"{'before step' if fault_before else 'at step'} {fault_step}, between samples"
        return weights_came_first(step, user, weights, when, why_unreplayed)
    return weights_came_first(step, user, weights, f"before step {step}, where no probe saw it",
                              "the sentinel is off; with sentinel=True it is found at its step"
                              if not sentinel else "the sentinel had not checked those gradients yet")


def weights_came_first(step: int, user: Offender, weights: Sequence[str], when: str, how: str) -> str:
    """What a module that computed with a weight that was non-finite already is: it used the
    fault (which happened ``when``), the optimizer having carried it into the weights; it did
    not make it (``how``: why that module is not known)."""
    names = ", ".join(weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
    return (f"first module to use a non-finite weight at step {step}: {user.name} ({names} held NaN/Inf before "
            f"the step's forward). The fault happened {when}; the optimizer carried it into the weights, so the "
            f"module that made it is not known ({how})")


def first_offender(step: int, offender: Offender) -> str:
    """The alert's text of the module the probes saw make the NaN (at ``step``, or its batch replayed)."""
    return "first offender: " + offender.describe(step)


# ---------------------------------------------------------------------- the sentinel's cadence


def spread_message(rotation: int, lands_later: bool) -> str:
    """The one line that says the overhead budget spread the sentinel's check, and what is lost."""
    waits = (" Nor is its check waited for before the optimizer step any more (there, a device sync a step), so "
             "no bad step is replayed." if lands_later else "")
    return ("layerwatch: the NaN sentinel's check took the host more than its share of the overhead budget, so it now "
            f"checks the gradients in turn, each at least every {rotation} steps: a NaN in one step's gradients outside "
            "that step's share is found when it reaches the weights, a step or more later, and that step is not "
            f"replayed; pass every_n_steps= to keep the check as it was.{waits}")
