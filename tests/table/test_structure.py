import csv
import gc
import io
import json
import re
import sys
import warnings
import weakref
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from layerwatch import Inspector, summarize
from layerwatch.cli import main
from models import (BatchNormNet, FrozenBackbone, InPlaceCheckpointed, MLP, SHORT_RUN_NOTE, Restless, SharedLayer, SmallCNN, TiedLM,
                    hook_count, run_state, same_state, train)

BATCH = 32


@pytest.fixture(scope="module")
def cnn():
    return summarize(SmallCNN(), torch.randn(BATCH, 1, 28, 28))


def conv_macs(out_c, out_h, out_w, in_c, kh, kw, batch=BATCH):
    return batch * out_c * out_h * out_w * in_c * kh * kw


def test_small_cnn_known_answers(cnn):
    assert cnn["conv1"].macs == conv_macs(16, 28, 28, 1, 3, 3) == 3_612_672
    assert cnn["conv2"].macs == conv_macs(32, 14, 14, 16, 3, 3) == 28_901_376
    assert cnn["fc"].macs == BATCH * 32 * 7 * 7 * 10 == 501_760
    assert cnn["pool1"].macs == 0
    assert cnn[""].macs == cnn.total_macs == 3_612_672 + 28_901_376 + 501_760
    assert cnn.total_flops == 2 * cnn.total_macs and cnn["conv2"].flops == 2 * cnn["conv2"].macs
    assert cnn["conv1"].param_bytes == (16 * 1 * 9 + 16) * 4
    assert cnn["conv2"].param_bytes == (32 * 16 * 9 + 32) * 4
    assert cnn["fc"].param_bytes == (32 * 7 * 7 * 10 + 10) * 4
    assert cnn.total_params == 160 + 4_640 + 15_690 and cnn.param_bytes == 4 * cnn.total_params
    assert cnn["conv1"].activation_bytes == BATCH * 16 * 28 * 28 * 4
    assert cnn["pool2"].activation_bytes == BATCH * 32 * 7 * 7 * 4
    assert cnn["conv2"].input_shapes == [[BATCH, 16, 14, 14]] and cnn["conv2"].output_shapes == [[BATCH, 32, 14, 14]]
    assert cnn["fc"].input_shapes == [[BATCH, 1568]]
    assert [row.name for row in cnn] == ["", "conv1", "pool1", "conv2", "pool2", "fc"]
    assert [row.depth for row in cnn] == [0, 1, 1, 1, 1, 1]
    assert all(row.calls == 1 for row in cnn) and cnn.batch_size == BATCH


def test_table_text_is_aligned_and_totalled(cnn):
    text = str(cnn)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("Layer (type)"))
    conv1 = next(line for line in lines if "conv1 (Conv2d)" in line)
    assert conv1.startswith("  conv1 (Conv2d)")  # indented by depth
    assert conv1.index("[32, 1, 28, 28]") == header.index("Input shape")
    assert conv1.rstrip().endswith("1") and "3,612,672" in conv1
    assert "Total params: 20,490" in text and "Frozen params: 0" in text and "Batch size: 32" in text
    assert "SmallCNN: 6 modules, 20,490 params" in repr(cnn)


def test_transformer_encoder_layer_counts_attention():
    batch, length, d, heads, ff = 2, 10, 64, 4, 128
    layer = nn.TransformerEncoderLayer(d, heads, ff, batch_first=True).eval()
    s = summarize(layer, torch.randn(batch, length, d))
    projections = batch * length * d * 3 * d + batch * length * d * d  # in_proj (q, k, v) and out_proj
    scores = 2 * batch * length * length * d  # q @ k^T and weights @ v, over all heads
    assert s["self_attn"].macs == projections + scores
    assert s["linear1"].macs == batch * length * d * ff and s["linear2"].macs == batch * length * ff * d
    assert s.total_macs == s["self_attn"].macs + s["linear1"].macs + s["linear2"].macs
    assert torch.backends.mha.get_fastpath_enabled()  # switched back on after the call


@pytest.mark.parametrize("cell, gates", [(nn.LSTM, 4), (nn.GRU, 3)])
def test_recurrent_layers_count_every_time_step(cell, gates):
    steps, batch, d_in, hidden = 7, 3, 4, 6
    s = summarize(cell(d_in, hidden, num_layers=2, bidirectional=True), torch.randn(steps, batch, d_in))
    per_direction = [gates * hidden * (d_in + hidden), gates * hidden * (2 * hidden + hidden)]  # layer 0, layer 1
    assert s.total_macs == steps * batch * 2 * sum(per_direction)


