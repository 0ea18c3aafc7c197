"""The Python function calls of one training step with an Inspector at its defaults, sampled and not.

    python benchmarks/step_calls.py [--workloads tfm-tiny,gpt,cnn] [--no-sentinel]

Each workload (``workloads.py``) runs under ``Inspector(model, every_n_steps=4)`` with the
optimizer tracked, as a plain loop runs it: the training step, then ``inspector.step()``,
which closes the step and opens the next (arming the hooks when the next is sampled). After
a warm-up (sample 0 records the layer table, sample 4 runs as every later one), the four
iterations that open step 8, train it and close it and then run steps 9 and 10 are counted
one by one with ``sys.setprofile``: forward, backward and optimizer step with their hooks, and
the Inspector's calls. The last of them is an unsampled step; the sample's calls are the four
iterations' less four unsampled ones. Calls, not time: the count is the same from run to
run, so a change to the engine's code shows in it exactly (a restructuring must not make a
sample's calls grow by more than 1%).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from layerwatch import Inspector

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import counted_calls  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

EVERY = 4


def step_calls(name: str, sentinel: bool) -> tuple[int, int]:
    """The calls a sample adds to its steps, and the calls of an unsampled step."""
    model, opt, train_step = WORKLOADS[name]()
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspector = Inspector(model, log_dir=log_dir, every_n_steps=EVERY, optimizer=opt, sentinel=sentinel).start()

        def iteration() -> None:
            train_step()
            inspector.step()

        try:
            for _ in range(2 * EVERY - 1):  # steps 0 to 6, and step 7's step() opens step 8
                iteration()
            period = [counted_calls(iteration) for _ in range(EVERY)]  # ... then steps 7 (closing) to 10
        finally:
            inspector.finish()
    unsampled = period[-1]
    return sum(period) - EVERY * unsampled, unsampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="tfm-tiny,gpt,cnn")
    parser.add_argument("--no-sentinel", dest="sentinel", action="store_false", help="the NaN sentinel off")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, every_n_steps={EVERY}, sentinel={args.sentinel}")
    print("| workload | a sample adds | an unsampled step |")
    print("|---|---|---|")
    for name in args.workloads.split(","):
        sampled, unsampled = step_calls(name, args.sentinel)
        print(f"| {name} | {sampled:,} | {unsampled:,} |")


if __name__ == "__main__":
    main()
