"""What the Hugging Face door's input hook costs on every step: the host time of one call per
training forward (it offers the engine a closure over the forward's inputs and notes the RNG
state, so that the step can be replayed), against the forward and backward it rides on.

    python benchmarks/hf_inputs.py [--calls 2000]

A tiny GPT-2 (2 layers, d=64) on the CPU, no step sampled; medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from layerwatch.engine.engine import Engine
from layerwatch.huggingface import _InputsKept
from layerwatch.options import validate_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (4, 16))
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(model, validate_options(schedule=lambda step: False), log_dir=tmp).start()
        hook = _InputsKept(engine, model, model)
        calls = []
        for k in range(args.calls):
            engine.begin_step(k)
            started = time.perf_counter()
            hook(model, (), {"input_ids": ids, "labels": ids})
            calls.append(time.perf_counter() - started)
            engine.end_step()
        engine.finish()
    steps = []
    for _ in range(30):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        steps.append(time.perf_counter() - started)
    print(f"torch {torch.__version__}, cpu ({torch.get_num_threads()} threads): input hook "
          f"{1e6 * statistics.median(calls):.1f} us per forward; forward and backward {1e3 * statistics.median(steps):.2f} ms")


if __name__ == "__main__":
    main()
