"""The one validated options object shared by every front door (``Inspector``,
``InspectCallback``): each option is checked once, with a message that names the bad value."""

from __future__ import annotations

import inspect
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional, Sequence

from layerwatch import record as R
from layerwatch import stats as S
from layerwatch.alerts import AlertRules
from layerwatch.probes import ModuleFilter, check_module_filter
from layerwatch.schedule import Schedule, ScheduleLike, as_schedule, every_n_steps as every_n

DEFAULT_EVERY_N_STEPS = 50
DEFAULT_STATS = ("norm", "nonfinite")


@dataclass(frozen=True)
class Options:
    """What to measure and when; build it with :func:`validate_options`."""

    schedule: Schedule
    families: tuple[str, ...]
    stats: tuple[str, ...]
    bins: int  # 0: no histograms
    rules: Optional[AlertRules]  # None: no alerts
    modules: Optional[tuple[Any, ...]]  # None: every module
    sentinel: bool

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
    families: Collection[str] = R.FAMILIES,
    stats: Sequence[str] = DEFAULT_STATS,
    histograms: bool = True,
    histogram_bins: int = 32,
    alerts: AlertRules | bool = True,
    modules: Optional[ModuleFilter] = None,
    sentinel: bool = True,
) -> Options:
    """Check every option; raises with a message that names the bad value.

    The keyword arguments and their defaults are those of :class:`~layerwatch.Inspector`.
    """
    if every_n_steps is not None and schedule is not None:
        raise ValueError(f"pass every_n_steps or schedule, not both (got {every_n_steps!r} and {schedule!r})")
    if schedule is not None:
        chosen = as_schedule(schedule)
    else:
        chosen = every_n(DEFAULT_EVERY_N_STEPS if every_n_steps is None else every_n_steps)
    if not isinstance(histograms, bool):
        raise TypeError(f"histograms must be a bool, got {histograms!r}")
    if isinstance(histogram_bins, bool) or not isinstance(histogram_bins, int) or not 2 <= histogram_bins <= S.MAX_BINS:
        raise ValueError(f"histogram_bins must be an int in [2, {S.MAX_BINS}], got {histogram_bins!r}")
    if not isinstance(alerts, (bool, AlertRules)):
        raise TypeError(f"alerts must be True, False or an AlertRules, got {alerts!r}")
    if not isinstance(sentinel, bool):
        raise TypeError(f"sentinel must be a bool, got {sentinel!r}")
    return Options(
        schedule=chosen,
        families=_check_choice("families", families, R.FAMILIES),
        stats=_check_choice("stats", stats, S.STATS),
        bins=histogram_bins if histograms else 0,
        rules=AlertRules() if alerts is True else alerts or None,
        modules=check_module_filter(modules),
        sentinel=sentinel,
    )


def options_from(arguments: dict[str, Any]) -> Options:
    """:func:`validate_options` of the options among a front door's ``locals()``: the front
    doors keep explicit signatures (help, completion) and pass them on without listing them
    again."""
    return validate_options(**{name: arguments[name] for name in OPTION_NAMES})


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
