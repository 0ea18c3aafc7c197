"""The alerts' calibration suite: small transformers that really learn, beside twins that fail.

Each case is a task, a family and a twin, trained from the same seed with AdamW (no weight decay):

- tasks (:data:`TASKS`): ``copy`` (the second half of each sequence repeats the first: an
  induction head must form), ``grammar`` (a fixed random Markov chain whose next token is one of
  three), ``classify`` (a label token at the end names the first token's class: only the last
  position is scored);
- families: Hugging Face's ``gpt2`` and ``llama``, their real classes built from tiny configs
  (nothing is downloaded);
- twins (:data:`TWINS`): ``healthy`` learns at a safe rate throughout; the failing ones
  ``ramp`` (the rate climbs geometrically once the loss has fallen: Wortsman et al. 2023's
  learning-rate sensitivity), ``jump`` (a high rate with no warm-up, from a step on: a restart
  whose schedule was lost; warm-up exists because of it, Goyal et al. 2017, and Zhai et al.
  2023 find entropy collapse there) and ``high`` (a constant rate too high: in 2-layer, 64-wide
  models it mostly stalls the loss rather than failing it; 4 layers, 128 wide fail at 6e-3 on
  the copy task).

**The failure**, fixed before any alert is looked at: the loss, as a mean over the last
``SMOOTH`` steps, back above the midpoint of its first such mean and its lowest so far, once it
had fallen by at least ``LEARNED`` of its first; or a non-finite loss. Each twin runs at the
defaults (the overhead budget) and at every 10 steps; the healthy twins also at every step
(``--every-step``). The table gives, per rule (alert kind), the alerts on healthy twins and
each failing twin's first-alert lead (failure step - alert step; negative: after it; ``-``:
none before the run ended).

    python benchmarks/divergence.py                        # the suite: docs/alerts.md's table
    python benchmarks/divergence.py --tasks copy --families llama --every 10
    python benchmarks/divergence.py --logdir runs/div      # keep the runs for TensorBoard
    python benchmarks/divergence.py --plain                # the twins without layerwatch: do they learn, do they fail?
    python benchmarks/divergence.py --tasks copy --twins healthy high --width 128 --layers 4 --high-lr 6e-3
                                                           # a constant rate too high, at a size where it fails
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

VOCAB, SEQ, BATCH = 64, 32, 16
WIDTH, LAYERS, HEADS = 64, 2, 4
SMOOTH = 10  # steps the loss is averaged over for the failure's definition
LEARNED = 0.2  # the share of its first value the loss must have shed before a rise counts as a failure
STEPS = 450
SAFE_LR = 1e-3


def copy_batches(generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The second half repeats the first: the loss can fall from log(64) = 4.16 to half of it."""
    half = SEQ // 2
    while True:
        first = torch.randint(1, VOCAB, (BATCH, half), generator=generator)
        ids = torch.cat([first, first], dim=1)
        yield ids, ids


