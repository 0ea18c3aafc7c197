"""The packed row format and its readers.

A reduction (:mod:`~layerwatch.stats.batched`, :mod:`~layerwatch.stats.sharded`) gives one
packed float64 row per tensor, laid out by the column constants below. Statistics are over
the *finite* values; the count of NaN/Inf values is a column of its own, so a NaN never
poisons a histogram or a mean. Histogram bins sit on a grid of width ``scale`` around
``anchor`` (see :mod:`~layerwatch.stats.batched`). :class:`Rows` is the one reader of the
columns by name; :func:`histograms` and :func:`scalar_stats` turn rows into what is logged
(:mod:`~layerwatch.stats.host` brings them to the host).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

# Columns of a packed row.
HostRows = dict[str, list[tuple[list[str], np.ndarray]]]  # family -> its pieces' names and rows, on the host
# The families of HostRows: a tensor's stats rows (the weights', the gradients': vocabulary.Family's names), two rows
# of an update snapshot (the difference norms, the norms after; exact or from strided samples), Adam's state.
WEIGHT_ROWS, GRAD_ROWS = "weights", "grads"
UPDATE_ROWS, ESTIMATED_UPDATE_ROWS = "update", "update_estimate"
ADAM_ROWS, ADAM_SPIKE_ROWS = "adam", "adam_spikes"
# The rows of fused expert parameters' slices <param>[e] (measure/experts.py): one row of columns, their norms (weights,
# gradients); two rows of columns, [‖Δw‖, ‖w‖], of an exact update snapshot.
EXPERT_WEIGHT_ROWS, EXPERT_GRAD_ROWS, EXPERT_UPDATE_ROWS = "expert_weights", "expert_grads", "expert_update"

COUNT = 0  # finite values
NONFINITE = 1  # NaN or Inf values
MIN = 2
MAX = 3
SUM = 4
SUMSQ = 5
ZEROS = 6  # NaN unless zeros were asked for
CENTERED_SUMSQ = 7  # sum of (x - mean)^2; NaN unless asked for
SCALE = 8
ANCHOR = 9
ZERO_POINT = 10
HIST = 11  # then bins + 2 bucket counts: spill-low, 1..bins, spill-high

# Values a histogram reads at most: 32 buckets estimated from 16,384 values are within a few
# per cent of the exact counts, and counting every value of a large model cost more than the
# rest of a sampled step on the 400-tensor benchmark.
HISTOGRAM_VALUES = 1 << 14
MAX_BINS = 254  # the largest histogram_bins (the option's documented range)


def row_width(bins: int) -> int:
    return HIST + (bins + 2 if bins else 0)


class Histogram(NamedTuple):
    """A histogram as TensorBoard's ``HistogramProto`` holds it.

    ``bucket_limits[i]`` is the right edge of bucket ``i``; the left edge of the first
    bucket is ``min`` and the last limit equals ``max``. The buckets are sequences of floats
    (NumPy arrays when made by :func:`histograms`: a tuple of plain values and arrays is
    left alone by Python's garbage collector, so a thousand of them cost it nothing).
    """

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: Sequence[float]
    bucket_counts: Sequence[float]


class Rows:
    """Host rows, one tensor a row, read by name: with the reductions above, the one place that
    knows the packed columns. ``Rows(array)`` takes an ``(n, width)`` array (or a 1-D row);
    indexing with a mask, a slice or indices gives ``Rows`` again."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        array = np.asarray(array, dtype=np.float64)
        self.array = array.reshape(1, -1) if array.ndim == 1 else array

    @classmethod
    def stack(cls, rows: Sequence[np.ndarray]) -> "Rows":
        """Single rows (1-D) as one ``Rows``; none: an empty one."""
        return cls(np.stack(rows) if len(rows) else np.zeros((0, HIST)))

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: Any) -> "Rows":
        return Rows(self.array[index])

    @property
    def count(self) -> np.ndarray:
        """Finite values."""
        return self.array[:, COUNT]

    @property
    def nonfinite(self) -> np.ndarray:
        """NaN and Inf values."""
        return self.array[:, NONFINITE]

    @property
    def min(self) -> np.ndarray:
        return self.array[:, MIN]

    @property
    def max(self) -> np.ndarray:
        return self.array[:, MAX]

    @property
    def sum(self) -> np.ndarray:
        return self.array[:, SUM]

    @property
    def sumsq(self) -> np.ndarray:
        """The sum of the squared finite values."""
        return self.array[:, SUMSQ]

    @property
    def norm(self) -> np.ndarray:
        """Each tensor's L2 norm (of its finite values)."""
        return np.sqrt(self.array[:, SUMSQ])

    @property
    def peak_to_rms(self) -> np.ndarray:
        """``max|x| / RMS(x)`` of each tensor's finite values: 1 for a constant magnitude, about
        4 for 10,000 Gaussian values, hundreds where a few values dwarf the rest (outlier features,
        massive activations); NaN without a finite nonzero value."""
        a = self.array
        with np.errstate(divide="ignore", invalid="ignore"):
            rms = np.sqrt(a[:, SUMSQ] / a[:, COUNT])
            return np.where(rms > 0, np.maximum(np.abs(a[:, MIN]), np.abs(a[:, MAX])) / rms, np.nan)

    def total_norm(self) -> float:
        """The L2 norm of every tensor together, as one vector; NaN when any holds a NaN or Inf."""
        return float("nan") if self.nonfinite.sum() > 0 else float(np.sqrt(self.sumsq.sum()))

    @property
    def finite(self) -> np.ndarray:
        """The tensors with no NaN or Inf."""
        return self.array[:, NONFINITE] == 0

    @property
    def failed(self) -> np.ndarray:
        """The rows a rank could not help measure (:func:`combine_shards`): no statistic of theirs holds."""
        return np.isnan(self.array[:, COUNT])

    @property
    def all_zero(self) -> np.ndarray:
        """The tensors whose values are all exactly zero."""
        a = self.array
        return (a[:, COUNT] > 0) & (a[:, NONFINITE] == 0) & (a[:, MIN] == 0) & (a[:, MAX] == 0)

    @property
    def fingerprint(self) -> np.ndarray:
        """The columns that are equal in two rows of a tensor that did not change."""
        return self.array[:, _FINGERPRINT]