def test_tied_weight_counted_once_under_its_first_owner():
    model = TiedLM(vocab=20, d=8)
    s = summarize(model, torch.zeros(4, 5, dtype=torch.long))
    assert s["embed"].params == 160 and s["proj"].params == 0
    assert s["proj"].tied == {"proj.weight": "embed.weight"}
    assert s.total_params == 160 == sum(p.numel() for p in model.parameters())
    assert s["proj"].macs == 4 * 5 * 8 * 20
    assert "Tied: proj.weight is embed.weight" in str(s)


def test_frozen_submodule():
    s = summarize(FrozenBackbone(), torch.randn(3, 8))
    assert s.frozen_params == s["backbone"].frozen_params == 8 * 16 + 16
    assert s.learnable_params == s["head"].learnable_params == 16 * 4 + 4
    assert s["backbone"].learnable_params == 0 and s.total_params == 144 + 68


def test_module_called_twice_adds_up_its_calls():
    s = summarize(SharedLayer(), torch.randn(5, 8))
    row = s["layer"]
    assert row.calls == 2
    assert row.macs == 2 * 5 * 8 * 8 and row.activation_bytes == 2 * 5 * 8 * 4
    assert row.input_shapes == [[5, 8]]  # shapes of the first call
    assert s.total_macs == row.macs + 5 * 8 * 2
    assert s.total_params == 72 + 18  # one layer, counted once


def test_container_never_called_shows_its_childrens_macs():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    s = summarize(Stack(), torch.randn(2, 4))
    assert s["blocks"].calls == 0 and s["blocks"].macs == 3 * 2 * 4 * 4 == s.total_macs
    assert s["blocks"].input_shapes == [] and s["blocks"].params == 3 * 20
    assert "--" in next(line for line in str(s).splitlines() if "blocks (ModuleList)" in line)


@pytest.mark.parametrize("training", [True, False])
def test_leaves_model_buffers_mode_rng_and_hooks_as_they_were(training):
    torch.manual_seed(0)
    model = BatchNormNet().train(training)
    model.drop.eval()  # a mixed tree: each module's own flag is restored
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3, 8, 8) * 5 + 3
    rng = torch.get_rng_state()
    s = summarize(model, x)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats, num_batches_tracked, weights
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training == training and model.bn.training == training and not model.drop.training
    assert hook_count(model) == 0
    assert s["bn"].output_shapes == [[4, 4, 6, 6]]


def test_failed_forward_names_the_module_and_removes_hooks():
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 4), nn.Linear(5, 2))

        def forward(self, x):
            return self.encoder(x)

    model = Broken()
    with pytest.raises(RuntimeError, match=r"forward failed in 'encoder\.1'.*shapes cannot be multiplied") as info:
        summarize(model, torch.randn(3, 8))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert hook_count(model) == 0
    assert summarize(model.encoder[0], torch.randn(3, 8)).total_macs == 3 * 8 * 4  # nothing left armed


def test_structured_outputs_and_keyword_inputs():
    @dataclass
    class Out:
        logits: torch.Tensor
        aux: dict
        note: str

    class Structured(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 6)

        def forward(self, x, *, mask=None, scale=2.0):
            h = self.body(x) * scale
            return Out(h, {"masked": h * mask, "none": None}, "text"), None

    s = summarize(Structured(), torch.randn(3, 4), mask=torch.ones(3, 6))
    assert s[""].input_shapes == [[3, 4], [3, 6]]  # positional, then keyword tensors
    assert s[""].output_shapes == [[3, 6], [3, 6]]
    assert s[""].activation_bytes == 2 * 3 * 6 * 4


def test_at_another_batch_size_sequence_first():
    layer = nn.LSTM(4, 6)  # (seq, batch, feature)
    s = summarize(layer, torch.randn(7, 3, 4))
    assert s.batch_size == 7  # dimension 0 by default: here the sequence
    wide = s.at(batch_size=12, batch_dim=1)
    assert wide.batch_size == 12 and wide[""].input_shapes == [[7, 12, 4]]
    assert wide[""].output_shapes[0] == [7, 12, 6]


