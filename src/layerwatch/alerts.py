"""Health alerts: rules over the sampled records that say what is wrong, once per layer and kind.

``HealthMonitor.observe`` is given each sampled step's per-parameter rows (``stats`` columns,
on the host) and returns the alerts first seen at that step. The rules, with their
thresholds in :class:`AlertRules`:

- ``dead``: every gradient of a layer is exactly zero, or a parameter's weights are all
  zero, for ``dead_samples`` samples in a row.
- ``stuck``: a trainable parameter that has a non-zero gradient but does not change between
  samples, or that gets no gradient at all, for ``stuck_samples`` samples in a row.
- ``exploding`` / ``vanishing``: the median norm of the last ``window`` samples is more
  than ``factor`` times larger / smaller than the median of the ``window`` samples before;
  or a norm is outside its absolute bounds.
- ``nonfinite``: NaN or Inf in a parameter's weights or gradients.

Alerts are named by layer (the module that owns the parameter), so a layer's weight and
bias raise one alert between them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from layerwatch import stats as S
from layerwatch.record import owner

KINDS = ("dead", "stuck", "exploding", "vanishing", "nonfinite")

Bounds = tuple[Optional[float], Optional[float]]


@dataclass(frozen=True)
class Alert:
    """One health problem: what, where, first seen when, in one line a person understands."""

    kind: str
    name: str
    step: int
    message: str

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "name": self.name, "step": self.step, "message": self.message}


@dataclass(frozen=True)
class AlertRules:
    """Thresholds of the health rules. The defaults raise no alarm on healthy training of the
    examples and the demo, whose per-batch gradient norms swing by up to ~500x between
    windows of samples: gradients get a loose factor, weights a tight one.

    Args:
        window: Samples per window for ``exploding``/``vanishing`` (compares the medians of
            two neighbouring windows).
        weight_factor: A weight norm median changing by more than this between windows.
        grad_factor: The same for gradient norms.
        weight_norm_bounds: ``(low, high)`` absolute bounds on any weight norm; None = no bound.
        grad_norm_bounds: The same for gradient norms.
        dead_samples: Samples in a row with all-zero gradients (or weights) before ``dead``.
        stuck_samples: Samples in a row without change (or without a gradient) before ``stuck``.
    """

    window: int = 5
    weight_factor: float = 10.0
    grad_factor: float = 1e4
    weight_norm_bounds: Bounds = (None, None)
    grad_norm_bounds: Bounds = (None, None)
    dead_samples: int = 3
    stuck_samples: int = 3

    def __post_init__(self) -> None:
        for name in ("window", "dead_samples", "stuck_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AlertRules.{name} must be an int >= 1, got {value!r}")
        for name in ("weight_factor", "grad_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
                raise ValueError(f"AlertRules.{name} must be a number > 1, got {value!r}")
        for name in ("weight_norm_bounds", "grad_norm_bounds"):
            value = getattr(self, name)
            if not (isinstance(value, tuple) and len(value) == 2) or any(
                b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0) for b in value
            ):
                raise ValueError(f"AlertRules.{name} must be a (low, high) pair of numbers >= 0 or None, got {value!r}")
            low, high = value
            if low is not None and high is not None and low >= high:
                raise ValueError(f"AlertRules.{name}: low must be below high, got {value!r}")


@dataclass
class _Track:
    """A parameter's recent history."""

    norms: dict[str, deque] = field(default_factory=dict)  # family -> last 2*window norms
    zero_grads: int = 0
    zero_weights: int = 0
    unchanged: int = 0
    no_grad: int = 0
    last_weights: Optional[np.ndarray] = None


_FINGERPRINT = [S.COUNT, S.NONFINITE, S.MIN, S.MAX, S.SUM, S.SUMSQ]  # equal rows: unchanged weights