def grammar_batches(generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed random Markov chain whose next token is one of 3 likely ones: 4.16 down to about 1.1."""
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=generator)
    while True:
        ids = torch.empty(BATCH, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=generator)
        for t in range(1, SEQ):
            pick = torch.randint(0, 3, (BATCH,), generator=generator)
            ids[:, t] = successors[ids[:, t - 1], pick]
        yield ids, ids


CLASSES, CLASSIFY_LENGTH = 4, 8


def classify_batches(generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, then a label token: the first token's class (its value mod 4). Only the
    label is scored: the loss falls from log(64) through log(4) = 1.39 to near 0."""
    while True:
        ids = torch.randint(CLASSES, VOCAB, (BATCH, CLASSIFY_LENGTH), generator=generator)
        ids[:, -1] = ids[:, 0] % CLASSES
        labels = torch.full_like(ids, -100)
        labels[:, -1] = ids[:, -1]
        yield ids, labels


TASKS: dict[str, Callable[[torch.Generator], Iterator[tuple[torch.Tensor, torch.Tensor]]]] = {
    "copy": copy_batches, "grammar": grammar_batches, "classify": classify_batches}


def build(family: str, init_scale: float = 1.0) -> torch.nn.Module:
    """A ``LAYERS``-layer, ``WIDTH``-wide model of ``family`` with ``HEADS`` heads; ``init_scale``: its matrices' initial values times this."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif family == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                          num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"family must be 'gpt2' or 'llama', got {family!r}")
    if init_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(init_scale)
    return model


@dataclass(frozen=True)
class Twin:
    """How a twin's learning rate goes: ``lr`` at first; from step ``ramp_from`` on, times
    ``jump`` at once and times ``ramp`` a step; its matrices initialized ``init_scale`` times larger."""

    lr: float = SAFE_LR
    ramp: float = 1.0
    ramp_from: int = 0
    jump: float = 1.0
    init_scale: float = 1.0

    def lr_at(self, step: int) -> float:
        if step < self.ramp_from:
            return self.lr
        return self.lr * self.jump * self.ramp ** (step - self.ramp_from)


TWINS = {
    "healthy": Twin(),
    "ramp": Twin(ramp=1.04, ramp_from=150),
    "jump": Twin(jump=30.0, ramp_from=200),
    "high": Twin(lr=1.5e-2),
}


@dataclass
class Outcome:
    """One run: where it failed (None: it did not), its lowest smoothed loss, its alerts (kind,
    layer, step, message), the intervals the schedule went through."""

    task: str
    family: str
    twin: str
    schedule: str
    steps: int
    first: float
    lowest: float
    failure: Optional[int]
    alerts: list[tuple[str, str, int, str]] = field(default_factory=list)
    given_back: float = 0.0
    seconds: float = 0.0

    def lead(self, kind: Optional[str] = None) -> Optional[int]:
        """Failure step - the first alert's (of ``kind``) step; None: no failure, or no alert."""
        steps = [step for k, _, step, _ in self.alerts if kind is None or k == kind]
        return None if self.failure is None or not steps else self.failure - min(steps)


class FailureWatch:
    """The failure's definition (see the module's docstring), step by step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first: Optional[float] = None
        self.lowest = math.inf
        self.most_given_back = 0.0  # of its progress, once learned (LossProgress.given_back)

    def failed(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        self.losses.append(loss)
        if len(self.losses) < SMOOTH:
            return False
        mean = sum(self.losses[-SMOOTH:]) / SMOOTH
        if self.first is None:
            self.first = mean
        self.lowest = min(self.lowest, mean)
        learned = self.lowest <= (1 - LEARNED) * self.first
        if learned:
            self.most_given_back = max(self.most_given_back, (mean - self.lowest) / (self.first - self.lowest))
        return self.lowest <= (1 - LEARNED) * self.first and mean > (self.first + self.lowest) / 2


def run(task: str, family: str, twin: str, schedule: str, steps: int = STEPS, log_dir: Optional[Path] = None,
        after: int = 20) -> Outcome:
    """One case; ``schedule``: ``"defaults"``, ``"every N"``, or ``"plain"`` (no layerwatch).
    The run goes on ``after`` steps past its failure (the alerts then are not leads). Deterministic,
    on one thread; the process's settings are put back after."""
    deterministic, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        return _case(task, family, twin, schedule, steps, log_dir, after)
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_num_threads(threads)


def _case(task: str, family: str, twin: str, schedule: str, steps: int, log_dir: Optional[Path], after: int) -> Outcome:
    from layerwatch import Inspector

    how = TWINS[twin]
    net = build(family, how.init_scale)
    opt = torch.optim.AdamW(net.parameters(), lr=how.lr, weight_decay=0.0)
    batches = TASKS[task](torch.Generator().manual_seed(1))
    watch = FailureWatch()
    failure, done = None, 0
    started = time.perf_counter()
    inspector = None
    if schedule != "plain":
        every = None if schedule == "defaults" else int(schedule.split()[1])
        inspector = Inspector(net, log_dir=log_dir or Path(tempfile.mkdtemp(prefix="divergence-")), optimizer=opt,
                              **({} if every is None else {"every_n_steps": every}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if inspector is not None:
            inspector.__enter__()
        try:
            for step in range(steps):
                for group in opt.param_groups:
                    group["lr"] = how.lr_at(step)
                ids, labels = next(batches)
                loss = net(input_ids=ids, labels=labels).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                if inspector is not None:
                    inspector.step(loss=loss)
                done = step + 1
                if failure is None and watch.failed(loss.item()):
                    failure = step
                if failure is not None and step >= failure + after:
                    break
        finally:
            if inspector is not None:
                inspector.__exit__(None, None, None)
    alerts = [] if inspector is None else [(a.kind, a.name, a.step, a.message) for a in inspector.alerts]
    return Outcome(task, family, twin, schedule, done, watch.first or math.nan, watch.lowest, failure, alerts,
                   watch.most_given_back, time.perf_counter() - started)


def _run(args: tuple) -> Outcome:
    """One case in a worker: the model's size and the ``high`` twin's rate set first (a spawned worker's own globals)."""
    global WIDTH, LAYERS
    *case, (WIDTH, LAYERS, high_lr) = args
    TWINS["high"] = Twin(lr=high_lr)
    return run(*case)


def table(outcomes: list[Outcome]) -> str:
    """One Markdown table: per rule, the alerts on healthy twins (count of runs that raised one /
    runs) and each failing twin's first-alert lead, over the cases; the first row is any rule."""
    kinds = sorted({k for o in outcomes for k, _, _, _ in o.alerts})
    schedules = sorted({o.schedule for o in outcomes}, key=lambda s: (s != "defaults", s))
    failing = sorted({o.twin for o in outcomes if o.twin != "healthy"}, key=list(TWINS).index)
    head = ["rule", "schedule", "healthy: runs alerted"] + [f"{t}: leads (steps)" for t in failing]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in [None, *kinds]:
        for schedule in schedules:
            cells = [kind or "**any**", schedule]
            healthy = [o for o in outcomes if o.twin == "healthy" and o.schedule == schedule]
            alerted = [o for o in healthy if any(kind is None or k == kind for k, _, _, _ in o.alerts)]
            cells.append(f"{len(alerted)}/{len(healthy)}" if healthy else "")
            for twin in failing:
                runs = [o for o in outcomes if o.twin == twin and o.schedule == schedule]
                cells.append(" ".join(_lead(o.lead(kind)) if o.failure is not None else "nf" for o in runs))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _lead(lead: Optional[int]) -> str:
    return "-" if lead is None else f"{lead:+d}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--twins", nargs="+", default=list(TWINS), choices=list(TWINS))
    parser.add_argument("--every", nargs="*", type=int, default=[10], help="fixed intervals to run besides the defaults")
    parser.add_argument("--no-defaults", action="store_true", help="leave out the runs at the defaults")
    parser.add_argument("--every-step", action="store_true", help="the healthy twins sampled at every step too")
    parser.add_argument("--plain", action="store_true", help="without layerwatch: the losses and failures alone")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--width", type=int, default=WIDTH, help="the models' width (heads: 4)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="the models' layers")
    parser.add_argument("--high-lr", type=float, default=TWINS["high"].lr, help="the high twin's constant rate")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--logdir", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true", help="print each run's alerts")
    args = parser.parse_args(argv)
    schedules = ["plain"] if args.plain else ([] if args.no_defaults else ["defaults"]) + [f"every {n}" for n in args.every]
    cases = []
    for task in args.tasks:
        for family in args.families:
            for twin in args.twins:
                for schedule in schedules + (["every 1"] if args.every_step and twin == "healthy" else []):
                    log_dir = None if args.logdir is None else args.logdir / f"{task}-{family}-{twin}-{schedule.replace(' ', '')}"
                    cases.append((task, family, twin, schedule, args.steps, log_dir,
                                  (args.width, args.layers, args.high_lr)))
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        outcomes = pool.map(_run, cases, chunksize=1)
    for o in outcomes:
        first_alert = min(o.alerts, key=lambda a: a[2]) if o.alerts else None
        print(f"{o.task:8s} {o.family:5s} {o.twin:7s} {o.schedule:8s}: loss {o.first:.2f} -> lowest {o.lowest:.2f}, "
              f"gave back {o.given_back:.0%}, failure {o.failure if o.failure is not None else '-':>4}, {len(o.alerts):2d} alerts, first: "
              + (f"{first_alert[0]} on {first_alert[1]} at {first_alert[2]}" if first_alert else "none")
              + f" ({o.seconds:.0f} s)")
        if args.verbose:
            for kind, name, step, message in sorted(o.alerts, key=lambda a: a[2]):
                print(f"      {step:4d} {kind:17s} {name}: {message[:160]}")
    if not args.plain:
        print()
        print(table(outcomes))
    print(f"\n{len(cases)} runs in {time.perf_counter() - started:.0f} s")
    if args.plain:
        return 0
    healthy_quiet = all(not o.alerts for o in outcomes if o.twin == "healthy")
    failing_led = all((o.lead() or 0) > 0 for o in outcomes if o.twin != "healthy" and o.failure is not None)
    return 0 if healthy_quiet and failing_led else 1


if __name__ == "__main__":
    raise SystemExit(main())
