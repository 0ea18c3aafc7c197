"""GPU checks: skipped without CUDA (CI has none); run them where a GPU is available."""

import math
import warnings

import numpy as np
import pytest
import torch

from layerwatch import Inspector
from layerwatch import stats as S
from models import MLP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("histogram_values", [None, 20_000], ids=["whole", "sampled"])
def test_generic_path_on_cuda_matches_cpu_and_never_syncs(histogram_values):
    torch.manual_seed(0)
    tensors = [torch.randn(512, 256) * 0.02, torch.rand(300) + 0.5, torch.zeros(8)]
    bad = torch.randn(100)
    bad[[1, 2]] = math.nan
    tensors.append(bad)
    cuda = [t.cuda() for t in tensors]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = S.reduce(cuda, 64, zeros=True, centered=True, histogram_values=histogram_values)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows.device.type == "cuda"
    reference = S.reduce(tensors, 64, zeros=True, centered=True, fast=False, histogram_values=histogram_values).numpy()
    got = rows.cpu().numpy()
    np.testing.assert_allclose(got[:, : S.HIST], reference[:, : S.HIST], rtol=1e-4, atol=1e-6)
    weight = 1 if histogram_values is None else 8  # a sampled value stands for about 7 (the stride)
    assert np.abs(got[:, S.HIST :] - reference[:, S.HIST :]).sum() <= 4 * weight  # edge ties may round either way


def test_inspector_on_cuda_model(tmp_path):
    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as ins:
        for _ in range(3):
            loss = model(torch.randn(16, 8, device="cuda")).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ins.step()
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_layer_table_on_cuda_matches_cpu_and_never_syncs(tmp_path):
    from layerwatch import summarize
    from models import SmallCNN

    model = SmallCNN()
    x = torch.randn(8, 1, 28, 28)
    on_cpu = summarize(model, x)
    model.cuda()
    x = x.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = summarize(model, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [(r.name, r.macs, r.activation_bytes, r.output_shapes) for r in on_gpu] == [
        (r.name, r.macs, r.activation_bytes, r.output_shapes) for r in on_cpu
    ]


def test_fp16_grad_scaler_overflow_is_a_skip_not_a_fault(tmp_path, events):
    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)  # fp16 overflows at first: skipped steps
    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt) as inspector:
        for _ in range(40):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(torch.randn(32, 8, device="cuda")).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            inspector.step()
    assert inspector.alerts == []
    skipped = [e.step for e in events(tmp_path).Scalars("layerwatch/optimizer_skipped")]
    assert skipped and skipped[0] == 0 and len(skipped) < 40


def test_probes_on_cuda_time_with_events_measure_the_allocator_and_never_sync_in_a_hook(tmp_path, events):
    from layerwatch.probes import RuntimeProbe, select_modules

    torch.manual_seed(0)
    model = MLP().cuda()
    x = torch.randn(64, 8, device="cuda")
    probe = RuntimeProbe(select_modules(model, None), families=("latency", "memory", "activations", "nonfinite"),
                         bins=32, zeros=False, centered=False, parameters=list(model.parameters()))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).pow(2).mean().backward()  # every hook runs here: none may sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    result = probe.result()
    by_name = {t.name: t for t in result.modules}
    assert by_name["fc1"].fwd_ms > 0 and by_name["fc1"].bwd_ms > 0
    assert by_name["(root)"].fwd_ms >= by_name["fc1"].fwd_ms
    assert by_name["fc1"].cuda_alloc_bytes >= 64 * 16 * 4  # its output stays allocated
    assert by_name["fc1"].activation_bytes == 64 * 16 * 4 and by_name["fc1"].nonfinite is False
    assert result.offender is None


def test_the_overhead_benchmark_runs_on_cuda_and_times_with_events(benchmarks):
    from overhead import run
    from timing import Clock

    clock = Clock("cuda")
    slept = clock.times(lambda: torch.cuda._sleep(10_000_000), lambda: None)  # device work the host does not wait for
    assert slept[0] > 0 and slept[1] >= 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run("tfm-tiny", "defaults", rounds=2, naive_rounds=0, wandb_rounds=0, families=(), sentinel=True,
                device="cuda")
    assert r["device"] == torch.cuda.get_device_name()
    assert r["base_ms"] > 0 and r["sampled_ms"] > r["base_ms"] * 0.5 and r["reported_overhead_ms"] > 0