def test_at_another_dtype_and_batch_size(cnn):
    half = cnn.at(dtype="fp16")
    assert half.param_bytes == 2 * cnn.total_params and half["conv1"].activation_bytes == BATCH * 16 * 28 * 28 * 2
    assert cnn.at(dtype=torch.bfloat16).param_bytes == 2 * cnn.total_params
    assert cnn.at(dtype="int8")["fc"].param_bytes == 15_690
    assert cnn.param_bytes == 4 * cnn.total_params  # the original is unchanged
    big = cnn.at(batch_size=128)
    assert big["conv2"].macs == conv_macs(32, 14, 14, 16, 3, 3, batch=128)
    assert big["conv1"].output_shapes == [[128, 16, 28, 28]] and big.batch_size == 128
    assert big["conv1"].activation_bytes == 4 * cnn["conv1"].activation_bytes
    both = cnn.at(batch_size=8, dtype="bf16")
    assert both["fc"].activation_bytes == 8 * 10 * 2 and both.total_params == cnn.total_params
    measured = summarize(SmallCNN(), torch.randn(128, 1, 28, 28))
    assert [r.macs for r in measured] == [r.macs for r in big]  # the scaling agrees with a real run
    assert [r.activation_bytes for r in measured] == [r.activation_bytes for r in big]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dtype="fp8"), ValueError, "dtype must be one of .* got 'fp8'"),
        (dict(dtype=torch.float64), ValueError, "got torch.float64"),
        (dict(batch_size=0), ValueError, "batch_size must be an int >= 1, got 0"),
        (dict(batch_size=2.5), ValueError, "got 2.5"),
        (dict(batch_size=8, batch_dim=4), ValueError, r"batch_dim 4 is not a dimension .*\[32, 1, 28, 28\]"),
        (dict(batch_size=8, batch_dim=-1), ValueError, "batch_dim must be an int >= 0, got -1"),
    ],
)
def test_at_refuses_bad_values(cnn, kwargs, error, message):
    with pytest.raises(error, match=message):
        cnn.at(**kwargs)


def test_misuse_errors(cnn):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        summarize(lambda x: x, torch.randn(2))
    with pytest.raises(KeyError, match="no module named 'conv3'.*did you mean .*'conv1'"):
        cnn["conv3"]


def test_csv_is_flat_and_json_is_hierarchical(cnn, tmp_path):
    rows = list(csv.DictReader(io.StringIO(cnn.to_csv())))
    assert [r["name"] for r in rows] == [row.name for row in cnn]
    assert int(rows[1]["macs"]) == 3_612_672 and json.loads(rows[1]["output_shapes"]) == [[BATCH, 16, 28, 28]]
    assert set(rows[0]) >= {"type", "depth", "params", "learnable_params", "frozen_params", "param_bytes",
                            "activation_bytes", "flops", "calls", "input_shapes"}
    tree = json.loads(cnn.to_json())
    assert list(tree) == ["SmallCNN"]
    root = tree["SmallCNN"]
    assert root["info"]["params"] == 20_490 and list(root["children"]) == ["conv1", "pool1", "conv2", "pool2", "fc"]
    assert root["children"]["conv2"]["info"]["macs"] == 28_901_376 and root["children"]["conv2"]["children"] == {}
    assert cnn.to_csv(tmp_path / "t.csv") is None and (tmp_path / "t.csv").read_text() == cnn.to_csv()
    assert cnn.to_json(tmp_path / "t.json") is None and json.loads((tmp_path / "t.json").read_text()) == tree


def test_json_nests_grandchildren():
    s = summarize(nn.Sequential(nn.Sequential(nn.Linear(2, 3)), nn.ReLU()), torch.randn(1, 2))
    tree = json.loads(s.to_json())["Sequential"]
    assert tree["children"]["0"]["children"]["0"]["info"]["name"] == "0.0"


def test_json_same_with_and_without_orjson(cnn, monkeypatch):
    monkeypatch.setitem(sys.modules, "orjson", None)  # import fails: the json fallback
    plain = cnn.to_json()
    orjson = pytest.importorskip("orjson", reason="orjson not installed")
    monkeypatch.setitem(sys.modules, "orjson", orjson)
    assert json.loads(cnn.to_json()) == json.loads(plain)


def test_dataframe_needs_pandas(cnn, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="to_dataframe needs pandas"):
        cnn.to_dataframe()


def test_dataframe_with_pandas(cnn):
    pytest.importorskip("pandas")
    frame = cnn.to_dataframe()
    assert list(frame["name"]) == [row.name for row in cnn] and frame["macs"].sum() > cnn.total_macs


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports torch.jit
def test_compiled_model_is_measured_eagerly():
    model = MLP()
    s = summarize(torch.compile(model), torch.randn(2, 8))
    assert s.model_type == "MLP" and s["fc1"].macs == 2 * 8 * 16


# ---------------------------------------------------------------------- command line


