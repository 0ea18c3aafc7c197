"""Runtime probes: per-module time, memory, activations and NaN/Inf on one sampled step.

A ``RuntimeProbe`` exists only between the opening and the closing of a sampled step.
It hooks every selected module (containers and leaves alike):

* forward pre/post hooks time each call, count the bytes it returns, reduce its
  outputs (``stats.reduce``, one row per distinct tensor; the histogram of a large
  output from a sample of ``HISTOGRAM_VALUES`` values) and flag NaN/Inf in its
  inputs and outputs;
* tensor hooks, never full backward hooks (an in-place op after a module breaks
  those), mark its backward: a hook on its outputs fires when the gradient with
  respect to them is ready (its backward starts), a multi-grad hook on its inputs
  (or, when no input needs a gradient, its parameters) fires when its backward is
  done;
* ``saved_tensors_hooks`` around each outermost forward count the storages autograd
  keeps for backward, once each, parameters excluded, for every module running.

Hooks only record clock marks and enqueue device work: nothing is read on the host
until :meth:`RuntimeProbe.result`, after the step. Every hook's own duration is one
interval on the same clock, and a module's time is its span minus the intervals of
the hooks nested in it, so the probes' work never counts as the model's. Times come
from ``time.perf_counter_ns`` on the CPU and from CUDA events on a GPU.

The parts, one module each: :mod:`~layerwatch.probes.selection` (which modules, under which
names), :mod:`~layerwatch.probes.runtime` (the hooks),
:mod:`~layerwatch.probes.calls` (what they record), :mod:`~layerwatch.probes.gradients` (its
gradient hooks), :mod:`~layerwatch.probes.assembly` (what they measured, built from the record),
:mod:`~layerwatch.probes.terms` (what the ranks agree on before they combine it),
:mod:`~layerwatch.probes.outputs` (the NaN/Inf evidence and the outputs' values, kept on the
device), :mod:`~layerwatch.probes.saved` (the bytes saved for backward),
:mod:`~layerwatch.probes.clocks` (host clock or CUDA events) and
:mod:`~layerwatch.probes.step` (the hooks of one sampled step, armed and taken).
"""

from layerwatch.probes.result import ModuleTrace, Offender, ProbeResult
from layerwatch.probes.runtime import RuntimeProbe
from layerwatch.probes.selection import ModuleFilter, check_module_filter, probe_name, select_modules
from layerwatch.probes.step import StepProbes

__all__ = [
    "ModuleFilter", "ModuleTrace", "Offender", "ProbeResult", "RuntimeProbe", "StepProbes",
    "check_module_filter", "probe_name", "select_modules",
]
