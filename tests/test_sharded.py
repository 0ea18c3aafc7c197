"""FSDP2 (fully_shard) on two CPU ranks with gloo: statistics of sharded tensors are exact for the
whole tensor, from shard-local reductions; rank 0 alone writes."""

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from layerwatch import Inspector
from conftest import tolerate_abort_at_exit
from models import MLP, tab_values

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

STATS = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        plain = []
        for inspected in (False, True):
            torch.manual_seed(0)
            model = MLP(d_in=8, hidden=10, d_out=3)  # 10 rows: uneven shards are fine
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            inspector = Inspector(model, log_dir=f"{out}/run", every_n_steps=1, optimizer=opt, stats=STATS).start() if inspected else None
            for step in range(3):
                torch.manual_seed(100 + 10 * step + rank)  # each rank its own data
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                reference = {f"grads/{n}": p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
                reference |= {f"before/{n}": p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}
                opt.step()
                reference |= {f"weights/{n}": p.full_tensor().detach().numpy() for n, p in model.named_parameters()}
                if inspector is None:
                    plain.append(loss.item())
                    continue
                inspector.step()
                assert loss.item() == plain[step]  # the per-module probes on FSDP2's modules change nothing
                if rank == 0:
                    np.savez(f"{out}/step{step}.npz", **reference)
            if inspector is not None:
                inspector.finish()
    finally:
        dist.destroy_process_group()
    Path(out, f"done{rank}").touch()


def test_fully_shard_statistics_are_exact_for_whole_tensors(tmp_path, events):
    with tolerate_abort_at_exit(tmp_path / "done0", tmp_path / "done1"):
        mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    acc = events(tmp_path / "run")
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    activations = [f"activations/{m}" for m in ("(root)", "fc1", "act", "fc2")]  # rank 0's own batch, as under DDP
    assert sorted(acc.Tags()["histograms"]) == sorted([f"{f}/{n}" for f in ("weights", "grads") for n in names] + activations)
    assert all(acc.Scalars(f"fwd_ms/{m}")[-1].value > 0 for m in ("fc1", "fc2"))
    for step in range(3):
        reference = np.load(tmp_path / f"step{step}.npz")
        for family in ("weights", "grads"):
            for name in names:
                a = reference[f"{family}/{name}"].ravel().astype(np.float64)
                expected = {"mean": a.mean(), "std": a.std(), "min": a.min(), "max": a.max(),
                            "norm": np.linalg.norm(a), "zero_frac": (a == 0).mean(), "nonfinite": 0.0}
                for stat, value in expected.items():
                    if stat == "nonfinite":  # a card only once the layer has a NaN/Inf; the tab has it
                        assert tab_values(acc)[f"{family}_nonfinite/{name}"][step] == 0.0
                        continue
                    got = acc.Scalars(f"{family}_{stat}/{name}")[step]
                    assert got.step == step
                    assert got.value == pytest.approx(value, rel=1e-4, abs=1e-6), (step, family, stat, name)
                hist = acc.Histograms(f"{family}/{name}")[step].histogram_value
                assert hist.num == a.size and sum(hist.bucket) == a.size
                counts, _ = np.histogram(a, [hist.min] + list(hist.bucket_limit))
                assert np.abs(counts - np.array(hist.bucket)).sum() <= 2  # a value on an edge may move
            for name in names:
                delta = reference[f"weights/{name}"] - reference[f"before/{name}"]
                ratio = np.linalg.norm(delta) / np.linalg.norm(reference[f"weights/{name}"])  # w after the step
                assert acc.Scalars(f"update_ratio/{name}")[step].value == pytest.approx(ratio, rel=1e-4)
    grads = [np.load(tmp_path / "step0.npz")[f"grads/{n}"] for n in names]
    assert acc.Scalars("layerwatch/grad_norm")[0].value == pytest.approx(
        np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads)), rel=1e-5
    )
