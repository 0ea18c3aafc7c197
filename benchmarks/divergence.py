"""A transformer that learns, then diverges: does layerwatch say so before it fails?

A small GPT-2 (Hugging Face's, built from its config; nothing is downloaded) learns a fixed
random Markov chain over a small vocabulary at a safe learning rate, then its learning rate is
raised by a factor each step until training fails: the loss turns non-finite, or climbs back
above the midpoint between its first value and its lowest. Watched at the defaults but for the
interval (``--every``), it reports the step of the failure, the step and kind of layerwatch's
first alert, and the lead time in steps; then the same run at the safe learning rate
throughout, where no alert may come.

    python benchmarks/divergence.py                       # the table in docs/reading-charts.md
    python benchmarks/divergence.py --logdir runs/div     # keep the runs for TensorBoard
"""

from __future__ import annotations

import argparse
import math
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from layerwatch import Inspector

VOCAB, SEQ, BATCH = 64, 32, 16


def markov_batches(seed: int = 0):
    """Batches of a fixed random Markov chain whose next token is one of 3 likely ones: the
    loss can fall from log(64) = 4.16 to about 1.1."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=generator)
    while True:
        ids = torch.empty(BATCH, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=generator)
        for t in range(1, SEQ):
            pick = torch.randint(0, 3, (BATCH,), generator=generator)
            ids[:, t] = successors[ids[:, t - 1], pick]
        yield ids


def model():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def run(log_dir: Path, *, learn: int, ramp: Optional[float], lr: float, every: int, max_steps: int) -> dict:
    """``learn`` steps at ``lr``, then (``ramp``) the learning rate times ``ramp`` each step, to
    ``max_steps`` or the failure."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    batches = markov_batches()
    losses: list[float] = []
    failure = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Inspector(net, log_dir=log_dir, every_n_steps=every, optimizer=opt) as inspector:
            for step in range(max_steps):
                if ramp is not None and step >= learn:
                    for group in opt.param_groups:
                        group["lr"] *= ramp
                ids = next(batches)
                loss = net(input_ids=ids, labels=ids).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                inspector.step(loss=loss)
                value = loss.item()
                losses.append(value)
                lowest = min(losses)
                if not math.isfinite(value) or (step > learn and value > (losses[0] + lowest) / 2):
                    failure = step
                    break
    alerts = sorted(inspector.alerts, key=lambda a: a.step)
    first = alerts[0] if alerts else None
    return {"failure": failure, "steps": len(losses), "lowest": min(losses), "first": first, "alerts": alerts,
            "lr_at_failure": opt.param_groups[0]["lr"]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learn", type=int, default=150, help="steps at the safe learning rate first")
    parser.add_argument("--lr", type=float, default=1e-3, help="the safe learning rate")
    parser.add_argument("--ramp", type=float, default=1.04, help="the learning rate's factor each step after --learn")
    parser.add_argument("--every", type=int, default=2, help="sample every this many steps")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--logdir", type=Path, default=None)
    args = parser.parse_args(argv)
    root = args.logdir or Path(tempfile.mkdtemp(prefix="divergence-"))
    rows = []
    for name, ramp in (("diverging", args.ramp), ("safe", None)):
        result = run(root / name, learn=args.learn, ramp=ramp, lr=args.lr, every=args.every, max_steps=args.max_steps)
        first = result["first"]
        lead = None if first is None or result["failure"] is None else result["failure"] - first.step
        rows.append((name, result, lead))
        print(f"{name}: {result['steps']} steps, lowest loss {result['lowest']:.3f}, failure at "
              f"{result['failure'] if result['failure'] is not None else 'none'} (lr {result['lr_at_failure']:.3g}); first alert: "
              f"{f'{first.kind} at step {first.step} on {first.name}' if first else 'none'}; lead {lead if lead is not None else '-'} steps")
        for alert in result["alerts"][:12]:
            print(f"    {alert.step:4d} {alert.kind:18s} {alert.name}: {alert.message[:140]}")
    print(f"logs: {root}")
    diverging, safe = rows[0][1], rows[1][1]
    ok = diverging["failure"] is not None and rows[0][2] is not None and rows[0][2] > 0 and not safe["alerts"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
