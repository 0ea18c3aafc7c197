"""Does sampling change a compiled GPT-2's run? Losses, weights, graphs, compile time, sampled and unsampled steps.

    python benchmarks/compiled_gpt2.py                       # GPT-2 small, 50 steps, Inductor, CPU
    python benchmarks/compiled_gpt2.py --backend aot_eager --steps 20
    python benchmarks/compiled_gpt2.py --every 5 --steps 30                 # sampled steps past compiling: their cost
    python benchmarks/compiled_gpt2.py --device cuda
    python benchmarks/compiled_gpt2.py --layers 2 --d 64 --vocab 256 --steps 8   # the tests' size
    python benchmarks/compiled_gpt2.py --layers 2 --d 64 --vocab 256 --steps 8 --dtype bfloat16 --deterministic
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/compiled_gpt2.py       # a cold compile

Three runs in one process from the same seed, the same batches and the same optimizer:
``GPT2LMHeadModel`` (transformers, dropout 0.1 as GPT-2 ships) under ``torch.compile(model)``,
AdamW, a plain loop, twice without layerwatch (the second run is the compiler's own noise:
Inductor's CPU kernels add some gradients atomically, in no fixed order), then with
``Inspector(compiled, optimizer=opt)`` at its defaults (the overhead budget chooses the
sampled steps; every step is checked by the NaN sentinel). ``--deterministic`` runs all three
under ``torch.use_deterministic_algorithms(True)``, where the compiler's code is reproducible
and so must layerwatch's run be, bitwise. Dynamo is reset before each run, so each compiles
from nothing (add ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` for Inductor's on-disk caches too).

Printed:
- the losses, with layerwatch and in the second run without: how many steps are bitwise equal
  to the first run's, and the largest relative difference of a step;
- the weights after the last step, likewise: bitwise equal, or the largest relative difference
  of a tensor (its largest absolute difference over its largest absolute value);
- Dynamo's counts per run: unique graphs, recompiles, graph breaks (with layerwatch, the
  same: nothing of it runs inside compiled code);
- compile time: the time a step that compiled took over the median step of its kind (sampled or
  not), summed over the run, with and without layerwatch;
- the unsampled steps: their median over the uninstrumented run's, from step 3 on (every graph
  compiled by then), the time taken with ``timing.Clock`` (a device synchronize per step on a GPU);
- with ``--every``, the sampled steps past compiling (from step 3 on): their median over the
  uninstrumented run's median step (a compiled model's sampled step adds its eager re-run).

``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from typing import Optional

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from layerwatch import Inspector


def gpt2(layers: int, d: int, heads: int, vocab: int, seq: int, dropout: float = 0.1) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=layers, n_head=heads,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def one_run(watched: bool, args: argparse.Namespace, log_dir: Optional[str] = None) -> dict:
    """One run from nothing: ``args`` as the command line's; with ``watched``, the Inspector at
    its defaults, writing to ``log_dir`` (a new temporary folder if None)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    model = gpt2(args.layers, args.d, args.heads, args.vocab, args.seq, args.dropout).to(args.device, dtype)
    model.train()
    compiled = torch.compile(model, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
               for _ in range(args.steps)]
    inspector: Optional[Inspector] = None
    sampled: list[bool] = []
    losses, times, compiled_at = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if watched:
            every = getattr(args, "every", None)
            inspector = Inspector(compiled, log_dir=log_dir or tempfile.mkdtemp(), optimizer=opt,
                                  **({} if every is None else {"every_n_steps": every})).start()
        for k, x in enumerate(batches):
            graphs = counters["stats"]["unique_graphs"]
            sampled.append(inspector is not None and inspector.sampled)  # the step open now
            sync(args.device)
            started = time.perf_counter()
            loss = compiled(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if inspector is not None:
                inspector.step()
            sync(args.device)
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
            if counters["stats"]["unique_graphs"] > graphs:
                compiled_at.append(k)
        if inspector is not None:
            inspector.finish()
    return {
        "losses": losses, "times": times, "sampled": sampled, "compiled_at": compiled_at,
        "weights": [p.detach().cpu().clone() for p in model.parameters()], **dynamo_counts(),
    }


def dynamo_counts() -> dict:
    """Dynamo's own counts since they were last cleared: unique graphs, recompiles, graph breaks."""
    return {"graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values()),
            "graph_breaks": sum(counters["graph_break"].values())}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compile_seconds(run: dict) -> float:
    """Time the compiling steps took over the median step of their kind (sampled or not)."""
    total = 0.0
    for k in run["compiled_at"]:
        same = [t for j, t in enumerate(run["times"]) if run["sampled"][j] == run["sampled"][k] and j not in run["compiled_at"]]
        total += run["times"][k] - (statistics.median(same) if same else 0.0)
    return total


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def difference(run: dict, plain: dict) -> dict:
    loss_rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(run["losses"], plain["losses"])]
    weights_rel = max(relative(a, b) for a, b in zip(run["weights"], plain["weights"]))
    return {"losses_bitwise_equal_steps": sum(r == 0 for r in loss_rel),
            "first_different_step": next((k for k, r in enumerate(loss_rel) if r), None),
            "loss_max_relative": max(loss_rel), "weights_bitwise_equal": weights_rel == 0.0,
            "weights_max_relative": weights_rel}


