"""FlexAttention: each call's heads from the kernel's own statistics of its rows (the largest
score, exact; the min-entropy, logsumexp − max), eager and compiled, the run unchanged; a
kernel that returns neither is said once; a model with FlexAttention keeps its layer table.

torch 2.13 runs FlexAttention on the CPU for inference only: ``flex_attention`` refuses inputs
with gradients there. A training run is what layerwatch watches, so the training tests lift
that one refusal (``cpu_training``), and torch runs its reference implementation, forward and
backward, which returns both statistics as a GPU kernel does."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from layerwatch import Inspector
from layerwatch.probes.flex_attention import flex_rows
from models import SdpaLM, lm_step, min_entropy_heads, tab_values

FA = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture
def cpu_training(monkeypatch):
    refusal = FA._validate_device

    def lifted(query, key, value):  # everything torch checks but the CPU's refusal of gradients
        if query.device.type != "cpu":
            refusal(query, key, value)

    monkeypatch.setattr(FA, "_validate_device", lifted)


def test_the_rows_statistics_are_each_heads_largest_logit_and_mean_min_entropy():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    logits = q @ k.transpose(-2, -1) * 8 ** -0.5
    logits[1, :, 4] = float("-inf")  # a row with no key left: left out
    top, lse = logits.amax(-1), logits.logsumexp(-1)
    got = flex_rows(lse / math.log(2), top / math.log(2))  # the operator's base-2 logarithms
    kept = torch.ones(2, 10, dtype=torch.bool)
    kept[1, 4] = False
    for h in range(3):
        assert got[h, 0].item() == pytest.approx(top[:, h][kept].max().item(), rel=1e-6)
        assert got[h, 1].item() == pytest.approx((lse - top)[:, h][kept].mean().item(), rel=1e-5)
        assert got[h, 2].item() == 19
    assert (got[:, 1] >= 0).all()  # -log max p


def train(log_dir, backend=None, steps=6, seen=None):
    """SdpaLM with FlexAttention, ``backend``: compiled with it (None: eager); the losses, as
    ``repr``, and the graphs and graph breaks Dynamo made."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = SdpaLM(flex=True)
    if seen is not None:
        for b, block in enumerate(model.blocks):
            for side in ("q", "k"):
                getattr(block.attn, side).register_forward_hook(
                    lambda module, args, out, key=f"{b}.{side}": seen.setdefault(key, []).append(out.detach().clone()))
    call = model if backend is None else torch.compile(model, backend=CompileCounterWithBackend(backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses, standing = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inspector = Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt).start() if log_dir else None
        for _ in range(steps):
            losses.append(repr(lm_step(call, opt, torch.randint(0, 32, (4, 12), generator=generator)).item()))
            if inspector is not None:
                inspector.step()
            standing.append(FA.flex_attention_hop)
        if inspector is not None:
            inspector.finish()
    return losses, standing, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_each_flex_attention_call_gets_its_heads_eager_and_the_run_is_unchanged(tmp_path, events, cpu_training):
    operator = FA.flex_attention_hop
    seen: dict[str, list[torch.Tensor]] = {}
    losses, standing, _, _ = train(tmp_path, seen=seen)
    plain, _, _, _ = train(None)
    assert losses == plain
    assert standing == [operator] * 6  # the stand-in is there during a sampled forward only
    tab = tab_values(events(tmp_path))
    split = lambda t: t.view(4, 11, 2, 8).transpose(1, 2)  # noqa: E731
    for b in range(2):
        name = f"blocks.{b}.attn"
        for step in (0, 2, 4):  # from the first sampled step on
            expected = min_entropy_heads(split(seen[f"{b}.q"][step]), split(seen[f"{b}.k"][step]))
            assert tab[f"attention_logit_max/{name}"][step] == pytest.approx(expected[:, 0].max().item(), rel=1e-5)
            assert tab[f"attention_entropy/{name}"][step] == pytest.approx(expected[:, 1].min().item(), rel=1e-5)


def test_a_compiled_models_flex_attention_is_measured_on_its_re_run_as_in_eager(tmp_path, events, cpu_training):
    """The re-run runs FlexAttention eagerly (its reference implementation, which returns both
    statistics): eager's values at every sampled step, bitwise losses, the very graphs, and the
    stand-in there for the re-run alone."""
    operator = FA.flex_attention_hop
    eager, _, _, _ = train(tmp_path / "eager")
    plain, _, plain_graphs, plain_breaks = train(None, "aot_eager")
    losses, standing, graphs, breaks = train(tmp_path / "compiled", "aot_eager")
    assert losses == plain == eager and (graphs, breaks) == (plain_graphs, plain_breaks)
    assert standing == [operator] * 6 and FA.flex_attention_hop is operator
    eager_tab, compiled_tab = tab_values(events(tmp_path / "eager")), tab_values(events(tmp_path / "compiled"))
    for tag in [f"attention_{kind}/blocks.{b}.attn" for kind in ("logit_max", "entropy") for b in range(2)]:
        assert sorted(compiled_tab[tag]) == [0, 2, 4], tag
        for step in (0, 2, 4):
            assert compiled_tab[tag][step] == pytest.approx(eager_tab[tag][step], rel=1e-5), (tag, step)


@pytest.mark.parametrize("limit, rows", [(2000, 2), (500, 0)], ids=["two rows fit", "no row fits"])
def test_a_re_run_whose_flex_attention_would_not_fit_runs_the_first_rows_or_is_said(tmp_path, events, monkeypatch, capsys,
                                                                                 cpu_training, limit, rows):
    """Run eagerly, FlexAttention builds every score of a call at once ([4, 2, 11, 11] float32
    here: 3,872 bytes). Above the bound the re-run runs the micro-batch's first rows that fit
    (said once, measured on those), or where not one fits, is said once and not measured. The run
    is as without it either way."""
    from layerwatch.engine import rerun

    monkeypatch.setattr(rerun, "DENSE_LIMIT", limit)
    plain, _, _, _ = train(None, "aot_eager")
    capsys.readouterr()
    losses, _, _, _ = train(tmp_path, "aot_eager")
    assert losses == plain
    said = [line for line in capsys.readouterr().err.splitlines() if "would build 3.8 KiB of scores" in line]
    assert len(said) == 1, said
    tab = tab_values(events(tmp_path))
    if rows:
        assert f"run the first {rows} rows of their micro-batch again" in said[0]
        assert sorted(tab["attention_logit_max/blocks.0.attn"]) == [0, 2, 4]
        assert tab["activation_bytes/blocks.0.attn.q"][0] == rows * 11 * 16 * 4  # measured on those rows
    else:
        assert "not measured" in said[0]
        assert not [key for key in tab if key.startswith(("attention", "activation"))]
    assert weights_measured(events(tmp_path))


def weights_measured(acc) -> bool:
    return [e.step for e in acc.Scalars("weights_norm/head.weight")] == [0, 2, 4]


class FrozenFlexEncoder(nn.Module):
    """A frozen encoder with FlexAttention and a trained linear head (a linear probe): the
    attention's inputs need no gradient, so the CPU runs FlexAttention as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = SdpaLM(flex=True)
        self.encoder.requires_grad_(False)
        self.probe = nn.Linear(32, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.probe(self.encoder(ids).mean(1))


def test_a_kernel_without_the_statistics_is_said_once_and_the_layer_table_is_kept(tmp_path, events, capsys):
    """At the defaults: the CPU's kernel returns neither statistic (said once, nothing
    measured), and the layer table's FLOP counter, which torch 2.13's FlexAttention cannot run
    under, is off for its calls: before, the first sample raised in the user's forward."""
    torch.manual_seed(0)
    model = FrozenFlexEncoder()
    opt = torch.optim.SGD(model.probe.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=tmp_path, every_n_steps=2, optimizer=opt) as inspector:
            for _ in range(6):
                loss = nn.functional.cross_entropy(model(torch.randint(0, 32, (4, 12), generator=generator)),
                                                   torch.tensor([0, 1, 0, 1]))
                opt.zero_grad()
                loss.backward()
                opt.step()
                inspector.step()
    said = capsys.readouterr().err
    assert said.count("FlexAttention's kernel here returns neither") == 1
    acc = events(tmp_path)
    assert not [tag for tag in acc.Tags()["scalars"] if tag.startswith("attention_")]
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert text.count("attn (SdpaAttention)") == 2 and "probe (Linear)" in text
