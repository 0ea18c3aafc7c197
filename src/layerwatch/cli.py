"""The ``layerwatch`` command."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from layerwatch import __version__


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="layerwatch", description="Watch the inside of a PyTorch model while it trains.")
    parser.add_argument("--version", action="version", version=f"layerwatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small built-in model with Lightning and InspectCallback; write TensorBoard logs"
    )
    demo.add_argument("--steps", type=_positive, default=8000, help="optimizer steps (default 8000)")
    demo.add_argument("--logdir", default="runs/layerwatch-demo", help="TensorBoard log directory")
    demo.add_argument("--every", type=_positive, default=50, help="sample every N steps (default 50)")
    demo.add_argument("--inject-nan", type=int, default=None, metavar="STEP", help="make one layer emit a NaN at STEP")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from layerwatch.demo import run_demo

        run_demo(steps=args.steps, log_dir=args.logdir, every=args.every, inject_nan=args.inject_nan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
