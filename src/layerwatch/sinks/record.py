"""What one sampled step produced: :func:`build` makes its :class:`StepRecord`, the only place
one is made; how its scalar tags split into TensorBoard cards and the LAYERWATCH tab's series;
the Custom Scalars layout. The tag names are :mod:`layerwatch.vocabulary`'s.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from layerwatch import stats as S
from layerwatch.measure.params import update_ratios
from layerwatch.measure.optimizer_state import spike_fractions, update_stats
from layerwatch.health.findings import Findings
from layerwatch.probes.result import Offender, ProbeResult, RouterLoad
from layerwatch.stats import Histogram
from layerwatch.table.summary import Summary
from layerwatch.vocabulary import (
    ACTIVATION_KURTOSIS, ACTIVATION_OUTLIER, ADAM_SPIKE_FRAC, ALERTS, ATTENTION_ENTROPY, ATTENTION_HEAD_ENTROPY, ATTENTION_HEAD_LOGIT_MAX, ATTENTION_LOGIT_MAX, LOGSUMEXP_MAX, LOGSUMEXP_MEAN,
    TAB_ONLY_SERIES, FIRST_NONFINITE_STEP, FIRST_OFFENDER, GRAD_NORM, MACS_PER_STEP, MODULE_SCALARS,
    NONFINITE_MODULES, NONFINITE_SERIES, OPTIMIZER_SKIPPED, OVERHEAD_MS, PARAMS_FROZEN, PARAMS_LEARNABLE, PARAMS_TOTAL,
    ROOT, RUN_WIDE, SAMPLE_INTERVAL, STRUCTURE, TENSOR_FAMILIES, head_name, histogram_tag, module_prefix, nonfinite_total_tag,
    stat_prefix, update_ratio_tag,
)
from layerwatch.vocabulary import (
    MOE_BIAS, MOE_DEAD, MOE_DROPPED, MOE_ENTROPY, MOE_IMBALANCE, MOE_MARGIN, MOE_ROUTER_Z, MOE_ROUTER_Z_MAX, MOE_TOKENS,
    Family, expert_names, is_expert_param_row,
)

@dataclass
class StepRecord:
    """Everything one sampled step writes: plain Python data, no tensors. Made by :func:`build`."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    alerts: list = field(default_factory=list)  # the alerts.Alert raised at this step
    offender: Optional[Offender] = None  # the first offender, at the step it was found
    spikes: list = field(default_factory=list)  # the loss spikes found since the last sample (events/spikes)
    history: dict = field(default_factory=dict)  # tag -> [(step, value)] of steps before this one, written before it
    rerun: bool = False  # the per-module values are of a compiled model's eager re-run (engine/rerun.py)


def build(
    step: int,
    rows: Optional[S.HostRows] = None,
    probes: Optional[ProbeResult] = None,
    structure: Optional[Summary] = None,
    findings: Optional[Findings] = None,
    *,
    stats: Sequence[str] = (),
    bins: int = 0,
    overhead_ms: Optional[float] = None,
    sample_interval: Optional[int] = None,
    first_nonfinite_step: Optional[int] = None,
    all_grads: bool = True,
) -> StepRecord:
    """The record of one step, the only place one is made: the tensor families' statistics and histograms from their
    host ``rows`` (``weights``, ``grads``, ``update``, ``update_estimate``; the experts' slices' ``expert_*``), the
    global gradient norm, the update ratios, the layer table, the probes' per-module values, Adam's state (``adam``,
    ``adam_spikes``), the ``findings``, the engine's own figures. A record of the sentinel's first hit alone holds
    ``first_nonfinite_step``. ``all_grads`` False: the rows lack some gradients (a pipeline stage's), no gradient norm."""
    rec = StepRecord(step, rerun=probes is not None and probes.rerun)
    rows = rows or {}
    for family in TENSOR_FAMILIES:
        for names, family_rows in rows.get(family, ()):
            _add_tensor_family(rec, family, names, family_rows, stats, bins)
    if rows.get(S.GRAD_ROWS) and all_grads:
        rec.scalars[GRAD_NORM] = S.Rows(np.concatenate([r for _, r in rows[S.GRAD_ROWS]])).total_norm()
    weight_norms = {} if not rows.get(S.UPDATE_ROWS) else {  # the weights' own norms, for the exact ratios
        name: norm for names, r in rows.get(S.WEIGHT_ROWS, ()) for name, norm in zip(names, S.Rows(r).norm)
    }
    if S.EXPERT_WEIGHT_ROWS in rows or S.EXPERT_GRAD_ROWS in rows:
        weight_norms.update(_add_expert_norms(rec, rows, stats))
    for family, estimated in ((S.UPDATE_ROWS, False), (S.ESTIMATED_UPDATE_ROWS, True), (S.EXPERT_UPDATE_ROWS, False)):
        for names, (deltas, after_norms) in rows.get(family, ()):
            ratios = update_ratios(names, deltas, after_norms, {} if estimated else weight_norms)
            prefix = update_ratio_tag("", estimated)
            rec.scalars.update(zip([prefix + name for name in names], ratios.tolist()))
    _add_optimizer_state(rec, rows)
    if structure is not None:
        _add_structure(rec, structure)
    if probes is not None:
        _add_probes(rec, probes, stats, bins)
    if findings is not None:
        if findings.offender is not None:
            rec.texts[FIRST_OFFENDER] = findings.offender.describe(step)
            rec.offender = findings.offender
        if findings.optimizer_skipped:
            rec.scalars[OPTIMIZER_SKIPPED] = 1.0
        if findings.alert_count is not None:
            rec.scalars[ALERTS] = findings.alert_count
        if findings.alert_table is not None:
            rec.texts[ALERTS] = findings.alert_table
        rec.alerts = list(findings.alerts)
        rec.spikes, rec.history = list(findings.spikes), dict(findings.history)
    if overhead_ms is not None:
        rec.scalars[OVERHEAD_MS] = overhead_ms
    if sample_interval is not None:
        rec.scalars[SAMPLE_INTERVAL] = sample_interval
    if first_nonfinite_step is not None:
        rec.scalars[FIRST_NONFINITE_STEP] = first_nonfinite_step
    return rec