@pytest.mark.parametrize("config", ["wgu", "defaults"])
def test_a_sampled_step_syncs_the_host_only_for_its_one_transfer(tmp_path, config):
    """Inside forward, backward and the optimizer step of a sampled step nothing waits for the
    GPU (hooks, snapshot); the parameter families' ``inspector.step()`` then makes one transfer."""
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 8, device="cuda")
    extra = {"families": ("weights", "grads", "updates"), "sentinel": False} if config == "wgu" else {}

    def syncs(action) -> list[str]:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                action()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [str(w.message) for w in caught if "synchroniz" in str(w.message)]

    def train() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    with Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt, **extra) as inspector:
        for _ in range(3):  # the first samples: the layer table, plans and buffers
            train()
            inspector.step()
        assert syncs(train) == []
        if config == "wgu":
            assert len(syncs(inspector.step)) <= 1


@pytest.mark.parametrize("parallel", ["fsdp2 per layer", "tensor parallel"])
def test_sharded_models_on_a_one_rank_cuda_mesh(tmp_path, events, parallel):
    """The DTensor code paths on CUDA: FSDP2 units per layer and tensor-parallel layers on a
    mesh of this one GPU. Losses are unchanged, every family is written, and the hooks of a
    sampled forward and backward make no host sync."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        mesh = init_device_mesh("cuda", (1,))
        losses = {}
        for inspected in (False, True):
            torch.manual_seed(0)
            model = MLP(d_in=8, hidden=32, d_out=4).cuda()
            if parallel == "fsdp2 per layer":
                from torch.distributed.fsdp import fully_shard

                for layer in (model.fc1, model.fc2):
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            else:
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            inspector = Inspector(model, log_dir=tmp_path, every_n_steps=1, optimizer=opt).start() if inspected else None
            losses[inspected] = []
            for step in range(3):
                x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step)).cuda()
                torch.cuda.synchronize()
                if inspected and step == 2:  # the layer table (step 0) reads shapes; later steps read nothing on the host
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    loss = model(x).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                opt.step()
                if inspector is not None:
                    inspector.step()
                losses[inspected].append(loss.item())
            if inspector is not None:
                inspector.finish()
        assert losses[True] == losses[False]
    finally:
        dist.destroy_process_group()
    acc = events(tmp_path)
    assert {"fwd_ms/fc1", "fwd_ms/fc2", "weights_norm/fc1.weight", "grads_norm/fc2.weight"} <= set(acc.Tags()["scalars"])
    assert {"activations/fc1", "activations/act"} <= set(acc.Tags()["histograms"])


def test_the_replay_on_a_gpu_reads_the_sentinel_before_the_step_and_names_the_module(tmp_path):
    """On a GPU a replayable step waits for the sentinel's check before the optimizer step (the
    one sync it adds), replays the bad step on the device, and leaves training bitwise as it was."""
    from models import FaultAt, make_model, same_tensors, train_steps

    def train(inspected: bool):
        fault = FaultAt(3)
        model = make_model(fault).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator(device="cuda").manual_seed(1)
        batches = [(torch.randn(32, 8, device="cuda", generator=g), torch.randn(32, 1, device="cuda", generator=g))
                   for _ in range(6)]
        inspector = Inspector(model, log_dir=tmp_path, every_n_steps=50, optimizer=opt).start() if inspected else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = train_steps(model, fault, opt, batches, inspector)
        alerts = [] if inspector is None else [a.message for a in inspector.alerts]
        if inspector is not None:
            inspector.finish()
        return losses, [t.detach().cpu() for t in model.state_dict().values()], alerts

    plain, watched = train(False), train(True)
    assert watched[0] == plain[0] and same_tensors(watched[1], plain[1])
    assert ("first offender: step 3, forward: 4 turned finite inputs into a non-finite output (replayed from step 3)"
            in watched[2])


def test_the_replay_benchmark_runs_on_cuda(benchmarks):
    from replay import run

    r = run("tfm-tiny", rounds=2, steps=3, device="cuda")
    assert r["device"] == torch.cuda.get_device_name() and r["replay_named"]


def test_a_model_compiled_with_inductor_on_cuda_is_measured_on_its_re_run_and_never_syncs(tmp_path, events):
    """Triton kernels: bitwise losses against the same compiled run without layerwatch, the
    modules measured on sampled steps (on the eager re-run, before the step's forward), and
    neither the re-run nor any hook of ours making the host wait in a sampled step's forward and
    backward (CUDA's own sync debug mode)."""
    from models import Spoiler, spoilable

    def run(log_dir):
        torch._dynamo.reset()
        model = spoilable(Spoiler()).cuda()
        call = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(16, 8, generator=g).cuda(), torch.randn(16, 4, generator=g).cuda()) for _ in range(6)]
        inspector = None if log_dir is None else Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt).start()
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, (x, y) in enumerate(batches):
                opt.zero_grad()
                if k == 4 and inspector is not None:  # sampled, its graphs made
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    loss = torch.nn.functional.mse_loss(call(x), y)
                    loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                opt.step()
                losses.append(loss.item())
                if inspector is not None:
                    inspector.step()
        if inspector is not None:
            inspector.finish()
        return losses

    assert run(tmp_path) == run(None)
    assert [e.step for e in events(tmp_path).Scalars("activations_norm/3")] == [0, 2, 4]


