"""The LightningModules of the tests and their Trainer (at module level, so that ddp_spawn can
pickle them); ``models`` hands them out when asked for, so that only what needs Lightning imports it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as L
from lightning.pytorch.loggers import TensorBoardLogger

from layerwatch.engine.budget import Pacer
from models import MLP, NaNOnRankOne, Recurrent, StructuredOutputs, dataset, scripted_ideal

class LitMLP(L.LightningModule):
    """Logs its loss with self.log and remembers each step's gradient norms before clipping."""

    def __init__(self, lr: float = 0.1, record_dir: Optional[str] = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr = lr
        self.record_dir = record_dir  # where each rank writes what it saw (for DDP tests)
        self.seen_grad_norms: dict[int, dict[str, float]] = {}
        self.seen_batches: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_batches.append(x[:, 0].tolist())
        loss = F.binary_cross_entropy_with_logits(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_end(self) -> None:
        if self.record_dir is not None:
            seen = {"grad_norms": self.seen_grad_norms, "batches": self.seen_batches}
            Path(self.record_dir, f"rank{self.global_rank}.json").write_text(json.dumps(seen))

    def on_before_optimizer_step(self, optimizer) -> None:
        # Called after the callbacks' hook and before Lightning clips the gradients.
        self.seen_grad_norms[self.trainer.global_step] = {
            name: p.grad.norm().item() for name, p in self.named_parameters() if p.grad is not None
        }

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8, shuffle=False)


class LitSpike(LitMLP):
    """LitMLP whose batch at global step ``spike_at`` is scaled up 30 times: a loss spike."""

    def __init__(self, spike_at: Optional[int] = None, lr: float = 0.01) -> None:
        super().__init__(lr=lr)
        self.spike_at = spike_at
        self.losses: list[str] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step == self.spike_at:
            x = x * 30
        return F.binary_cross_entropy_with_logits(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # the step's loss (a replay runs training_step again)
        self.losses.append(repr(outputs["loss"].item()))

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))


class LitAmplified(LitSpike):
    """A deeper MLP whose layer ``net.2`` has its output scaled ``amplify`` times at global step
    ``spike_at`` (a forward hook times a buffer: one graph compiled); ``compiled``: its net runs
    under torch.compile (aot_eager). ``gradient``: the forward is left alone, and ``net.4``'s
    weight gradient is scaled instead."""

    def __init__(self, spike_at: Optional[int] = None, amplify: float = 1e3, compiled: bool = False,
                 gradient: bool = False) -> None:
        super().__init__(spike_at=spike_at, lr=1e-3)
        torch.manual_seed(0)
        layer = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        layer[1].register_buffer("amplify", torch.ones(()))
        if gradient:
            layer[2].weight.register_hook(lambda grad: grad * layer[1].amplify)
        else:
            layer[1].register_forward_hook(lambda module, args, output: output * module.amplify)
        self.net = nn.Sequential(layer[0], nn.ReLU(), layer[1], nn.ReLU(), layer[2], nn.ReLU(), layer[3])
        self.amplify, self.compiled = amplify, compiled
        object.__setattr__(self, "call", torch.compile(self.net, backend="aot_eager") if compiled else self.net)  # no submodule

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.net[2].amplify.fill_(self.amplify if self.trainer.global_step == self.spike_at else 1.0)
        return F.binary_cross_entropy_with_logits(self.call(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class TwoOptimizers(L.LightningModule):
    """Manual optimization with two optimizers: two global steps per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss = F.mse_loss(self.second(torch.relu(self.first(x))), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.first.parameters(), lr=0.1), torch.optim.SGD(self.second.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8)


class LitZoo(L.LightningModule):
    """Wraps an awkward model of ``CASES`` (by case name) with a loss that uses all its outputs."""

    def __init__(self, case: str) -> None:
        super().__init__()
        from models import FrozenBackbone, InPlaceCheckpointed

        self.case = case
        self.net = {"structured outputs": StructuredOutputs, "LSTM and GRU": Recurrent,
                    "checkpoint": InPlaceCheckpointed, "frozen backbone": FrozenBackbone}[case]()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if self.case == "structured outputs":
            h, d, out, _ = self.net(x)
            loss = h.pow(2).mean() + d["a"].pow(2).mean() + out.logits.pow(2).mean()
        elif self.case == "LSTM and GRU":
            loss = self.net(x.reshape(-1, 2, 4)).pow(2).mean()
        else:
            loss = self.net(x).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0))), batch_size=8)


class LitGAN(L.LightningModule):
    """Manual optimization with two optimizers, as a GAN steps them: the discriminator, then
    the generator, each zeroing its own gradients just before its backward. Remembers the
    norm of each generator gradient at the generator's own step, keyed by that step's
    global step as the callback sees it at the batch's start."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.disc = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        self.gen_grad_norms: dict[int, dict[str, float]] = {}

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_d, opt_g = self.optimizers()
        step_at_start = self.trainer.global_step
        noise = torch.randn(x.shape[0], 4)
        fake = self.gen(noise)
        d_loss = F.softplus(-self.disc(x)).mean() + F.softplus(self.disc(fake.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.softplus(-self.disc(self.gen(noise))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.gen_grad_norms[step_at_start] = {
            f"gen.{name}": p.grad.norm().item() for name, p in self.gen.named_parameters()
        }
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.disc.parameters(), lr=0.05), torch.optim.SGD(self.gen.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=16)


class LitTransformer(L.LightningModule):
    """The issue's 12-layer ``nn.TransformerEncoder`` (4 heads, ff 4x), narrow: its tags do not
    depend on the width."""

    def __init__(self, d_model: int = 32, seq: int = 8) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
        self.d_model, self.seq = d_model, seq

    def training_step(self, batch, batch_idx):
        return self.encoder(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, self.seq, self.d_model, generator=g)), batch_size=4)


class LitMoE(L.LightningModule):
    """A tiny transformers Mixtral (its routers found by the moe family), on token batches."""

    def __init__(self) -> None:
        super().__init__()
        from hf_models import tiny_moe

        self.model = tiny_moe("mixtral")

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 64, (16, 8), generator=g)), batch_size=4)