def _add_expert_norms(rec: StepRecord, rows: S.HostRows, stats: Sequence[str]) -> dict[str, float]:
    """The norms of the fused expert parameters' slices, ``weights_norm/<param>[e]`` and
    ``grads_norm/<param>[e]`` (when ``norm`` is among the ``stats``): no other statistic, no
    histogram. Returns the slices' weight norms, for their update ratios."""
    for family, expert_family in ((S.WEIGHT_ROWS, S.EXPERT_WEIGHT_ROWS), (S.GRAD_ROWS, S.EXPERT_GRAD_ROWS)):
        prefix = stat_prefix(family, "norm")
        for names, slice_norms in rows.get(expert_family, ()) if "norm" in stats else ():
            rec.scalars.update(zip([prefix + name for name in names], slice_norms[0].tolist()))
    return {name: norm for names, slice_norms in rows.get(S.EXPERT_WEIGHT_ROWS, ()) for name, norm in zip(names, slice_norms[0])}


def _add_optimizer_state(rec: StepRecord, rows: S.HostRows) -> None:
    """Adam's state per parameter (:mod:`~layerwatch.measure.optimizer_state`): its series, less the NaN
    of a tensor where nothing could be judged."""
    for names, family_rows in rows.get(S.ADAM_ROWS, ()):
        for key, values in update_stats(family_rows).items():
            rec.scalars.update([(f"{key}/{name}", value) for name, value in zip(names, values.tolist()) if value == value])
    for names, family_rows in rows.get(S.ADAM_SPIKE_ROWS, ()):
        values = spike_fractions(family_rows).tolist()
        rec.scalars.update([(f"{ADAM_SPIKE_FRAC}/{name}", value) for name, value in zip(names, values) if value == value])


def _add_structure(rec: StepRecord, summary: Summary) -> None:
    """The layer table as text (a Markdown code block keeps it aligned) and its totals."""
    rec.texts[STRUCTURE] = "\n".join("    " + line for line in summary.to_text().splitlines())
    rec.scalars[PARAMS_TOTAL] = summary.total_params
    rec.scalars[PARAMS_LEARNABLE] = summary.learnable_params
    rec.scalars[PARAMS_FROZEN] = summary.frozen_params
    rec.scalars[MACS_PER_STEP] = summary.total_macs


