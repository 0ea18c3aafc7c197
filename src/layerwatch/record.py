"""What one sampled step produced, and every TensorBoard tag name, built here and only here.

Tag contract (see ``docs/tags.md``): the family comes first so TensorBoard groups cards
by it, then the qualified name as ``model.named_parameters()`` spells it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from layerwatch import stats as S
from layerwatch.probes import PROBE_FAMILIES, ProbeResult
from layerwatch.stats import Histogram
from layerwatch.structure import Summary

TENSOR_FAMILIES = ("weights", "grads")
FAMILIES = TENSOR_FAMILIES + ("updates", "structure") + PROBE_FAMILIES

RUN_WIDE = "layerwatch/"  # the prefix of the run-wide tags below
GRAD_NORM = "layerwatch/grad_norm"
OVERHEAD_MS = "layerwatch/overhead_ms"
STRUCTURE = "layerwatch/structure"
PARAMS_TOTAL = "layerwatch/params_total"
PARAMS_LEARNABLE = "layerwatch/params_learnable"
PARAMS_FROZEN = "layerwatch/params_frozen"
MACS_PER_STEP = "layerwatch/macs_per_step"
ALERTS = "layerwatch/alerts"  # the count (scalar) and the table (text)
OPTIMIZER_SKIPPED = "layerwatch/optimizer_skipped"
NONFINITE_MODULES = "layerwatch/nonfinite_modules"
FIRST_OFFENDER = "layerwatch/first_offender"  # text
FIRST_NONFINITE_STEP = "layerwatch/first_nonfinite_step"

# Per-module scalars of the runtime probes, tagged <field>/<module> after the ModuleTrace field.
MODULE_SCALARS = ("fwd_ms", "bwd_ms", "activation_bytes", "saved_bytes", "cuda_alloc_bytes", "nonfinite")


def stat_prefix(family: str, stat: str) -> str:
    """The prefix of a per-tensor statistic's tags: ``weights_norm/``."""
    return f"{family}_{stat}/"


def module_prefix(field_name: str) -> str:
    """The prefix of a per-module scalar's tags (one of ``MODULE_SCALARS``): ``fwd_ms/``."""
    return f"{field_name}/"


def histogram_tag(family: str, name: str) -> str:
    return f"{family}/{name}"


def stat_tag(family: str, stat: str, name: str) -> str:
    return stat_prefix(family, stat) + name


def update_ratio_tag(name: str) -> str:
    return f"update_ratio/{name}"


@dataclass
class StepRecord:
    """Everything one sampled step writes: plain Python data, no tensors."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    def add_structure(self, summary: Summary) -> None:
        """The layer table as text (a Markdown code block keeps it aligned) and its totals."""
        self.texts[STRUCTURE] = "\n".join("    " + line for line in summary.to_text().splitlines())
        self.scalars[PARAMS_TOTAL] = summary.total_params
        self.scalars[PARAMS_LEARNABLE] = summary.learnable_params
        self.scalars[PARAMS_FROZEN] = summary.frozen_params
        self.scalars[MACS_PER_STEP] = summary.total_macs

    def add_probes(self, result: ProbeResult, stats: Sequence[str], bins: int) -> None:
        """Per-module time, memory, activations and NaN/Inf flags of one step."""
        for trace in result.modules:
            for field_name in MODULE_SCALARS:
                value = getattr(trace, field_name)
                if value is not None:
                    self.scalars[module_prefix(field_name) + trace.name] = float(value)
            if trace.calls > 1:
                self.scalars[f"calls/{trace.name}"] = trace.calls
        measured = [t for t in result.modules if t.activation_row is not None]
        if measured:
            rows = np.stack([t.activation_row for t in measured])
            self.add_tensor_family("activations", [t.name for t in measured], rows, stats, bins)
        flags = [t.nonfinite for t in result.modules if t.nonfinite is not None]
        if flags:
            self.scalars[NONFINITE_MODULES] = sum(flags)

    def add_tensor_family(
        self, family: str, names: Sequence[str], rows: np.ndarray, stats: Sequence[str], bins: int
    ) -> None:
        """Add the histograms (when ``bins``) and per-tensor stats of one family."""
        for stat, values in S.scalar_stats(rows, stats).items():
            for name, value in zip(names, values.tolist()):
                self.scalars[stat_tag(family, stat, name)] = value
        if bins:
            for name, hist in zip(names, S.histograms(rows, bins)):
                if hist is not None:
                    self.histograms[histogram_tag(family, name)] = hist

    def add_grad_norm(self, rows: np.ndarray) -> None:
        """The global gradient norm from the gradients' rows (NaN when any holds a NaN or Inf)."""
        nonfinite = rows[:, S.NONFINITE].sum() > 0
        self.scalars[GRAD_NORM] = float("nan") if nonfinite else float(np.sqrt(rows[:, S.SUMSQ].sum()))

    def add_update_ratios(self, names: Sequence[str], deltas: np.ndarray, norms: np.ndarray) -> None:
        """``update_ratio/<param>``: ‖Δw‖ / ‖w‖, ``w`` the weights after the step; 0 where the step
        did not change them, 1 where it set them to zero (never inf: a weight that was zero
        before the step, as BatchNorm biases and LoRA's B start, has a finite ratio)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(deltas == 0, 0.0, np.where(norms == 0, 1.0, deltas / norms))
        for name, ratio in zip(names, ratios.tolist()):
            self.scalars[update_ratio_tag(name)] = ratio


def owner(param_name: str) -> str:
    """The module that owns a parameter: ``"blocks.0.mlp.weight"`` -> ``"blocks.0.mlp"``."""
    return param_name.rpartition(".")[0]


def custom_scalars_layout(param_names: Sequence[str], stats: Sequence[str]) -> dict:
    """A custom-scalars layout: one chart per layer holding its weight and gradient stats.

    Categories are the model's top-level children; each chart matches the stats of
    the layer's own parameters (weights and biases, weights and grads) by an anchored
    regex, so ``layers.1`` never picks up ``layers.10``.
    """
    stat_group = "|".join(stats)
    layout: dict[str, dict[str, list]] = {}
    for module in dict.fromkeys(owner(n) for n in param_names):
        category = f"layerwatch: {module.split('.')[0] or '(root)'}"
        prefix = re.escape(f"{module}.") if module else ""
        regex = rf"^(weights|grads)_({stat_group})/{prefix}[^.]+$"
        layout.setdefault(category, {})[module or "(root)"] = ["Multiline", [regex]]
    return layout