class LitParallel(L.LightningModule):
    """An MLP sharded in ``configure_model`` under ``ModelParallelStrategy``: FSDP2 per layer
    (``"fsdp2"``) or tensor parallel (``"tensor"``). Remembers its losses."""

    def __init__(self, parallel: str) -> None:
        super().__init__()
        self.parallel = parallel
        self.net = MLP(d_in=8, hidden=16, d_out=8)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.parallel == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net.fc1, self.net.fc2):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        else:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, self.device_mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0))), batch_size=4)


class LitFaultOnRankOne(L.LightningModule):
    """A NaN made by ``fault`` on rank 1 only, at global step 3, with Dropout and BatchNorm
    around it; each rank writes its losses and final state to ``record_dir``."""

    def __init__(self, record_dir: str, tag: str) -> None:
        super().__init__()
        self.fault = NaNOnRankOne(3)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), self.fault, nn.BatchNorm1d(16), nn.Linear(16, 1))
        self.record_dir, self.tag = record_dir, tag
        self.losses: list[str] = []

    def training_step(self, batch, batch_idx):
        self.fault.now, self.fault.rank = self.global_step, self.global_rank
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(repr(outputs["loss"].item()))

    def on_train_end(self) -> None:
        state = [repr(v) for t in self.state_dict().values() for v in t.flatten().tolist()]
        Path(self.record_dir, f"{self.tag}{self.global_rank}.json").write_text(json.dumps({"losses": self.losses, "state": state}))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(dataset(256, seed=3), batch_size=16, shuffle=False)


class ScriptedBudget(L.Callback):
    """Scripts what each rank's overhead budget measures (``Pacer.ideal``: rank ``r`` wants
    ``ideals[r]``), and writes which steps each rank sampled, and the InspectCallback's state at
    the end, to ``record_dir/sampled<rank>.json``. Put it before the InspectCallback."""

    def __init__(self, ideals: list[float], record_dir: str) -> None:
        self.ideals = ideals
        self.record_dir = record_dir
        self.sampled: list[int] = []

    def setup(self, trainer, pl_module, stage) -> None:
        Pacer.ideal = scripted_ideal(lambda: self.ideals[trainer.global_rank])

    def _inspect(self, trainer):
        from layerwatch import InspectCallback

        return next(cb for cb in trainer.callbacks if isinstance(cb, InspectCallback))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._inspect(trainer)._engine.sampled:
            self.sampled.append(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        seen = {"sampled": self.sampled, "state": self._inspect(trainer).state_dict()}
        Path(self.record_dir, f"sampled{trainer.global_rank}.json").write_text(json.dumps(seen))


def make_trainer(tmp_path, callbacks, **kwargs):
    defaults = dict(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_steps=6,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        logger=TensorBoardLogger(tmp_path, name="tb", version=0),
    )
    defaults.update(kwargs)
    return L.Trainer(callbacks=callbacks, **defaults)