def compare(plain: dict, again: dict, watched: dict) -> dict:
    steady = [k for k in range(3, len(plain["times"])) if not watched["sampled"][k]
              and k not in watched["compiled_at"] and k not in plain["compiled_at"]]
    unsampled = (statistics.median(watched["times"][k] for k in steady) / statistics.median(plain["times"][k] for k in steady)
                 if steady else None)
    warm = [k for k in range(3, len(plain["times"])) if watched["sampled"][k] and k not in watched["compiled_at"]]
    plain_step = statistics.median(plain["times"][k] for k in range(3, len(plain["times"])) if k not in plain["compiled_at"])
    sampled = statistics.median(watched["times"][k] for k in warm) / plain_step if warm else None
    return {
        "steps": len(plain["losses"]), "watched": difference(watched, plain), "again": difference(again, plain),
        "graphs": {"plain": plain["graphs"], "watched": watched["graphs"]},
        "recompiles": {"plain": plain["recompiles"], "watched": watched["recompiles"]},
        "graph_breaks": {"plain": plain["graph_breaks"], "watched": watched["graph_breaks"]},
        "compile_s": {"plain": compile_seconds(plain), "watched": compile_seconds(watched)},
        "sampled_steps": [k for k, s in enumerate(watched["sampled"]) if s],
        "unsampled_step_ms": {"plain": 1e3 * statistics.median(plain["times"][k] for k in steady) if steady else None,
                              "watched": 1e3 * statistics.median(watched["times"][k] for k in steady) if steady else None},
        "unsampled_over_plain": unsampled,
        "sampled_step_ms": 1e3 * statistics.median(watched["times"][k] for k in warm) if warm else None,
        "sampled_over_plain": sampled,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--heads", type=int, default=0, help="default: d // 64")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dropout", type=float, default=0.1, help="GPT-2's three dropout probabilities")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the model's parameters and activations (bfloat16: sampled steps may round differently)")
    parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--every", type=int, default=None,
                        help="sample every N steps (default: the overhead budget's choice); gives sampled steps past compiling")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.heads = args.heads or max(1, args.d // 64)
    torch.use_deterministic_algorithms(args.deterministic)
    plain = one_run(False, args)
    again = one_run(False, args)
    watched = one_run(True, args)
    result = compare(plain, again, watched)
    result.update(model=f"GPT-2 {args.layers}x{args.d}, vocab {args.vocab}, batch {args.batch}x{args.seq}",
                  backend=args.backend, device=args.device if args.device == "cpu" else torch.cuda.get_device_name(),
                  torch=torch.__version__, deterministic=args.deterministic, dtype=args.dtype)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}, {args.dtype}, {args.backend}, {result['device']}, torch {torch.__version__}"
          f"{', deterministic algorithms' if args.deterministic else ''}, {result['steps']} steps, "
          f"sampled {result['sampled_steps']}")
    for key, label in (("watched", "with layerwatch"), ("again", "without, again")):
        d = result[key]
        print(f"{label}: losses {d['losses_bitwise_equal_steps']}/{result['steps']} steps bitwise equal, largest "
              f"relative difference {d['loss_max_relative']:.3g} (first at step {d['first_different_step']}); weights "
              f"{'bitwise equal' if d['weights_bitwise_equal'] else 'differ'}, largest relative difference "
              f"{d['weights_max_relative']:.3g}")
    for key in ("graphs", "recompiles", "graph_breaks"):
        print(f"{key}: without {result[key]['plain']}, with layerwatch {result[key]['watched']}")
    compile_s = result["compile_s"]
    print(f"compile time: without {compile_s['plain']:.1f} s, with layerwatch {compile_s['watched']:.1f} s "
          f"(ratio {compile_s['watched'] / max(compile_s['plain'], 1e-9):.2f})")
    if result["unsampled_over_plain"] is not None:
        ms = result["unsampled_step_ms"]
        print(f"unsampled step: {ms['watched']:.1f} ms against {ms['plain']:.1f} ms without "
              f"({result['unsampled_over_plain']:.3f}x)")
    if result["sampled_over_plain"] is not None:
        print(f"sampled step (past compiling): {result['sampled_step_ms']:.1f} ms, {result['sampled_over_plain']:.2f}x the "
              "step without layerwatch")


if __name__ == "__main__":
    main()