def test_a_snapshot_that_does_not_fit_in_the_gpus_free_memory_is_estimated_then_exact_again(tmp_path, events):
    """The GPU nearly full (a filler tensor leaves less than the weights' bytes beyond the 5%
    margin): update ratios are estimates, under their own tag; freed, exact again."""
    from layerwatch.measure.params import CUDA_MARGIN

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 8)).cuda()  # 64 MiB
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    holder = {}

    def fill(step):
        if step == 0:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            holder["filler"] = torch.empty(int(free - CUDA_MARGIN * total - weights // 2), dtype=torch.uint8, device="cuda")
        if step == 2:
            del holder["filler"]
            torch.cuda.empty_cache()

    with warnings.catch_warnings(record=True) as seen, Inspector(model, log_dir=tmp_path, optimizer=opt, every_n_steps=2) as ins:
        warnings.simplefilter("always")
        for step in range(4):
            fill(step)
            loss = model(torch.randn(16, 4096, device="cuda")).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ins.step()
    tags = events(tmp_path).Tags()["scalars"]
    assert [e.step for e in events(tmp_path).Scalars("update_ratio_estimate/0.weight")] == [0]
    assert [e.step for e in events(tmp_path).Scalars("update_ratio/0.weight")] == [2]
    assert "update_ratio_estimate/2.weight" in tags
    assert len([w for w in seen if "does not fit in memory" in str(w.message)]) == 1


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce-overhead (CUDA graphs)"])
def test_a_compiled_llama_in_bfloat16_on_cuda_trains_bitwise_as_without_layerwatch(tmp_path, events, deterministic, mode):
    """The CPU's test on CUDA (tests/engine/test_compiled_transformers.py): Triton's kernels, where a kernel
    split in two would contract its multiply-adds otherwise; and under CUDA graphs, whose
    replays the eager re-run runs between."""
    pytest.importorskip("transformers")
    from compiled_runs import MEASURED, inspector_run, sampled_steps, training_gaps

    watched, plain = inspector_run(tmp_path, "cuda", mode), inspector_run(None, "cuda", mode)
    assert training_gaps(watched, plain) == {} and plain["dynamo"]["graphs"] >= 1
    assert sampled_steps(events(tmp_path)) == dict.fromkeys(MEASURED, [0, 1])


@pytest.mark.parametrize("door", ["Lightning", "Hugging Face"])
def test_a_compiled_llama_in_bfloat16_on_cuda_on_the_callbacks_trains_bitwise_as_without_them(tmp_path, events,
                                                                                           deterministic, door):
    pytest.importorskip("transformers")
    from compiled_runs import MEASURED, lightning_run, sampled_steps, trainer_run, training_gaps

    if door == "Lightning":
        from layerwatch import InspectCallback

        watched, plain = lightning_run([InspectCallback()], tmp_path / "watched", "cuda"), lightning_run([], tmp_path / "plain", "cuda")
        assert training_gaps(watched, plain) == {} and plain["dynamo"]["graphs"] >= 1
        assert sampled_steps(events(tmp_path / "watched" / "tb" / "version_0"), prefix="llama.") == dict.fromkeys(MEASURED, [0, 1])
    else:
        from layerwatch.huggingface import InspectTrainerCallback
        from hf_models import event_dirs

        watched, plain = trainer_run([InspectTrainerCallback()], tmp_path / "watched", "cuda"), trainer_run([], tmp_path / "plain", "cuda")
        assert training_gaps(watched, plain) == {} and plain["dynamo"]["graphs"] >= 1
        (run,) = event_dirs(tmp_path / "watched")
        assert sampled_steps(events(run)) == dict.fromkeys(MEASURED, [1, 2])


def test_a_compiled_models_re_run_on_cuda_adds_no_more_than_a_module_to_the_peak(tmp_path):
    """The re-run holds one module's outputs at a time (autograd off, measured as they come):
    a sampled step's peak allocated memory is the unsampled step's, within a module's output."""
    from models import SdpaLM

    torch.manual_seed(0)
    model = SdpaLM(vocab=256, d=256).cuda()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (16, 257), device="cuda")
    peaks = []
    with Inspector(compiled, log_dir=tmp_path, every_n_steps=2, optimizer=opt, output_head="head") as inspector:
        for step in range(6):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            loss = torch.nn.functional.cross_entropy(compiled(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            inspector.step()
    unsampled, sampled = max(peaks[3], peaks[5]), max(peaks[2], peaks[4])
    one_output = 16 * 256 * 256 * 4  # the head's logits, float32: the largest module output
    assert sampled <= unsampled + one_output, (sampled, unsampled, one_output)


def test_a_spike_on_cuda_is_found_once_its_copies_land_and_no_unsampled_step_waits(tmp_path, events):
    """The loss and the gradient norm on the GPU: each step's copies go to the host without a
    wait (sync debug "error" around every unsampled step's ``step()``); the batch scaled up 30
    times at step 40 is a spike found a step or so later, and the steps after it are sampled."""
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(model, log_dir=tmp_path, every_n_steps=1000, optimizer=opt) as inspector:
            for step in range(60):
                x = torch.randn(32, 8, device="cuda", generator=g) * (30 if step == 40 else 1)
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                opt.step()
                quiet = 0 < step < 40 and not inspector.sampled
                torch.cuda.set_sync_debug_mode("error" if quiet else "default")
                try:
                    inspector.step(loss=loss, grad_norm=norm)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            found = [(s.step, s.what) for s in inspector._engine._spikes.found]
    assert (40, "loss") in found and (40, "grad_norm") in found, found
    written = [s.step for s in events(tmp_path).Scalars("layerwatch/overhead_ms")]
    assert len([step for step in written if 40 < step <= 45]) == 3, written  # the capture, once its copies landed
    assert [s.step for s in events(tmp_path).Scalars("layerwatch/loss")][-1] == 40


@pytest.mark.parametrize("backend", [None, "inductor"], ids=["eager", "inductor"])
def test_flex_attention_on_cuda_gets_the_kernels_own_statistics_and_the_run_is_unchanged(tmp_path, events, backend):
    """The kernel asked for each row's largest score and logsumexp: each head's exact largest
    logit and mean min-entropy, the losses bitwise those without layerwatch (head size 32, 128
    query rows). Eager: the stand-in in torch's own compiled call (Triton's main kernel, not its
    decoding one); compiled with Inductor: on the re-run, whose eager call returns both."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from models import SdpaLM, lm_step, min_entropy_heads, tab_values

    def train(log_dir, seen=None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = SdpaLM(d=64, flex=True).cuda()
        if seen is not None:  # (not inside compiled code: a hook there would be compiled into it)
            for side in ("q", "k"):
                getattr(model.blocks[0].attn, side).register_forward_hook(
                    lambda module, args, out, side=side: None if torch.compiler.is_compiling()
                    else seen.setdefault(side, []).append(out.detach().clone()))
        call = model if backend is None else torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inspector = Inspector(call, log_dir=log_dir, every_n_steps=2, optimizer=opt).start() if log_dir else None
            for _ in range(5):
                losses.append(repr(lm_step(call, opt, torch.randint(0, 32, (2, 129), generator=generator).cuda()).item()))
                if inspector is not None:
                    inspector.step()
            if inspector is not None:
                inspector.finish()
        return losses

    seen = {}
    assert train(tmp_path, seen) == train(None)
    tab = tab_values(events(tmp_path))
    split = lambda t: t.view(2, 128, 2, 32).transpose(1, 2).cpu()  # noqa: E731
    for step in (0, 2, 4):
        call = step if backend is None else step // 2  # compiled: the re-runs' eager calls alone are seen
        expected = min_entropy_heads(split(seen["q"][call]), split(seen["k"][call]))
        assert tab["attention_logit_max/blocks.0.attn"][step] == pytest.approx(expected[:, 0].max().item(), rel=1e-3)
        assert tab["attention_entropy/blocks.0.attn"][step] == pytest.approx(expected[:, 1].min().item(), rel=1e-3)
