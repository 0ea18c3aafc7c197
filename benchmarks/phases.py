"""Time each phase of the parameter families of a sampled step, on one benchmark workload.

    python benchmarks/phases.py [stack32]      # or gpt, cnn, tfm, tfm-tiny, stack

Medians of 7 calls of each phase alone, on the model after a few training steps, at the
default options: the walk of the parameters, the gradients' and the weights' batched
reductions, the update snapshot with the update norms, the transfer, the record's
histograms and scalars, and the event write; and an uninstrumented training step to compare
with. The phases run back to back here, so their inputs are warmer in the caches than
inside a training step.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Callable

from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from layerwatch.sinks import record as R  # noqa: E402
from layerwatch import stats as S  # noqa: E402
from layerwatch.guards.failures import FailurePolicy  # noqa: E402
from layerwatch.options import validate_options  # noqa: E402
from layerwatch.measure.params import ParameterFamilies, parameters  # noqa: E402
from layerwatch.sinks.tensorboard import TensorBoardSink  # noqa: E402


def timed(name: str, action: Callable[[], object], calls: int = 7) -> None:
    print(f"{name:<24} {median_ms(action, calls):8.2f} ms")


def main() -> None:
    model, _, step = WORKLOADS[sys.argv[1] if len(sys.argv) > 1 else "stack32"]()
    for _ in range(3):
        step()
    options = validate_options()
    families = ParameterFamilies(options, FailurePolicy())
    params = parameters(model)
    timed("walk the parameters", lambda: parameters(model))
    timed("gradients", lambda: families.gradients(params, 0))
    timed("weights", lambda: families.weights(params))
    timed("snapshot + updates", lambda: families.updates(families.snapshot(params, 0), params, weight_norms=False))
    pieces = families.gradients(params, 0)[0] + families.weights(params)[0]  # the whole tensors' (no experts here)
    timed("transfer", lambda: S.to_host([rows for _, rows in pieces]))
    host = S.to_host([rows for _, rows in pieces])

    def record() -> R.StepRecord:
        rows = {family: [(names, rows.reshape(len(names), -1))] for family, (names, _), rows in zip(("grads", "weights"), pieces, host)}
        return R.build(1, rows, stats=options.stats, bins=options.bins)

    timed("record", record)
    with tempfile.TemporaryDirectory() as tmp:
        sink = TensorBoardSink(SummaryWriter(tmp), owns_writer=True)
        rec = record()
        timed("write the event", lambda: sink.write(rec))
        sink.close()
    timed("uninstrumented step", step)


if __name__ == "__main__":
    main()