def test_summary_command_table_csv_and_json(capsys):
    assert main(["summary", "models:SmallCNN", "--input", "32x1x28x28"]) == 0
    table = capsys.readouterr().out
    assert "conv1 (Conv2d)" in table and "3,612,672" in table
    assert main(["summary", "models:SmallCNN", "--input", "32x1x28x28", "--format", "csv", "--dtype", "float16"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert int(rows[1]["param_bytes"]) == 160 * 2
    assert main(["summary", "models:TiedLM", "--input", "4x5:int64", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["TiedLM"]["children"]["proj"]["info"]["params"] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["models:SmallCNN", "--input", "32xx1"], "--input '32xx1': expected a shape like 32x1x28x28"),
        (["models:SmallCNN", "--input", "2x3:float99"], "unknown dtype 'float99'"),
        (["models:SmallCNN", "--input", "2x1x28x28", "--dtype", "fp8"], "got 'fp8'"),
        (["models.SmallCNN", "--input", "2"], "FACTORY must look like package.module:callable"),
        (["no_such_module:f", "--input", "2"], "cannot import 'no_such_module'"),
        (["models:Nope", "--input", "2"], "'models' has no attribute 'Nope'"),
        (["models:train", "--input", "2"], "'models:train' failed when called with no arguments"),
        (["models:torch", "--input", "2"], "gave a module, not a torch.nn.Module"),
        (["raises_on_import:f", "--input", "2"], "importing 'raises_on_import' (from 'raises_on_import:f') raised RuntimeError: no GPU here"),
    ],
)
def test_summary_command_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["summary", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_summary_command_reports_a_failed_forward(capsys):
    assert main(["summary", "models:SmallCNN", "--input", "2x3x28x28"]) == 1
    assert "forward failed in 'conv1'" in capsys.readouterr().err


# ---------------------------------------------------------------------- during training


class CountingCNN(SmallCNN):
    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return super().forward(x)


def test_inspector_logs_the_table_once_from_the_real_batch(tmp_path, events):
    torch.manual_seed(0)
    model = CountingCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.fc.requires_grad_(False)
    with Inspector(model, log_dir=tmp_path, every_n_steps=2) as inspector:
        for step in range(5):
            with torch.no_grad():
                model(torch.randn(3, 1, 28, 28))  # an evaluation forward: not training, not recorded
            loss = model(torch.randn(BATCH, 1, 28, 28)).logsumexp(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            inspector.step()
    assert model.forwards == 10  # no extra forward
    acc = events(tmp_path)
    texts = acc.Tensors("layerwatch/structure/text_summary")
    assert [t.step for t in texts] == [0]
    table = texts[0].tensor_proto.string_val[0].decode()
    expected = summarize(SmallCNN(), torch.randn(BATCH, 1, 28, 28))
    assert "[32, 1, 28, 28]" in table and "[3, 1, 28, 28]" not in table
    assert all(line.startswith("    ") for line in table.splitlines())  # a Markdown code block keeps it aligned
    assert f"{expected['conv2'].macs:,}" in table
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert scalars["layerwatch/params_total"] == [(0, 20_490)]
    assert scalars["layerwatch/params_frozen"] == [(0, 15_690)]
    assert scalars["layerwatch/params_learnable"] == [(0, 20_490 - 15_690)]
    assert scalars["layerwatch/macs_per_step"] == [(0, float(expected.total_macs))]
    assert hook_count(model, opt) == 0


@pytest.mark.filterwarnings("ignore:layerwatch. no gradients at sampled step 0")
def test_table_waits_for_a_sampled_step_with_a_forward(tmp_path, events):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
        inspector.step()  # step 0 has no forward
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        inspector.step()
    assert [t.step for t in events(tmp_path).Tensors("layerwatch/structure/text_summary")] == [1]


def test_structure_family_off_adds_no_hooks(tmp_path, events):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inspector = Inspector(model, log_dir=tmp_path, every_n_steps=1, families=("weights", "grads")).start()
    assert hook_count(model, opt) == 0
    model(torch.randn(4, 8)).sum().backward()
    inspector.step()
    inspector.finish()
    acc = events(tmp_path)
    assert "layerwatch/params_total" not in acc.Tags()["scalars"]
    assert "layerwatch/structure/text_summary" not in acc.Tags()["tensors"]


def test_compiled_model_gets_its_table_from_its_re_run_once_and_keeps_the_rest(tmp_path, events):
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with Inspector(compiled, log_dir=tmp_path, every_n_steps=1) as inspector:
            for _ in range(3):
                compiled(torch.randn(4, 8)).sum().backward()
                opt.step()
                inspector.step()
    assert not [str(w.message) for w in record if "compile" in str(w.message)]
    assert hook_count(model, opt) == 0 and hook_count(compiled) == 0
    acc = events(tmp_path)
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    text = "\n".join(line[4:] for line in table.tensor_proto.string_val[0].decode().splitlines())
    assert table.step == 0 and text == summarize(MLP(), torch.randn(4, 8)).to_text()
    assert len(acc.Scalars("layerwatch/grad_norm")) == 3


def test_a_compiled_models_table_is_of_the_first_micro_batch_of_its_step(tmp_path, events, capsys):
    """Gradient accumulation: the re-run runs the step's first training forward again (not the
    evaluation forward before it), and says so once; an eager model's table adds up its step's."""
    def run(log_dir, compiled):
        model = MLP()
        call = torch.compile(model, backend="eager") if compiled else model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Inspector(call, log_dir=log_dir, every_n_steps=2) as inspector:
                for _ in range(2):
                    with torch.no_grad():
                        call(torch.randn(3, 8))
                    for rows in (4, 6):
                        call(torch.randn(rows, 8)).sum().backward()
                    inspector.step()
        return events(log_dir)

    first, second = summarize(MLP(), torch.randn(4, 8)), summarize(MLP(), torch.randn(6, 8))
    eager = run(tmp_path / "eager", compiled=False)
    assert eager.Scalars("layerwatch/macs_per_step")[0].value == first.total_macs + second.total_macs
    capsys.readouterr()
    acc = run(tmp_path / "compiled", compiled=True)
    assert "sampled step 0 ran 2 training forwards (the micro-batches" in capsys.readouterr().err
    (table,) = acc.Tensors("layerwatch/structure/text_summary")
    assert acc.Scalars("layerwatch/macs_per_step")[0].value == first.total_macs
    assert re.search(r"fc1 \(Linear\) +\[4, 8\] +\[4, 16\] .* 1$", table.tensor_proto.string_val[0].decode(), re.MULTILINE)


def test_a_compiled_models_re_run_keeps_no_batch_and_leaves_the_model_and_its_generators_as_they_were(tmp_path):
    """The re-run of a sampled step, before the step's own forward, leaves the generators (torch's,
    Python's, NumPy's), the buffers, the gradients, the modes and the model's own attributes as
    they were (a forward that draws from each generator, runs BatchNorm in train mode and keeps its
    last output as an attribute), and keeps no reference to the batch past the step."""
    torch.manual_seed(0)
    model = Restless()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    around = []
    with Inspector(compiled, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
        compiled.register_forward_pre_hook(lambda m, a: around.append((run_state(model), model.last)))  # after the re-run
        for step in range(2):
            x = torch.randn(16, 8)
            before, last = run_state(model), model.last
            compiled(x).sum().backward()
            opt.step()
            opt.zero_grad()
            inspector.step()
            assert same_state(before, around[-1][0]) and around[-1][1] is last, step
            batch = weakref.ref(x)
            del x
            gc.collect()
            assert batch() is None, step
    assert hook_count(model, opt) == 0


def test_a_failing_table_probe_is_warned_once_and_training_goes_on(tmp_path, monkeypatch):
    from layerwatch.table import recording as structure

    def broken(*args, **kwargs):
        raise ValueError("no shapes today")

    monkeypatch.setattr(structure, "describe", broken)
    torch.manual_seed(0)
    plain = train(MLP(), 4, seed=1)
    torch.manual_seed(0)
    model = MLP()
    with pytest.warns(RuntimeWarning, match="could not record the layer table: ValueError\\('no shapes today'\\)"):
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            watched = train(model, 4, inspector, seed=1)
    assert watched == plain


def test_table_in_training_with_in_place_ops_and_checkpointing(tmp_path, events):
    torch.manual_seed(0)
    plain = train(InPlaceCheckpointed(), 4, seed=2)
    torch.manual_seed(0)
    model = InPlaceCheckpointed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=SHORT_RUN_NOTE)
        with Inspector(model, log_dir=tmp_path, every_n_steps=1) as inspector:
            watched = train(model, 4, inspector, seed=2)
    assert watched == plain
    table = events(tmp_path).Tensors("layerwatch/structure/text_summary")[0].tensor_proto.string_val[0].decode()
    block = next(line for line in table.splitlines() if "0 (Linear)" in line)
    assert block.split()[-1] == "1"  # the recompute in backward is not a second call
    assert f"{32 * 16 * 16:,}" in block