def _add_probes(rec: StepRecord, result: ProbeResult, stats: Sequence[str], bins: int) -> None:
    """Per-module time, memory, activations and NaN/Inf flags of one step."""
    prefixes = [(field_name, module_prefix(field_name)) for field_name in MODULE_SCALARS]
    for trace in result.modules:
        for field_name, prefix in prefixes:
            value = getattr(trace, field_name)
            if value is not None:
                rec.scalars[prefix + trace.name] = float(value)
        if trace.calls > 1:
            rec.scalars[f"calls/{trace.name}"] = trace.calls
    measured = [t for t in result.modules if t.activation_row is not None]
    if measured:
        rows = np.stack([t.activation_row for t in measured])
        _add_tensor_family(rec, "activations", [t.name for t in measured], rows, stats, bins)
        ratios = S.Rows(rows).peak_to_rms.tolist()
        rec.scalars.update([(f"{ACTIVATION_OUTLIER}/{t.name}", r) for t, r in zip(measured, ratios) if r == r])
    for name, heads in result.attention.items():
        _add_attention(rec, name, heads)
    rec.scalars.update([(f"{ACTIVATION_KURTOSIS}/{name}", value) for name, value in result.kurtosis.items()])
    for name, load in result.routers.items():
        _add_router(rec, name, load)
    if result.logits is not None:
        head, (mean, largest) = result.logits
        rec.scalars[f"{LOGSUMEXP_MEAN}/{head}"], rec.scalars[f"{LOGSUMEXP_MAX}/{head}"] = float(mean), float(largest)
    flags = [t.nonfinite for t in result.modules if t.nonfinite is not None]
    if flags:
        rec.scalars[NONFINITE_MODULES] = sum(flags)


def _add_attention(rec: StepRecord, name: str, heads: np.ndarray) -> None:
    """An attention module's ``[heads, 2]`` (largest logit, mean entropy): folded (the largest
    logit of any head, the lowest entropy of any head) and each head's."""
    logits, entropies = heads[:, 0], heads[:, 1]
    rec.scalars[f"{ATTENTION_LOGIT_MAX}/{name}"] = float(logits.max())
    if np.isfinite(entropies).any():
        rec.scalars[f"{ATTENTION_ENTROPY}/{name}"] = float(np.nanmin(entropies))
    for h, (logit, entropy) in enumerate(heads.tolist()):
        rec.scalars[f"{ATTENTION_HEAD_LOGIT_MAX}/{head_name(name, h)}"] = logit
        rec.scalars[f"{ATTENTION_HEAD_ENTROPY}/{head_name(name, h)}"] = entropy


def _add_router(rec: StepRecord, name: str, load: RouterLoad) -> None:
    """A router's step: each expert's tokens (and bias) as a row of its own, the rest per router."""
    rows = expert_names(name, load.tokens.shape[0])
    rec.scalars.update([(f"{MOE_TOKENS}/{row}", float(n)) for row, n in zip(rows, load.tokens.tolist())])
    if load.bias is not None:
        rec.scalars.update([(f"{MOE_BIAS}/{row}", b) for row, b in zip(rows, load.bias.tolist())])
    imbalance = load.imbalance
    if imbalance == imbalance:
        rec.scalars[f"{MOE_IMBALANCE}/{name}"] = imbalance
    rec.scalars[f"{MOE_DEAD}/{name}"] = float(load.dead)
    for series, value in ((MOE_ENTROPY, load.entropy), (MOE_MARGIN, load.margin), (MOE_ROUTER_Z, load.z_mean),
                          (MOE_ROUTER_Z_MAX, load.z_max), (MOE_DROPPED, load.dropped)):
        if value is not None:
            rec.scalars[f"{series}/{name}"] = float(value)


def _add_tensor_family(rec: StepRecord, family: str, names: Sequence[str], rows: np.ndarray, stats: Sequence[str], bins: int) -> None:
    """The histograms (when ``bins``) and per-tensor stats of one family."""
    for stat, values in S.scalar_stats(rows, stats).items():
        prefix = stat_prefix(family, stat)
        rec.scalars.update(zip([prefix + name for name in names], values.tolist()))
        if stat == "nonfinite":  # a family may come in several pieces (optimizers, devices)
            total = nonfinite_total_tag(family)
            rec.scalars[total] = rec.scalars.get(total, 0.0) + float(values.sum())
    if bins:
        prefix = histogram_tag(family, "")
        hists = S.histograms(rows, bins)
        rec.histograms.update([(prefix + name, hist) for name, hist in zip(names, hists) if hist is not None])


class ScalarTags:
    """How a step's scalar tags split, worked out once per set of tags (the same tags come back
    at every sampled step; see :func:`scalar_tags`): the per-layer series, for the LAYERWATCH
    tab, and which tags can be TensorBoard cards."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self.tags = tags
        series: dict[str, tuple[list[str], list[int]]] = {}
        cards, quiet, quiet_layers = [], [], []
        for i, tag in enumerate(tags):
            head, _, name = tag.partition("/")
            if name and not tag.startswith(RUN_WIDE) and head != "calls":  # calls/ is written only above 1
                names, indices = series.setdefault(head, ([], []))
                names.append(name)
                indices.append(i)
            if head in NONFINITE_SERIES:
                quiet.append(i)
                quiet_layers.append(name)
            elif head not in TAB_ONLY_SERIES and not is_expert_param_row(name):
                cards.append(i)
        self.series = {key: (names, np.asarray(indices, dtype=np.intp)) for key, (names, indices) in series.items()}
        self.cards = np.asarray(cards, dtype=np.intp)
        self.quiet = np.asarray(quiet, dtype=np.intp)
        self.quiet_layers = quiet_layers


@functools.lru_cache(maxsize=8)
def scalar_tags(tags: tuple[str, ...]) -> ScalarTags:
    return ScalarTags(tags)


def scalar_values(scalars: dict[str, float]) -> tuple[ScalarTags, np.ndarray]:
    """The split of ``scalars``' tags, and their values in the same order (float64)."""
    return scalar_tags(tuple(scalars)), np.fromiter(scalars.values(), dtype=np.float64, count=len(scalars))