class HealthMonitor:
    """Applies :class:`AlertRules` to the sampled steps; raises each (kind, layer) once."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self.alerts: list[Alert] = []
        self._raised: set[tuple[str, str]] = set()
        self._tracks: dict[str, _Track] = {}

    def observe(
        self,
        step: int,
        *,
        weights: dict[str, np.ndarray],
        grads: Optional[dict[str, np.ndarray]],
        trainable: Sequence[str],
    ) -> list[Alert]:
        """The alerts first seen at ``step``.

        Args:
            weights: Parameter name -> its weights' stats row (empty when weights are not read).
            grads: Parameter name -> its gradient's stats row, for parameters that have one;
                None when gradients are not read.
            trainable: Names of the parameters with ``requires_grad``.
        """
        new: list[Alert] = []
        self._nonfinite(step, {"gradients": grads or {}, "weights": weights}, new)
        for name, row in weights.items():
            self._norms(step, name, "weights", row, new)
        for name, row in (grads or {}).items():
            self._norms(step, name, "grads", row, new)
        self._dead(step, weights, grads, new)
        self._stuck(step, weights, grads, trainable, new)
        return new

    # ------------------------------------------------------------------ rules

    def _nonfinite(self, step: int, families: dict[str, dict[str, np.ndarray]], new: list[Alert]) -> None:
        found: dict[str, list[str]] = {}  # layer -> what holds NaN/Inf, gradients first
        first_param: dict[str, str] = {}
        for what, rows in families.items():
            for name, row in rows.items():
                if row[S.NONFINITE]:
                    found.setdefault(owner(name), []).append(f"{what} of {name} ({int(row[S.NONFINITE]):,})")
                    first_param.setdefault(owner(name), name)
        for layer, parts in found.items():
            more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
            self._raise(new, "nonfinite", first_param[layer], step, "NaN/Inf values in " + ", ".join(parts[:3]) + more)

    def _norms(self, step: int, name: str, family: str, row: np.ndarray, new: list[Alert]) -> None:
        if row[S.NONFINITE]:
            return  # the nonfinite alert says it
        rules = self.rules
        norm = math.sqrt(row[S.SUMSQ])
        factor, (low, high) = (
            (rules.weight_factor, rules.weight_norm_bounds) if family == "weights" else (rules.grad_factor, rules.grad_norm_bounds)
        )
        label = "weight" if family == "weights" else "gradient"
        if high is not None and norm > high:
            self._raise(new, "exploding", name, step, f"{label} norm of {name} is {norm:.3g}, above the bound {high:g}")
        if low is not None and norm < low:
            self._raise(new, "vanishing", name, step, f"{label} norm of {name} is {norm:.3g}, below the bound {low:g}")
        history = self._track(name).norms.setdefault(family, deque(maxlen=2 * rules.window))
        history.append(norm)
        if len(history) < 2 * rules.window:
            return
        values = list(history)
        before, now = float(np.median(values[: rules.window])), float(np.median(values[rules.window :]))
        span = f"over the last {rules.window} samples"
        if now > factor * before:
            self._raise(new, "exploding", name, step, f"{label} norm of {name} grew {now / before:.3g}x {span} (to {now:.3g})")
        elif now * factor < before:
            ratio = before / now if now > 0 else math.inf
            self._raise(new, "vanishing", name, step, f"{label} norm of {name} shrank {ratio:.3g}x {span} (to {now:.3g})")

    def _dead(
        self, step: int, weights: dict[str, np.ndarray], grads: Optional[dict[str, np.ndarray]], new: list[Alert]
    ) -> None:
        n = self.rules.dead_samples
        for name, row in weights.items():
            track = self._track(name)
            track.zero_weights = track.zero_weights + 1 if all_zero(row) else 0
            if track.zero_weights >= n:
                self._raise(new, "dead", name, step, f"weights of {name} have been all zero for {n} samples")
        if grads is None:
            return
        by_layer: dict[str, list[str]] = {}
        for name in grads:
            by_layer.setdefault(owner(name), []).append(name)
        for layer, names in by_layer.items():
            zero = all(all_zero(grads[name]) for name in names)
            for name in names:
                track = self._track(name)
                track.zero_grads = track.zero_grads + 1 if zero else 0
            if zero and min(self._track(name).zero_grads for name in names) >= n:
                self._raise(
                    new, "dead", names[0], step,
                    f"every gradient of layer {layer or '(root)'} has been zero for {n} samples: nothing "
                    "reaches it (a ReLU that never fires, or a detached path)",
                )

    def _stuck(
        self,
        step: int,
        weights: dict[str, np.ndarray],
        grads: Optional[dict[str, np.ndarray]],
        trainable: Sequence[str],
        new: list[Alert],
    ) -> None:
        n = self.rules.stuck_samples
        any_grad = bool(grads)
        for name in trainable:
            track = self._track(name)
            if grads is not None and any_grad:  # with no gradient anywhere the loop, not the model, is wrong
                track.no_grad = 0 if name in grads else track.no_grad + 1
                if track.no_grad >= n:
                    self._raise(new, "stuck", name, step, f"{name} is trainable but has had no gradient for {n} samples")
            row = weights.get(name)
            if row is None:
                continue
            fingerprint = row[_FINGERPRINT]
            grad = None if grads is None else grads.get(name)
            moving_grad = grad is not None and not all_zero(grad) and not grad[S.NONFINITE] and not row[S.NONFINITE]
            if track.last_weights is not None and np.array_equal(fingerprint, track.last_weights) and moving_grad:
                track.unchanged += 1
            else:
                track.unchanged = 0
            track.last_weights = fingerprint
            if track.unchanged >= n:
                self._raise(
                    new, "stuck", name, step,
                    f"{name} has a gradient but has not changed for {n} samples: is it in the optimizer, "
                    "with a learning rate above 0?",
                )

    # ------------------------------------------------------------------ helpers

    def _track(self, name: str) -> _Track:
        track = self._tracks.get(name)
        if track is None:
            track = self._tracks[name] = _Track()
        return track

    def _raise(self, new: list[Alert], kind: str, param: str, step: int, message: str) -> None:
        layer = owner(param) or param
        if (kind, layer) in self._raised:
            return
        self._raised.add((kind, layer))
        alert = Alert(kind, layer, step, message)
        self.alerts.append(alert)
        new.append(alert)


def all_zero(row: np.ndarray) -> bool:
    """The stats row is of a tensor whose values are all exactly zero."""
    return bool(row[S.COUNT] > 0 and row[S.NONFINITE] == 0 and row[S.MIN] == 0 and row[S.MAX] == 0)


def alerts_markdown(alerts: Iterable[Alert]) -> str:
    """A Markdown table, as TensorBoard's Text tab shows it and ``layerwatch report`` reads it back."""
    lines = ["| kind | name | step | message |", "|---|---|---|---|"]
    lines += [f"| {a.kind} | {_cell(a.name)} | {a.step} | {_cell(a.message)} |" for a in alerts]
    return "\n".join(lines)


def parse_alerts_markdown(text: str) -> list[Alert]:
    """The alerts of a table written by :func:`alerts_markdown`."""
    alerts = []
    for line in text.splitlines()[2:]:
        cells = [c.strip().replace("\\|", "|") for c in _split_cells(line)]
        if len(cells) == 4 and cells[2].isdigit():
            alerts.append(Alert(cells[0], cells[1], int(cells[2]), cells[3]))
    return alerts


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _split_cells(line: str) -> list[str]:
    """Cells of ``| a | b |``, honouring ``\\|`` inside a cell."""
    cells, current, i = [], "", 0
    body = line.strip()
    if not (body.startswith("|") and body.endswith("|")):
        return []
    body = body[1:-1]
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body) and body[i + 1] == "|":
            current += "\\|"
            i += 2
            continue
        if body[i] == "|":
            cells.append(current)
            current = ""
        else:
            current += body[i]
        i += 1
    cells.append(current)
    return cells
