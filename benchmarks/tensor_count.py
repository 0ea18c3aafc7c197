"""Whether a sampled step's parameter families cost more for more tensors of the same bytes.

    python benchmarks/tensor_count.py [--values 16777216] [--counts 16,64,256,1024,4096]

The same number of float32 values, split into 16 to 4096 tensors: medians of 15 batched
reductions (``stats.reduce`` with a kept workspace, as a sampled step runs it) without
histograms and with the default 32-bucket histograms; and the Python function calls one
sample of the parameter families makes (snapshot, gradients, weights, updates) on a model of
that many tensors holding 2**20 values in all (one chunk: the calls per chunk stay out). The histograms of tensors up to ``HISTOGRAM_VALUES`` values count every
value and those of larger tensors a sample, so the 32-bucket column also follows the values
counted, not only the tensors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from layerwatch import stats as S
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import validate_options
from layerwatch.measure.params import ParameterFamilies, parameters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import counted_calls, median_ms  # noqa: E402


def python_calls(count: int, size: int) -> int:
    """Python function calls of one sample of the parameter families (after a first sample)."""
    model = nn.ParameterList([nn.Parameter(torch.randn(size)) for _ in range(count)])
    for p in model:
        p.grad = torch.randn(size)
    params = parameters(model)
    families = ParameterFamilies(validate_options(), FailurePolicy())

    def sample() -> None:
        snapshot = families.snapshot(params, 0)
        families.gradients(params, 0)
        families.weights(params)
        families.updates(snapshot, params, weight_norms=False)

    sample()
    return counted_calls(sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=1 << 24)
    parser.add_argument("--counts", default="16,64,256,1024,4096")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.values:,} float32 values")
    print("| tensors | values each | reduce, no histograms | reduce, 32 buckets | Python calls per sample |")
    print("|---|---|---|---|---|")
    for count in [int(c) for c in args.counts.split(",")]:
        size = args.values // count
        tensors = [torch.randn(size) for _ in range(count)]
        workspace = S.Workspace()
        plain = median_ms(lambda: S.reduce(tensors, 0, workspace=workspace))
        bucketed = median_ms(lambda: S.reduce(tensors, 32, histogram_values=S.HISTOGRAM_VALUES, workspace=workspace))
        print(f"| {count} | {size:,} | {plain:.1f} ms | {bucketed:.1f} ms | {python_calls(count, (1 << 20) // count)} |")


if __name__ == "__main__":
    main()