_FINGERPRINT = [COUNT, NONFINITE, MIN, MAX, SUM, SUMSQ]
FINGERPRINT_WIDTH = len(_FINGERPRINT)


def exact_row(row: np.ndarray, stats: Sequence[float], n: int, zeros: bool, centered: bool) -> None:
    """Write into ``row`` (a host row whose histogram counts a sample of a tensor's values) the
    exact statistics read elsewhere: ``stats`` = finite count, min, max, sum, norm, then the
    count of non-zero values (when ``zeros``) and the centered variance (when ``centered``), of
    ``n`` values in all. The histogram's counts are scaled to stand for every finite value."""
    finite = stats[0]
    row[HIST:] *= finite / max(row[COUNT], 1.0)
    row[COUNT], row[NONFINITE] = finite, n - finite
    row[[MIN, MAX, SUM]] = stats[1:4]
    row[SUMSQ] = stats[4] ** 2
    extra = list(stats[5:])
    row[ZEROS] = finite - extra.pop(0) if zeros else np.nan
    row[CENTERED_SUMSQ] = extra.pop(0) * finite if centered else np.nan


def histogram(row: np.ndarray, bins: int) -> Histogram | None:
    """The TensorBoard histogram of one packed row, or None when it has no finite value."""
    return histograms(row[None, :], bins)[0]


def histograms(rows: np.ndarray, bins: int) -> list[Optional[Histogram]]:
    """The TensorBoard histogram of each packed row (None where it has no finite value),
    trimmed to the buckets between its first and last non-empty one."""
    counts = rows[:, HIST + 1 : HIST + bins + 1].copy()
    counts[:, 0] += rows[:, HIST]
    counts[:, -1] += rows[:, HIST + bins + 1]
    limits = rows[:, ANCHOR, None] + (np.arange(1, bins + 1) - rows[:, ZERO_POINT, None] + 0.5) * rows[:, SCALE, None]
    filled = counts != 0
    first = filled.argmax(1)
    end = bins - filled[:, ::-1].argmax(1)
    head = rows[:, [COUNT, MIN, MAX, SUM, SUMSQ]]
    constant = head[:, 1] == head[:, 2]
    first[constant], end[constant] = 0, 1  # one bucket: [max], count n
    counts[constant, 0] = head[constant, 0]
    limits[np.arange(len(rows)), end - 1] = head[:, 2]  # the last limit is the max
    out: list[Optional[Histogram]] = []
    make = tuple.__new__  # Histogram(...) less its Python __new__: a call per histogram, two or three per parameter
    for i, (n, mn, mx, total, sumsq) in enumerate(head.tolist()):
        lo, hi = first[i], end[i]
        out.append(None if n == 0 else make(Histogram, (mn, mx, n, total, sumsq, limits[i, lo:hi], counts[i, lo:hi])))
    return out


def scalar_stats(rows: np.ndarray, stats: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-row values of the named statistics (see ``layerwatch.vocabulary.STATS``). A tensor holding a NaN or Inf
    gets NaN for every statistic but ``nonfinite`` (its count of them): a statistic of its
    finite values alone would read as a healthy, or a vanished, layer."""
    nonfinite = rows[:, NONFINITE]
    rows = np.where(nonfinite[:, None] > 0, np.nan, rows)
    n = rows[:, COUNT]
    with np.errstate(divide="ignore", invalid="ignore"):
        derived = {
            "mean": lambda: rows[:, SUM] / n,
            "std": lambda: np.sqrt(np.maximum(rows[:, CENTERED_SUMSQ], 0) / n),
            "min": lambda: rows[:, MIN],
            "max": lambda: rows[:, MAX],
            "norm": lambda: np.sqrt(rows[:, SUMSQ]),
            "zero_frac": lambda: rows[:, ZEROS] / (n + rows[:, NONFINITE]),
            "nonfinite": lambda: nonfinite,
        }
        return {name: derived[name]() for name in stats}