class CardFilter:
    """Which of a step's scalars become TensorBoard cards (every one still reaches the
    LAYERWATCH tab's data).

    A 12-layer transformer writes ~1,900 cards at the defaults, and most of them would say
    nothing: the per-layer NaN/Inf counts, zero in a healthy run, and the byte series,
    constant for fixed shapes. So a layer's NaN/Inf scalars become cards from the first
    sample where any of them is non-zero (and stay), beside the run-wide counts written at
    every sample; the byte series stay in the tab (and the layer table's output bytes), and so
    do Adam's three series a tensor (the tab and ``layerwatch.load`` read them), and the rows ``<param>[e]`` of
    fused expert parameters (a model's experts times their parameters, in three series).
    """

    def __init__(self) -> None:
        self._nonfinite_layers: set[str] = set()

    def __call__(self, scalars: dict[str, float]) -> dict[str, float]:
        split, values = scalar_values(scalars)
        quiet_values = values[split.quiet]
        self._nonfinite_layers.update(split.quiet_layers[i] for i in np.flatnonzero(quiet_values != 0))
        chosen = split.cards
        if self._nonfinite_layers:
            shown = [i for i, layer in zip(split.quiet, split.quiet_layers) if layer in self._nonfinite_layers]
            chosen = np.concatenate([chosen, np.asarray(shown, dtype=np.intp)])
        tags = split.tags
        return dict(zip([tags[i] for i in chosen.tolist()], values[chosen].tolist()))


CHART_SERIES = 12  # a Custom Scalars chart holds at most about this many lines


def custom_scalars_layout(
    param_names: Sequence[str], module_names: Sequence[str], families: Sequence[str], stats: Sequence[str]
) -> dict:
    """A Custom Scalars layout that compares layers, one unit per chart.

    One category per per-layer series (``layerwatch: grads_norm``, ``layerwatch: fwd_ms``, ...),
    and in it one chart per block of the model: a name prefix holding at most
    ``CHART_SERIES`` layers (a larger block is split by its children). Each chart matches its
    tags with an anchored regex, so ``layers.1`` never picks up ``layers.10``. NaN/Inf counts
    and bytes are left out: they are not cards (:class:`CardFilter`).
    """
    series: list[tuple[str, Sequence[str]]] = []
    for family in TENSOR_FAMILIES:
        if family in families:
            series += [(stat_prefix(family, stat), param_names) for stat in stats if stat != "nonfinite"]
    if Family.UPDATES in families:
        series.append((update_ratio_tag(""), param_names))
    if Family.LATENCY in families:
        series += [(module_prefix("fwd_ms"), module_names), (module_prefix("bwd_ms"), module_names)]
    layout: dict[str, dict[str, list]] = {}
    for prefix, names in series:
        charts = layout.setdefault(f"layerwatch: {prefix[:-1]}", {})
        for block, exact in chart_blocks(names):
            end = "$" if exact else (r"(\.|$)" if block else "")
            charts[block or ROOT] = ["Multiline", [f"^{re.escape(prefix + block)}{end}"]]
    return {category: charts for category, charts in layout.items() if charts}


def chart_blocks(names: Sequence[str], prefix: str = "") -> list[tuple[str, bool]]:
    """``(prefix, exact)`` pairs, in model order, that split ``names`` into groups of at most
    ``CHART_SERIES``: a group is the names under ``prefix``, or ``prefix`` alone when ``exact``
    (a block's own name, split off from its children)."""
    if len(names) <= CHART_SERIES:
        return [(prefix, False)] if names else []
    children: dict[str, list[str]] = {}
    for name in names:
        head = name if name == prefix else (name[len(prefix) + 1 :] if prefix else name).split(".", 1)[0]
        children.setdefault(name if name == prefix else (f"{prefix}.{head}" if prefix else head), []).append(name)
    if list(children) == [prefix]:
        return [(prefix, False)]
    return [
        block for child, group in children.items()
        for block in ([(child, True)] if child == prefix else chart_blocks(group, child))
    ]
