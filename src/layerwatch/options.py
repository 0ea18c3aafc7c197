"""The one validated options object shared by every front door (``Inspector``,
``InspectCallback``): each option is checked once, with a message that names the bad value."""

from __future__ import annotations

import inspect
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional, Sequence

from layerwatch import vocabulary as V
from layerwatch import stats as S
from layerwatch.alerts import AlertRules
from layerwatch.budget import check_fraction
from layerwatch.probes import ModuleFilter, check_module_filter
from layerwatch.schedule import Schedule, ScheduleLike, as_schedule, every_n_steps as every_n
from layerwatch.spikes import SpikeRule

DEFAULT_OVERHEAD_BUDGET = 0.01  # the schedule when neither every_n_steps nor schedule is given
DEFAULT_STATS = ("norm", "nonfinite")


@dataclass(frozen=True)
class Options:
    """What to measure and when; build it with :func:`validate_options`."""

    schedule: Optional[Schedule]  # None: the overhead budget chooses the steps
    budget: Optional[float]  # the overhead budget, when it is the schedule
    families: tuple[str, ...]
    stats: tuple[str, ...]
    bins: int  # 0: no histograms
    rules: Optional[AlertRules]  # None: no alerts
    modules: Optional[tuple[Any, ...]]  # None: every module
    sentinel: bool
    memory_budget: Optional[int | float]  # bytes (int) or a share of the parameters' bytes (float); None: no limit
    spikes: Optional[SpikeRule] = None  # None: no loss spike detection
    output_head: Optional[str] = None  # the module whose output is the logits; None: Hugging Face's get_output_embeddings()

    @property
    def zeros(self) -> bool:
        return "zero_frac" in self.stats

    @property
    def centered(self) -> bool:
        return "std" in self.stats


def validate_options(
    *,
    every_n_steps: Optional[int] = None,
    schedule: Optional[ScheduleLike] = None,
    overhead_budget: Optional[float] = None,
    families: Collection[str] = V.FAMILIES,
    stats: Sequence[str] = DEFAULT_STATS,
    histograms: bool = True,
    histogram_bins: int = 32,
    alerts: AlertRules | bool = True,
    modules: Optional[ModuleFilter] = None,
    sentinel: bool = True,
    memory_budget: Optional[int | float] = None,
    spikes: SpikeRule | bool = True,
    output_head: Optional[str] = None,
) -> Options:
    """Check every option; raises with a message that names the bad value.

    The keyword arguments and their defaults are those of :class:`~layerwatch.Inspector`.
    """
    given = {name: value for name, value in
             (("every_n_steps", every_n_steps), ("schedule", schedule), ("overhead_budget", overhead_budget))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"pass one of every_n_steps, schedule and overhead_budget, not several (got "
                         f"{', '.join(f'{name}={value!r}' for name, value in given.items())})")
    chosen, budget = None, None
    if schedule is not None:
        chosen = as_schedule(schedule)
    elif every_n_steps is not None:
        chosen = every_n(every_n_steps)
    else:
        budget = check_fraction("overhead_budget", DEFAULT_OVERHEAD_BUDGET if overhead_budget is None else overhead_budget)
    if not isinstance(histograms, bool):
        raise TypeError(f"histograms must be a bool, got {histograms!r}")
    if isinstance(histogram_bins, bool) or not isinstance(histogram_bins, int) or not 2 <= histogram_bins <= S.MAX_BINS:
        raise ValueError(f"histogram_bins must be an int in [2, {S.MAX_BINS}], got {histogram_bins!r}")
    if not isinstance(alerts, (bool, AlertRules)):
        raise TypeError(f"alerts must be True, False or an AlertRules, got {alerts!r}")
    if not isinstance(sentinel, bool):
        raise TypeError(f"sentinel must be a bool, got {sentinel!r}")
    if not isinstance(spikes, (bool, SpikeRule)):
        raise TypeError(f"spikes must be True, False or a SpikeRule, got {spikes!r}")
    if output_head is not None and (not isinstance(output_head, str) or not output_head):
        raise ValueError(f"output_head must name a module (as model.named_modules() names it), got {output_head!r}")
    if memory_budget is not None and not _memory_budget_ok(memory_budget):
        raise ValueError("memory_budget must be an int of bytes >= 0 or a finite float > 0 (a share of the parameters' "
                         f"bytes), got {memory_budget!r}")
    return Options(
        schedule=chosen,
        budget=budget,
        families=_check_choice("families", families, V.FAMILIES),
        stats=_check_choice("stats", stats, V.STATS),
        bins=histogram_bins if histograms else 0,
        rules=AlertRules() if alerts is True else alerts or None,
        modules=check_module_filter(modules),
        sentinel=sentinel,
        memory_budget=memory_budget,
        spikes=SpikeRule() if spikes is True else spikes or None,
        output_head=output_head,
    )


def options_from(arguments: dict[str, Any]) -> Options:
    """:func:`validate_options` of the options among a front door's ``locals()``: the front
    doors keep explicit signatures (help, completion) and pass them on without listing them
    again."""
    return validate_options(**{name: arguments[name] for name in OPTION_NAMES})


def _memory_budget_ok(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, float) and 0 < value < float("inf")


def _check_choice(option: str, values: Collection[str], allowed: Sequence[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise TypeError(f"{option} must be a collection of names, got the string {values!r}")
    chosen = tuple(values)
    for value in chosen:
        if value not in allowed:
            raise ValueError(f"{option}: unknown value {value!r}; choose from {', '.join(allowed)}")
    return chosen


OPTION_NAMES = tuple(inspect.signature(validate_options).parameters)


def writable_dir(log_dir: str | os.PathLike) -> Path:
    """``log_dir``, created if needed; raises ValueError naming it when it cannot be written."""
    if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir).strip():
        raise ValueError(f"log_dir must name a directory, got {log_dir!r}")
    path = Path(log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"log_dir {str(path)!r} is not a writable directory: {e}") from e
    return path
