"""Where the parameters live (layerwatch.engine.placement): found once at the start of a run; whether
the ranks sample together follows from it. The distributed cases run in test_sharded.py,
test_pipeline.py and test_deepspeed.py, on real process groups."""

import torch
from torch import nn

from layerwatch.distributed.sharding import Layout, named_parameters, walk
from layerwatch.guards.failures import FailurePolicy
from layerwatch.options import validate_options
from layerwatch.engine.placement import Placement, find_placement
from layerwatch.probes import StepProbes


def test_a_single_process_run_holds_every_parameter_whole_and_samples_alone():
    options, failures = validate_options(), FailurePolicy()
    probes = StepProbes(options.families, options.modules, options.stats, options.bins, failures)
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    placement = find_placement(model, None, None, options, probes, failures)
    assert placement.zero is None and placement.stages is None and not placement.together
    assert [name for name, _ in placement.layout.parameters(model)] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert probes.structure_pending  # only pipeline stages give the layer table up


def test_a_gone_model_has_no_placement_to_find():
    options, failures = validate_options(), FailurePolicy()
    probes = StepProbes(options.families, options.modules, options.stats, options.bins, failures)
    placement = find_placement(None, None, None, options, probes, failures)
    assert placement.layout.parameters(None) == [] and not placement.together


def test_sharded_parameters_or_pipeline_stages_make_the_ranks_sample_together():
    assert Placement(Layout(sharded=True)).together
    assert Placement(Layout(), stages=object()).together
    assert not Placement(Layout(staged=False)).together


class _Shared(nn.Module):
    """Nested modules, a module held twice, a tied parameter, a None child and a None parameter."""

    def __init__(self) -> None:
        super().__init__()
        inner = nn.Linear(2, 2)
        self.blocks = nn.ModuleList([nn.Sequential(inner, nn.ReLU()), nn.Sequential(nn.Linear(2, 2), inner)])
        self.head = nn.Linear(2, 2)
        self.head.weight = self.blocks[1][0].weight  # tied
        self.missing = None
        self.register_parameter("unset", None)
        self.scale = nn.Parameter(torch.ones(1))


class _OwnWalk(nn.Sequential):
    def named_modules(self, *args, **kwargs):  # a class that walks its own way
        return ((name, m) for name, m in super().named_modules(*args, **kwargs) if not isinstance(m, nn.ReLU))

    def named_parameters(self, *args, **kwargs):
        return ((f"own.{name}", p) for name, p in super().named_parameters(*args, **kwargs))


def test_the_one_frame_walk_lists_what_torch_lists_in_its_order():
    """``walk`` and ``named_parameters`` give torch's lists (each module and parameter once, in
    torch's order, under its first name); a class that walks or names its own way is asked."""
    for model in (_Shared(), nn.Sequential(_Shared(), nn.Sequential()), nn.Linear(2, 2)):
        assert [(n, id(m)) for n, m in walk(model)] == [(n, id(m)) for n, m in model.named_modules()]
        assert [(n, id(p)) for n, p in named_parameters(model)] == [(n, id(p)) for n, p in model.named_parameters()]
    own = _OwnWalk(nn.Linear(2, 2), nn.ReLU())
    assert [n for n, _ in walk(own)] == ["", "0"]
    assert [n for n, _ in named_parameters(own)] == ["own.0.weight", "own.0.bias"]
    nested = nn.Sequential(own)  # met below the root: the root's own walk
    assert [n for n, _ in walk(nested)] == ["", "0", "0.0"]
    patched = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # an override set on the instance itself
    inner = patched.named_modules
    patched.named_modules = lambda *args, **kwargs: ((n, m) for n, m in inner(*args, **kwargs) if n != "1")
    assert [n for n, _ in walk(patched)] == ["", "0"]
