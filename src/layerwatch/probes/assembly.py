"""A sampled step's :class:`~layerwatch.probes.result.ProbeResult`, built whole on the host
from what the runtime probe's hooks logged (:class:`~layerwatch.probes.calls.CallLog`) and
what one transfer brought back: each module's trace (calls, times less the hooks nested in
them, bytes, NaN/Inf flag, stats row), the first offender, and the transformer probes'
signals."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from layerwatch import stats as S
from layerwatch.probes.calls import CallLog, Measures
from layerwatch.probes.result import ModuleTrace, Offender, ProbeResult, Signals
from layerwatch.probes.weights import NonfiniteWeights


def assemble(log: CallLog, names: Sequence[str], measures: Measures, *, saved_bytes: Sequence[int], marks: Any,
             rows_host: Any, nonfinite: Sequence[bool], run: Callable[[int], list[int]], used: NonfiniteWeights,
             transformer: Optional[Signals] = None) -> ProbeResult:
    """The result: ``marks`` are the hooks' entry and exit marks resolved, interleaved;
    ``rows_host`` the stats rows, ``nonfinite`` each flag entry on the host, ``run`` a run of
    entries (:meth:`~layerwatch.probes.evidence.Evidence.run`), ``used`` the non-finite
    weights the step began with."""
    traces = _traces(log, names, measures, saved_bytes)
    if measures.latency:
        _add_times(traces, log, marks[0::2], marks[1::2])
    failed = S.Rows(rows_host).failed
    for index, row in log.row_of.items():
        if not failed[row]:
            traces[index].activation_row = rows_host[row]
    offender = user = None
    if measures.nonfinite:
        offender, user = _offenders(traces, log, nonfinite, run, used)
    signals = transformer or Signals()
    return ProbeResult([t for t in traces if t.calls], offender, user, used.names, attention=signals.attention,
                       logits=signals.logits, kurtosis=signals.kurtosis, routers=signals.routers,
                       rerun=measures.forward_only)


def _traces(log: CallLog, names: Sequence[str], measures: Measures, saved_bytes: Sequence[int]) -> list[ModuleTrace]:
    traces = [ModuleTrace(name) for name in names]
    for index, trace in enumerate(traces):
        trace.calls = log.calls[index]
        if measures.memory:
            trace.activation_bytes = log.activation_bytes[index]
            if not measures.forward_only:
                trace.saved_bytes = saved_bytes[index]
                trace.cuda_alloc_bytes = log.cuda_alloc_bytes[index] if measures.cuda else None
        if measures.nonfinite:
            trace.nonfinite = False
    return traces


def _add_times(traces: list[ModuleTrace], log: CallLog, entered: Any, left: Any) -> None:
    """Each span's time less the hooks inside it: ``nested[k]``, the time spent in hooks 0..k-1."""
    nested = np.concatenate([[0.0], np.cumsum(left - entered)])
    for spans, attribute in ((log.fwd_spans, "fwd_ms"), (log.bwd_spans, "bwd_ms")):
        for index, start, end in zip(spans[0::3], spans[1::3], spans[2::3]):
            trace = traces[index]
            ms = max(entered[end] - left[start] - (nested[end] - nested[start + 1]), 0.0)
            setattr(trace, attribute, (getattr(trace, attribute) or 0.0) + ms)


def _offenders(traces: list[ModuleTrace], log: CallLog, nonfinite: Sequence[bool], run: Callable[[int], list[int]],
               used: NonfiniteWeights) -> tuple[Optional[Offender], Optional[Offender]]:
    """Flag each module whose outputs were non-finite; the first that made them from finite
    inputs (the offender), and the first such that computed with a non-finite weight."""
    offender = user = None
    for events, phase in ((log.fwd_events, "forward"), (log.bwd_events, "backward")):
        for index, inputs, outputs in zip(events[0::3], events[1::3], events[2::3]):
            bad_out = any([nonfinite[f] for f in run(outputs)])
            trace = traces[index]
            trace.nonfinite = trace.nonfinite or bad_out
            if offender is None and bad_out and not any([nonfinite[f] for f in run(inputs)]):
                if trace.name not in used.modules:
                    offender = Offender(trace.name, phase)
                elif user is None:
                    user = Offender(trace.name, phase)
    return offender, user
