"""Where the parameters live (layerwatch.placement): found once at the start of a run; whether
the ranks sample together follows from it. The distributed cases run in test_sharded.py,
test_pipeline.py and test_deepspeed.py, on real process groups."""

from torch import nn

from layerwatch.distributed import Layout
from layerwatch.failures import FailurePolicy
from layerwatch.options import validate_options
from layerwatch.placement import Placement, find_placement
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
