"""What the ``moe`` family costs a sampled step: a tiny Mixtral and a wide one with 64 experts.

    python benchmarks/moe.py [--rounds 7] [--steps 5] [--workloads mixtral-8,mixtral-64] [--compiled]

Each workload is transformers' ``MixtralForCausalLM`` (built from a config, nothing downloaded),
trained with AdamW. Rounds of, in one process: steps without layerwatch (base), steps sampled
at every step with every family but ``moe``, and steps sampled with every family (the
defaults). Reported, medians over rounds of the mean step time:

    base         the training step alone
    sampled      a sampled step without the moe family, against base
    +moe         a sampled step with it, against base
    moe adds     the difference, in ms and as a share of the sampled step
    calls        Python calls the moe family adds to a sampled step (``sys.setprofile``), in all and
                 per router: the same for 8 experts as for 64 (O(1) host calls per router)

Both workloads have 4 routers. Unsampled steps are not measured here: nothing of the family
is on the model between samples (``tests/probes/test_routers.py`` checks that no hook is).

``--compiled``: the tiny Mixtral compiled, in bfloat16, trained 4 steps with and without the
Inspector at its defaults: the losses and the final weights bitwise, and Dynamo's graphs,
recompiles and graph breaks, which must be the same (the routers are measured on the eager
re-run of each sampled step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from layerwatch import Inspector
from layerwatch.vocabulary import FAMILIES, Family

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import counted_calls  # noqa: E402

WORKLOADS = {  # name: (experts, top_k, hidden, expert width, tokens per batch row)
    "mixtral-8": (8, 2, 64, 128, 128),
    "mixtral-64": (64, 4, 128, 64, 128),
}
LAYERS, BATCH, VOCAB = 4, 4, 256


def mixtral(experts: int, top_k: int, hidden: int, width: int, layers: int = LAYERS) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=width,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=hidden // 4, num_local_experts=experts, num_experts_per_tok=top_k,
                                        max_position_embeddings=256)
    return transformers.MixtralForCausalLM(config)


def moe_calls(experts: int, top_k: int = 2, hidden: int = 64, width: int = 64, seq: int = 16,
              layers: int = LAYERS) -> int:
    """The Python calls the moe family adds to a sampled step of a Mixtral with ``experts``."""
    model = mixtral(experts, top_k, hidden, width, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    calls = []
    for families in (tuple(f for f in FAMILIES if f != Family.MOE), FAMILIES):
        with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inspector = Inspector(model, log_dir=log_dir, every_n_steps=1, optimizer=opt, families=families).start()

            def step() -> None:
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                inspector.step()

            try:
                step()
                step()  # the layer table, first plans
                calls.append(counted_calls(step))
            finally:
                inspector.finish()
    return calls[1] - calls[0]


def timed_steps(name: str, rounds: int, steps: int) -> dict:
    experts, top_k, hidden, width, seq = WORKLOADS[name]
    model = mixtral(experts, top_k, hidden, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    without = tuple(f for f in FAMILIES if f != Family.MOE)
    cases = {"base": None, "sampled": without, "+moe": FAMILIES}
    times: dict[str, list[float]] = {case: [] for case in cases}

    def step(x: torch.Tensor, inspector) -> None:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if inspector is not None:
            inspector.step()

    for r in range(rounds):
        for case, families in cases.items():
            with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                inspector = None if families is None else Inspector(
                    model, log_dir=log_dir, every_n_steps=1, optimizer=opt, families=families).start()
                try:
                    for x in batches[:2]:  # warm-up: the layer table, first plans
                        step(x, inspector)
                    start = time.perf_counter()
                    for x in batches:
                        step(x, inspector)
                    times[case].append((time.perf_counter() - start) / len(batches))
                finally:
                    if inspector is not None:
                        inspector.finish()
    ms = {case: 1e3 * statistics.median(values) for case, values in times.items()}
    added_calls = moe_calls(experts, top_k, hidden, width, seq)
    return {"workload": f"{name} ({experts} experts, top-{top_k})", **ms, "moe_ms": ms["+moe"] - ms["sampled"],
            "calls": added_calls, "calls_per_router": added_calls / LAYERS}


def compiled_check() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    torch.use_deterministic_algorithms(True)
    from compiled_runs import inspector_run, training_gaps
    from hf_models import tiny_moe

    def make():
        return tiny_moe("mixtral", vocab=256)

    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watched, plain = inspector_run(log_dir, make=make), inspector_run(None, make=make)
    gaps = training_gaps(watched, plain)
    print(f"compiled tiny Mixtral, bfloat16, 4 steps: {'bitwise the same' if not gaps else gaps}; "
          f"Dynamo with layerwatch {watched['dynamo']}, without {plain['dynamo']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and case")
    parser.add_argument("--compiled", action="store_true", help="the compiled bitwise check instead")
    args = parser.parse_args()
    if args.compiled:
        compiled_check()
        return
    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}, rounds={args.rounds}, steps={args.steps}, "
          f"{LAYERS} routers, batch {BATCH}")
    print("| workload | base step | sampled (no moe) | sampled (+moe) | moe adds | moe / sampled | calls moe adds | per router |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        r = timed_steps(name, args.rounds, args.steps)
        print(f"| {r['workload']} | {r['base']:.1f} ms | {r['sampled']:.1f} ms | {r['+moe']:.1f} ms | "
              f"{r['moe_ms']:.2f} ms | {100 * r['moe_ms'] / r['sampled']:.1f}% | {r['calls']} | {r['calls_per_router']:.0f} |")


if __name__ == "__main__":
    main()
