"""What layerwatch adds to a sharded training step: FSDP2 per layer, and tensor parallel.

    python benchmarks/sharded.py [--rounds 5] [--steps 20] [--width 256] [--blocks 4]

Two gloo CPU ranks, one thread each. Per set-up, rounds of ``--steps`` training steps,
interleaved: without layerwatch; with an Inspector that samples no step (what every unsampled
step of a sharded run pays: the ranks' vote on the next step and the sentinel on this rank's
shards); with one that samples every step at the defaults. Prints rank 0's median step in ms
and the ratios to the run without layerwatch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from layerwatch import Inspector, at_steps


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(setup: str, width: int, blocks: int, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = Stack(width, blocks)
    if setup == "fsdp2 per layer":
        from torch.distributed.fsdp import fully_shard

        for module in list(model.modules()):
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {f"blocks.{i}.fc1": ColwiseParallel() for i in range(blocks)}
        plan |= {f"blocks.{i}.fc2": RowwiseParallel() for i in range(blocks)}
        parallelize_module(model, mesh, plan)
    return model


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    log_dir = tempfile.mkdtemp()
    for setup in ("fsdp2 per layer", "tensor parallel"):
        model = build(setup, args.width, args.blocks, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        seed = rank if setup.startswith("fsdp2") else 0  # tensor parallel: the same batch on every rank
        x = torch.randn(32, 16, args.width, generator=torch.Generator().manual_seed(seed))

        calls: list[float] = []  # inspector.step() of unsampled steps, alone

        def steps(inspector, timed_calls: bool = False) -> float:
            started = time.perf_counter()
            for _ in range(args.steps):
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if inspector is not None:
                    called = time.perf_counter()
                    inspector.step()
                    if timed_calls:
                        calls.append(time.perf_counter() - called)
            return (time.perf_counter() - started) / args.steps * 1e3

        kinds = {"without": None, "unsampled": {"schedule": at_steps([])}, "every step sampled": {"every_n_steps": 1}}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        steps(None)  # warm-up
        for _ in range(args.rounds):
            for kind, options in kinds.items():
                inspector = None if options is None else Inspector(model, log_dir=log_dir, optimizer=opt, **options).start()
                times[kind].append(steps(inspector, timed_calls=kind == "unsampled"))
                if inspector is not None:
                    inspector.finish()
        if rank == 0:
            base = statistics.median(times["without"])
            cells = [f"{statistics.median(t):.1f} ms ({statistics.median(t) / base:.3f}x)" for t in times.values()]
            print(f"| {setup} | " + " | ".join(cells) + f" | {statistics.median(calls) * 1e6:.0f} µs |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks of one thread, width {args.width}, {args.blocks} blocks, "
          f"{args.rounds} rounds of {args.steps} steps")
    print("| set-up | without layerwatch | unsampled steps | every step sampled | inspector.step(), unsampled |")
    print("|---|---|---|---|---|")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    mp.spawn(rank_main, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    sys.exit(main())
