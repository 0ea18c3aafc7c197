"""What layerwatch costs between samples where the host is the bottleneck (the CPU proxy).

    python benchmarks/between_samples.py [--tensors 100,1000] [--rounds 7] [--steps 200] [--device cuda] [--loss]

A chain of N/2 ``Linear(4, 4)`` layers (N gradient tensors, so small that compute is nothing
and what is left is the host's work per tensor, as on a host-bound GPU step), SGD, batch 8,
under ``Inspector(model, optimizer=opt, schedule=at_steps([0, 10]))`` at the defaults
otherwise. After the two samples, rounds of ``--steps`` unsampled steps alternate with
rounds of the same steps of a copy of the model without layerwatch (one process). Reported:

- ``step() us``: the median host time of ``inspector.step()`` on an unsampled step, with the
  sentinel (the default) and without it (``sentinel=False``);
- ``layerwatch us``: what layerwatch adds to the host's step: the median of ``inspector.step()``
  plus the time inside layerwatch's optimizer step hooks (``timing.HookSpans``, host time: the
  sentinel's check runs in the step pre-hook);
- ``unsampled / base``: the median whole unsampled step over the median step of the copy (a
  whole-step ratio: it carries a per cent or two of noise between two copies of a model);
With ``--device cuda`` the chain trains on the GPU and each step ends with a synchronize (in
both loops alike), so that a step's time is the host's and the device's together.

With ``--loss`` each step also gives ``inspector.step(loss=...)`` its loss (the spike check, on in
both columns; ``sentinel`` only turns the sentinel off).

- ``calls per tensor``: the Python calls of sampled step 10 (``timing.counted_calls``, the
  whole step) less an unsampled step's, per gradient tensor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock, HookSpans, counted_calls  # noqa: E402

from layerwatch import Inspector, at_steps  # noqa: E402

SAMPLED = (0, 10)


def chain(tensors: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(tensors // 2)]).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4), torch.randn(8, 4, device=device)


def done(device: str) -> None:
    """The step's device work finished (a GPU's): its time is the host's and the device's."""
    if device != "cpu":
        torch.cuda.synchronize()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def measure(tensors: int, sentinel: bool, rounds: int, steps: int, device: str = "cpu",
            loss: bool = False, grad_norm: bool = False) -> dict[str, float]:
    model, opt, x = chain(tensors, device)
    plain, plain_opt, _ = chain(tensors, device)  # the same, with no hook of layerwatch's on it or its optimizer
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks = HookSpans(opt, Clock("cpu"))  # the host's time in the inspector's optimizer hooks
        inspector = Inspector(model, log_dir=log_dir, optimizer=opt, schedule=at_steps(list(SAMPLED)),
                              sentinel=sentinel).start()
        hooks.after_inspector()
        try:
            for _ in range(SAMPLED[1] + 1):
                train_step(model, opt, x)
                inspector.step()
            step_us, own_us, watched_s, base_s = [], [], [], []
            for _ in range(rounds):
                for _ in range(steps):
                    started = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    out = model(x).pow(2).mean()
                    out.backward()
                    opt.step()  # layerwatch's optimizer hooks: the sentinel's check
                    stepped = time.perf_counter()
                    inspector.step(loss=out if loss else None, grad_norm=out if grad_norm else None)
                    ended = time.perf_counter()
                    done(device)
                    finished = time.perf_counter()
                    own_us.append(1e6 * (ended - stepped + hooks.take()))
                    step_us.append(1e6 * (ended - stepped))
                    watched_s.append(finished - started)
                for _ in range(steps):
                    started = time.perf_counter()
                    plain_opt.zero_grad(set_to_none=True)
                    out = plain(x).pow(2).mean()
                    out.backward()
                    plain_opt.step()
                    done(device)
                    base_s.append(time.perf_counter() - started)
        finally:
            inspector.finish()
            hooks.remove()
    watched, base = statistics.median(watched_s), statistics.median(base_s)
    return {"step_us": statistics.median(step_us), "own_us": statistics.median(own_us), "ratio": watched / base}


def sample_calls(tensors: int, device: str = "cpu") -> float:
    """The Python calls sampled step 10 adds to an unsampled step, per gradient tensor."""
    model, opt, x = chain(tensors, device)
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspector = Inspector(model, log_dir=log_dir, optimizer=opt, schedule=at_steps(list(SAMPLED))).start()
        try:
            for _ in range(SAMPLED[1] - 1):
                train_step(model, opt, x)
                inspector.step()

            def one() -> None:
                train_step(model, opt, x)
                inspector.step()

            opening = counted_calls(one)  # step 9, and the arming of step 10
            sampled = counted_calls(one)  # step 10, written, and step 11 opened
            unsampled = counted_calls(one)
        finally:
            inspector.finish()
    return (opening + sampled - 2 * unsampled) / tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", default="100,1000")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--loss", action="store_true", help="give inspector.step() the loss (the spike check) as well")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device 'cuda': torch sees no CUDA device")
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "1 thread"
    print(f"torch {torch.__version__}, {where}, chain of Linear(4, 4), SGD; medians of {args.rounds} rounds of {args.steps} steps")
    print("| gradient tensors | step() us, sentinel on | off | layerwatch us, on | off | unsampled / base, on | off "
          "| sample's calls per tensor |")
    print("|---|---|---|---|---|---|---|---|")
    for tensors in [int(n) for n in args.tensors.split(",")]:
        on = measure(tensors, True, args.rounds, args.steps, args.device, args.loss)
        off = measure(tensors, False, args.rounds, args.steps, args.device, args.loss)
        print(f"| {tensors:,} | {on['step_us']:.0f} | {off['step_us']:.0f} | {on['own_us']:.0f} | {off['own_us']:.0f} "
              f"| {on['ratio']:.3f} | {off['ratio']:.3f} | {sample_calls(tensors, args.device):.0f} |")


if __name__ == "__main__":
    main()
