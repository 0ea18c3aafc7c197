"""MoE routers on two gloo ranks, each routing its own batch (DDP, FSDP2 per decoder layer):
rank 0 writes the counts added over the ranks by expert, equal to one process routing both
batches; the entropy and log Z are the means over both ranks' tokens."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import layerwatch
from layerwatch import Inspector
from ranks import check_collectives_from_here, run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
pytest.importorskip("transformers")

SEQ, VOCAB = 8, 64
ROUTERS = ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")


def batch_of(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(10 + rank))


def moe_worker(rank: int, world: int, wrapping: str, out: str) -> None:
    from hf_models import tiny_moe

    model = tiny_moe("mixtral")
    if wrapping == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        check_collectives_from_here()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x = batch_of(rank)
    with Inspector(model, log_dir=out if rank == 0 else None, every_n_steps=1, optimizer=opt, alerts=False,
                   histograms=False) as inspector:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        inspector.step()


def moe_frame(frame):
    """The moe series by (series, layer), DDP's ``module.`` taken off its layers' names (the routers
    are named as every probed module is: under the wrapper's name)."""
    frame = frame[frame.series.str.startswith("moe")]
    return frame.assign(layer=frame.layer.str.removeprefix("module.")).set_index(["series", "layer"]).value


@pytest.mark.parametrize("wrapping", ["ddp", "fsdp2"])
def test_each_ranks_routing_is_added_by_expert(tmp_path, wrapping):
    from hf_models import tiny_moe

    run_ranks(moe_worker, wrapping, str(tmp_path / "ranks"), tmp=tmp_path, debug="INFO" if wrapping == "ddp" else "DETAIL")
    together = tiny_moe("mixtral")
    opt = torch.optim.AdamW(together.parameters(), 1e-3)
    x = torch.cat([batch_of(0), batch_of(1)])
    with Inspector(together, log_dir=tmp_path / "one", every_n_steps=1, optimizer=opt, alerts=False,
                   histograms=False) as inspector:
        together(input_ids=x, labels=x).loss.backward()
        opt.step()
        inspector.step()
    written = layerwatch.load(tmp_path / "ranks")
    prefix = "module." if wrapping == "ddp" else ""
    assert set(written[written.series == "moe_imbalance"].layer) == {prefix + router for router in ROUTERS}
    ranks, one = moe_frame(written), moe_frame(layerwatch.load(tmp_path / "one"))
    tokens = ranks["moe_tokens"]
    assert tokens.to_dict() == one["moe_tokens"].to_dict()  # exact, every expert of both routers
    assert tokens.sum() == len(ROUTERS) * 4 * SEQ * 2  # both ranks' 2 x SEQ tokens, top-2
    for series in ("moe_imbalance", "moe_dead", "moe_entropy", "moe_margin", "moe_router_z", "moe_router_z_max"):
        for router in ROUTERS:
            assert ranks[series][router] == pytest.approx(one[series][router], rel=1e-5), (series, router)
