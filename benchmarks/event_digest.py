"""Fingerprints of the event files of fixed-seed runs: the check that a change of the code
changes no output.

    python benchmarks/event_digest.py OUT.json            # write the digests
    python benchmarks/event_digest.py OUT.json --against BEFORE.json   # and compare

Runs, each with seed 0, one thread, in a fresh temporary log directory:

- ``demo``: ``layerwatch demo --steps 40 --every 10 --inject-nan 25`` (a NaN run, replayed);
- ``zoo:<case>``: every case of ``tests/models.py``'s ``CASES``, 4 steps at ``every_n_steps=1``;
- ``nan``: a plain MLP whose ``fc1`` output turns NaN at step 5, sampled every 2 steps.

Every event is read back (TensorBoard's own record reader) and fingerprinted whole: tag,
step, and the value's bytes, but for what a clock decides and nothing else: the event's
wall time, the timings (``fwd_ms``, ``bwd_ms``, ``overhead_ms`` and the tab's ``fwd_ms``
and ``bwd_ms`` series), the process's memory readings, and the values that depend on
allocation addresses (``ADDRESS_DEPENDENT``). Those are cleared before hashing.
A run's digest is the SHA-256 of its events in file order; a differing run lists its first
differing event.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402

from layerwatch import Inspector  # noqa: E402
from layerwatch.reading import events as metadata  # noqa: E402

CLOCKED_PREFIXES = ("fwd_ms/", "bwd_ms/", "layerwatch/overhead_ms", "layerwatch/memory/", "memory/")
CLOCKED_SERIES = ("fwd_ms", "bwd_ms")
# Under gradient accumulation a micro-batch's saved tensor can take the address of one freed by
# the micro-batch before, and saved tensors are told apart by their storage: the bytes then
# depend on the allocator's history in the process, not on the code (seen: three values in
# three runs of the same commit).
ADDRESS_DEPENDENT = {"zoo:gradient accumulation": ("saved_bytes",)}


def clocked(tag: str, series: tuple[str, ...] = CLOCKED_SERIES) -> bool:
    if tag.startswith(CLOCKED_PREFIXES):
        return True
    return tag.startswith(metadata.SERIES) and tag[len(metadata.SERIES):].split("/")[0] in series


def events(log_dir: Path, address_dependent: tuple[str, ...] = ()) -> list[str]:
    """Every event of ``log_dir``'s files, in order, as a line: step, tag, value bytes' hash."""
    lines = []
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("file_version"):
                continue
            for value in event.summary.value:
                if clocked(value.tag, CLOCKED_SERIES + address_dependent) or value.tag.startswith(
                        tuple(key + "/" for key in address_dependent)):
                    value.ClearField("simple_value")
                    value.ClearField("tensor")
                data = value.SerializeToString(deterministic=True)
                lines.append(f"{path.relative_to(log_dir).parent}|{event.step}|{value.tag}|{hashlib.sha256(data).hexdigest()[:16]}")
    return lines


def in_fresh_dir(run: Callable[[Path], None], address_dependent: tuple[str, ...] = ()) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        np.random.seed(0)
        run(Path(tmp))
        return events(Path(tmp), address_dependent)


def demo(log_dir: Path) -> None:
    from layerwatch.cli import main

    main(["demo", "--steps", "40", "--every", "10", "--logdir", str(log_dir), "--inject-nan", "25"])


def zoo_case(case) -> Callable[[Path], None]:
    def run(log_dir: Path) -> None:
        model = case.make()
        optimizers = case.optimizers(model)
        with Inspector(model, log_dir=log_dir, every_n_steps=1) as inspector:
            for k in range(4):
                case.step(model, optimizers, k)
                inspector.step()
    return run


def nan_run(log_dir: Path) -> None:
    from models import MLP

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    poison = model.fc1.register_forward_hook(lambda m, i, o: o * float("nan") if step[0] == 5 else o)
    step = [0]
    with Inspector(model, log_dir=log_dir, every_n_steps=2, optimizer=opt) as inspector:
        for step[0] in range(10):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            inspector.step()
    poison.remove()


def runs() -> dict[str, Callable[[Path], None]]:
    from models import CASES

    out = {"demo": demo, "nan": nan_run}
    out.update({f"zoo:{case.name}": zoo_case(case) for case in CASES})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--against")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    digests = {}
    for name, run in runs().items():
        lines = in_fresh_dir(run, ADDRESS_DEPENDENT.get(name, ()))
        digests[name] = {"sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(), "events": lines}
        print(f"{name:45s} {len(lines):5d} values  {digests[name]['sha256'][:16]}")
    Path(args.out).write_text(json.dumps(digests, indent=0))
    if args.against is None:
        return 0
    before = json.loads(Path(args.against).read_text())
    differing = 0
    for name, now in digests.items():
        then = before.get(name)
        if then is None or then["sha256"] != now["sha256"]:
            differing += 1
            first = next((i for i, (a, b) in enumerate(zip(then["events"] if then else [], now["events"])) if a != b), None)
            where = "missing before" if then is None else (
                f"first difference at value {first}: {then['events'][first]} -> {now['events'][first]}" if first is not None
                else f"{len(then['events'])} values before, {len(now['events'])} now")
            print(f"DIFFERS {name}: {where}")
    print("identical" if not differing else f"{differing} run(s) differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
