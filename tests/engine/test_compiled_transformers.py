"""A compiled real transformer trains bit for bit the same with layerwatch at its defaults, in
bfloat16, on every front door.

transformers' ``LlamaForCausalLM`` at a small size (2 layers of width 64, attention dropout 0.1),
under ``torch.compile`` with Inductor, computing in bfloat16: the plain loop's ``Inspector`` under
``torch.autocast``, Lightning's callback with ``precision="bf16-mixed"`` on a compiled
LightningModule, and the Hugging Face callback under ``torch_compile=True, bf16=True``. Each run
against the same run without layerwatch: the losses and the final weights bitwise equal, and
Dynamo's graphs, recompiles and graph breaks the same, while the sampled steps are measured (on
an eager re-run of their micro-batch: activations, each attention layer's heads, the output
head's log Z). Deterministic algorithms are on: Inductor's CPU code adds some gradients
atomically, so without them two runs without layerwatch can differ in the last bits.

Before layerwatch stayed out of compiled code, the Lightning run differed from its first step
and compiled three times the graphs, and every door ended with weights that differed.
"""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lightning.pytorch")
dynamo = pytest.importorskip("torch._dynamo")
from models import tab_values  # noqa: E402
from compiled_runs import MEASURED, SEQ, inspector_run, lightning_run, sampled_steps, trainer_run, training_gaps  # noqa: E402


@pytest.fixture(autouse=True)
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)
    dynamo.reset()


def test_the_inspector_on_a_compiled_llama_in_bfloat16_leaves_its_run_as_it_was(tmp_path, events):
    watched, plain = inspector_run(tmp_path), inspector_run(None)
    assert training_gaps(watched, plain) == {} and plain["dynamo"]["graphs"] >= 1  # bitwise, the same graphs
    assert sampled_steps(events(tmp_path)) == dict.fromkeys(MEASURED, [0, 1])


def test_the_hugging_face_callback_under_torch_compile_and_bf16_leaves_the_run_as_it_was(tmp_path, events):
    from layerwatch.huggingface import InspectTrainerCallback
    from hf_models import event_dirs

    plain = trainer_run([], tmp_path / "plain")
    watched = trainer_run([InspectTrainerCallback()], tmp_path / "watched")
    assert training_gaps(watched, plain) == {} and plain["dynamo"]["graphs"] >= 1
    (run,) = event_dirs(tmp_path / "watched")
    assert sampled_steps(events(run)) == dict.fromkeys(MEASURED, [1, 2])  # the Trainer counts steps from 1


def test_lightnings_callback_on_a_compiled_module_in_bf16_mixed_leaves_the_run_as_it_was(tmp_path, events):
    from layerwatch import InspectCallback

    plain = lightning_run([], tmp_path / "plain")
    watched = lightning_run([InspectCallback()], tmp_path / "watched")
    assert training_gaps(watched, plain) == {} and plain["dynamo"]["graphs"] >= 1
    assert sampled_steps(events(tmp_path / "watched" / "tb" / "version_0"), prefix="llama.") == dict.fromkeys(MEASURED, [0, 1])


def test_a_compiled_mixtral_gets_its_routers_from_the_re_run_and_compiles_as_without(tmp_path, events):
    """The moe family through the eager re-run: the compiled step runs the one graph a plain run
    compiles (no break, no recompile: measured once against a run without layerwatch, which
    trains bitwise the same; ``benchmarks/moe.py --compiled`` checks that), and each sampled
    step's routers are logged."""
    from hf_models import tiny_moe

    watched = inspector_run(tmp_path, make=lambda: tiny_moe("mixtral", vocab=256))
    assert watched["dynamo"] == {"graphs": 1, "recompiles": 0, "graph_breaks": 0}
    acc = events(tmp_path)
    for tag in ("moe_imbalance/model.layers.0.mlp.gate", "moe_entropy/model.layers.1.mlp.gate"):
        assert [e.step for e in acc.Scalars(tag)] == [0, 1]
    tab = tab_values(acc)  # the per-expert tokens are the tab's series, not cards
    tokens = [values for tag, values in tab.items() if tag.startswith("moe_tokens/")]
    assert len(tokens) == 2 * 4 and all(sorted(values) == [0, 1] for values in tokens)  # 2 routers of 4 experts
    for step in (0, 1):  # the re-run's micro-batch: 2 x SEQ tokens, top-2, through each of 2 routers
        assert sum(values[step] for values in tokens) == 2 * 2 * SEQ * 2
