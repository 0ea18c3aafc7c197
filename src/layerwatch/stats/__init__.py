"""Batched statistics and histograms of many tensors, computed where they live, in four parts:

- :mod:`~layerwatch.stats.rows`: the packed row format (a row per tensor, its columns), and its
  readers: :class:`Rows`, :func:`exact_row`, :func:`histograms`, :func:`scalar_stats`;
- :mod:`~layerwatch.stats.host`: device values brought to the host: :func:`to_host` (blocking, one
  transfer per device), :func:`to_host_nonblocking` (a copy behind an event), :class:`Landings`
  (such copies read once they have landed), :func:`host_reads_free`;
- :mod:`~layerwatch.stats.batched`: the batched reduction (:func:`reduce`), its plans and the
  scratch buffers a :class:`Workspace` keeps between calls;
- :mod:`~layerwatch.stats.sharded`: a tensor spread over ranks, combined exactly
  (:func:`reduce_sharded`, :func:`combine_shards`).

Everything is read as ``layerwatch.stats.<name>``.
"""

from layerwatch.stats.host import Landings, has_landed, host_reads_free, to_host, to_host_nonblocking
from layerwatch.stats.batched import Workspace, as_real_values, bincount, chunk_values, grid, prime_stride, reduce
from layerwatch.stats.rows import (ADAM_ROWS, ADAM_SPIKE_ROWS, ESTIMATED_UPDATE_ROWS, EXPERT_GRAD_ROWS, EXPERT_UPDATE_ROWS,
                                   EXPERT_WEIGHT_ROWS, GRAD_ROWS, UPDATE_ROWS, WEIGHT_ROWS, ANCHOR, CENTERED_SUMSQ, COUNT, FINGERPRINT_WIDTH, HIST, HISTOGRAM_VALUES, HostRows, MAX, MAX_BINS,
                                   MIN, NONFINITE, SCALE, SUM, SUMSQ, ZERO_POINT, ZEROS, Histogram, Rows, exact_row,
                                   histogram, histograms, row_width, scalar_stats)
from layerwatch.stats.sharded import combine_shards, reduce_sharded, shard_statistics
from layerwatch.vocabulary import STATS

__all__ = [
    "ADAM_ROWS", "ADAM_SPIKE_ROWS", "ESTIMATED_UPDATE_ROWS", "EXPERT_GRAD_ROWS", "EXPERT_UPDATE_ROWS", "EXPERT_WEIGHT_ROWS",
    "GRAD_ROWS", "UPDATE_ROWS", "WEIGHT_ROWS",
    "ANCHOR", "CENTERED_SUMSQ", "COUNT", "FINGERPRINT_WIDTH", "HIST", "HISTOGRAM_VALUES", "MAX", "MAX_BINS", "MIN",
    "NONFINITE", "SCALE", "STATS", "SUM", "SUMSQ", "ZERO_POINT", "ZEROS", "Histogram", "HostRows", "Landings", "Rows",
    "Workspace", "as_real_values", "bincount", "chunk_values", "combine_shards", "exact_row", "grid", "has_landed", "histogram", "histograms", "host_reads_free",
    "prime_stride", "reduce", "reduce_sharded", "row_width", "scalar_stats", "shard_statistics", "to_host",
    "to_host_nonblocking",
]
