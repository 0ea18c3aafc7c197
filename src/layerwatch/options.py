"""The one validated options object shared by every front door (``Inspector``,
``InspectCallback``, ``InspectTrainerCallback``): each option is checked once, with a message that
names the bad value. The rules' thresholds live here too (:class:`AlertRules`, :class:`SpikeRule`),
below the rules that read them, and the check of a fraction (:func:`check_fraction`)."""

from __future__ import annotations

import inspect
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping, Optional, Sequence

from layerwatch import vocabulary as V
from layerwatch import stats as S
from layerwatch.probes.routers import RouterSpec, check_routers
from layerwatch.probes.selection import ModuleFilter, check_module_filter
from layerwatch.schedule import Schedule, ScheduleLike, as_schedule, every_n_steps as every_n

Bounds = tuple[Optional[float], Optional[float]]


@dataclass(frozen=True)
class AlertRules:
    """Thresholds of the health rules. The defaults raise no alarm on healthy training of the
    examples, the demo and tiny configurations of BERT, RoBERTa, DistilBERT, ViT, GPT-2, Llama
    and T5, whose per-batch gradient norms swing by up to ~500x between windows of samples:
    gradients get a loose factor, weights a tight one. The window rules judge a layer by the
    RMS of all its values (:class:`~layerwatch.health.rules.layer_windows.LayerWindows`).

    Args:
        window: Samples per window for ``exploding``/``vanishing`` (compares the medians of
            two neighbouring windows).
        weight_factor: A layer's median weight size changing by more than this between windows.
        grad_factor: A layer's median gradient size growing by more than this between windows
            (to a new high), or its share of the largest layer's falling this far below its
            highest earlier share.
        weight_norm_bounds: ``(low, high)`` absolute bounds on any weight norm; None = no bound.
        grad_norm_bounds: The same for gradient norms.
        dead_samples: Samples in a row with all-zero gradients (or weights) before ``dead``.
        stuck_samples: Samples in a row without change (or without a gradient) before ``stuck``.
        sign_like_rms: Adam's normalized update RMS, a layer's median over a window, at or
            above which its updates are sign-like (1: every coordinate moves by the learning
            rate; about 0.2-0.3 where gradients are mostly noise).
        sign_like_factor: ...and at least this many times the lowest median of an earlier
            window: judged against the layer's own past, since a layer whose gradient keeps
            one direction for long (a head's LayerNorm early on) sits high from the start.
        eps_bound_frac: The share of a layer's coordinates (with a gradient) whose ``√v̂`` is
            below ``10ε``, above which, at ``window`` samples in a row, it is ``eps_bound``.
        attention_logit_level: The largest attention logit (``q·k/√d``) at or above which a
            layer alerts (Kimi K2's QK-Clip and Megatron's ``qk_clip_threshold``: 100).
        attention_logit_growth: From a tenth of that level, a layer's window median of its
            largest logit this many times the lowest median of a window before alerts too: a
            small model can diverge before any logit reaches 100.
        entropy_collapse: A layer's lowest head entropy (window median) below this share of the
            highest median of a window before is a collapse.
        logit_drift: Nats the output head's mean log Z (window median) may move from its first
            window's before it alerts: a softmax is blind to a shift of every logit, the loss
            does not see it, and PaLM's z-loss exists to stop it.
        outlier_growth: A module output's ``max|h| / RMS(h)`` (window median) this many times the
            lowest of a window before: outlier features growing. Against the layer's own past:
            massive activations are normal in healthy LLMs (healthy runs of the zoo: at most 2x).
        kurtosis_growth: The same for the kurtosis of an output's per-channel RMS: a few channels
            taking over (healthy runs of the zoo: at most 4.2x, GPT-2's output head learning its
            vocabulary's frequencies).
        router_collapse: A Mixture-of-Experts router's concentration, how far its busiest
            expert's share of the tokens has gone from its fair share ``k/E`` toward every token
            (0 to 1), its median over the last 3 samples, at or above which it collapsed
            (``router_collapse``; healthy tiny runs of six MoE families: at most 0.53)...
        router_collapse_growth: ...when also this many times the lowest median of a window
            before: against the router's own past.
        router_z_growth: Nats a router's mean log Z (window median) may rise above the lowest
            median of a window before (``router_z_growth``; ST-MoE's router z-loss holds it down).
        router_entropy_collapse: A router's mean routing entropy (window median) below this
            share of the highest median of a window before is a collapse
            (``routing_entropy_collapse``). An expert with no token at ``window`` samples in a
            row is ``dead_expert``.
        loss_window: Steps the loss is averaged over (:class:`~layerwatch.health.progress.LossProgress`).
        learned: The share of its first mean the loss must shed before it is judged: before
            then there is no progress to give back.
        loss_rise: The share of its progress (first mean - lowest mean) the loss gives back that
            raises ``loss_rise`` (benchmarks/divergence.py's failure is at 0.5; its healthy twins
            gave back at most 8%, the turn is at 0.1).
        loss_turned: The share of its progress given back from which the growth rules
            (``GROWTH_KINDS``: ``sign_like``, ``attention_logits`` below its level,
            ``entropy_collapse``, ``logit_drift``, ``outlier_growth``, ``router_z_growth``,
            ``routing_entropy_collapse``) judge. While the loss is
            near its lowest the model is learning, and its attention sharpening, its logits
            growing and its updates changing shape are what learning looks like. With no loss
            given to layerwatch they judge at every sample.
    """

    window: int = 5
    weight_factor: float = 10.0
    grad_factor: float = 1e4
    weight_norm_bounds: Bounds = (None, None)
    grad_norm_bounds: Bounds = (None, None)
    dead_samples: int = 3
    stuck_samples: int = 3
    sign_like_rms: float = 0.6
    sign_like_factor: float = 2.0
    eps_bound_frac: float = 0.5
    attention_logit_level: float = 100.0
    attention_logit_growth: float = 3.0
    entropy_collapse: float = 0.25
    logit_drift: float = 10.0
    outlier_growth: float = 4.0
    kurtosis_growth: float = 10.0
    router_collapse: float = 0.8
    router_collapse_growth: float = 1.5
    router_z_growth: float = 5.0
    router_entropy_collapse: float = 0.25
    loss_window: int = 10
    learned: float = 0.2
    loss_rise: float = 0.2
    loss_turned: float = 0.1

    def __post_init__(self) -> None:
        for name in ("window", "dead_samples", "stuck_samples", "loss_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AlertRules.{name} must be an int >= 1, got {value!r}")
        for name in ("sign_like_rms", "eps_bound_frac", "entropy_collapse", "router_collapse", "router_entropy_collapse",
                     "learned", "loss_rise", "loss_turned"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"AlertRules.{name} must be a number in (0, 1], got {value!r}")
        for name in ("weight_factor", "grad_factor", "sign_like_factor", "attention_logit_growth", "outlier_growth",
                     "kurtosis_growth", "router_collapse_growth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
                raise ValueError(f"AlertRules.{name} must be a number > 1, got {value!r}")
        for name in ("attention_logit_level", "logit_drift", "router_z_growth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"AlertRules.{name} must be a finite number > 0, got {value!r}")
        for name in ("weight_norm_bounds", "grad_norm_bounds"):
            value = getattr(self, name)
            if not (isinstance(value, tuple) and len(value) == 2) or any(
                b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0) for b in value
            ):
                raise ValueError(f"AlertRules.{name} must be a (low, high) pair of numbers >= 0 or None, got {value!r}")
            low, high = value
            if low is not None and high is not None and low >= high:
                raise ValueError(f"AlertRules.{name}: low must be below high, got {value!r}")
        if self.loss_turned > self.loss_rise:
            raise ValueError(f"AlertRules.loss_turned must be at most loss_rise ({self.loss_rise!r}), got {self.loss_turned!r}")


@dataclass(frozen=True)
class SpikeRule:
    """When a value is a spike: more than ``z`` standard deviations above the mean of the
    ``window`` values before it, once ``warmup`` values were seen; ``capture``: the steps after
    a spike that are sampled in full."""

    z: float = 6.0
    window: int = 128
    warmup: int = 32
    capture: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.z, bool) or not isinstance(self.z, (int, float)) or not (math.isfinite(self.z) and self.z > 0):
            raise ValueError(f"SpikeRule.z must be a finite number > 0, got {self.z!r}")
        for name, least in (("window", 2), ("warmup", 2), ("capture", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SpikeRule.{name} must be an int >= {least}, got {value!r}")
        if self.warmup > self.window:
            raise ValueError(f"SpikeRule.warmup must be at most the window ({self.window}), got {self.warmup!r}")


def check_fraction(name: str, value: object) -> float:
    """``value`` as a float in (0, 1]; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1] (0.01 is 1% of the training time), got {value!r}")
    return float(value)


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
    moe_routers: Optional[tuple[RouterSpec, ...]] = None  # a custom MoE's routers; transformers' are found without

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
    moe_routers: Optional[Mapping[str, Any]] = None,
) -> Options:
    """Check every option; raises with a message that names the bad value.

    The keyword arguments and their defaults are those of :class:`~layerwatch.Inspector`.
    """
    chosen, budget = _schedule_or_budget(every_n_steps, schedule, overhead_budget)
    _check_switches(histograms, histogram_bins, alerts, sentinel, spikes, output_head, memory_budget)
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
        moe_routers=check_routers(moe_routers),
    )


def _schedule_or_budget(every_n_steps: Optional[int], schedule: Optional[ScheduleLike],
                        overhead_budget: Optional[float]) -> tuple[Optional[Schedule], Optional[float]]:
    """The schedule chosen, or else the overhead budget (the default's when none is given): one of them."""
    given = {name: value for name, value in
             (("every_n_steps", every_n_steps), ("schedule", schedule), ("overhead_budget", overhead_budget))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"pass one of every_n_steps, schedule and overhead_budget, not several (got "
                         f"{', '.join(f'{name}={value!r}' for name, value in given.items())})")
    if schedule is not None:
        return as_schedule(schedule), None
    if every_n_steps is not None:
        return every_n(every_n_steps), None
    return None, check_fraction("overhead_budget", DEFAULT_OVERHEAD_BUDGET if overhead_budget is None else overhead_budget)


def _check_switches(histograms: bool, histogram_bins: int, alerts: AlertRules | bool, sentinel: bool,
                    spikes: SpikeRule | bool, output_head: Optional[str], memory_budget: Optional[int | float]) -> None:
    """Check the options taken as given (the switches, the rules, the bins, the head, the memory budget)."""
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
