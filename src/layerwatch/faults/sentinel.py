"""The NaN sentinel: a fused finiteness check of the gradients between samples.

``check_next`` runs, on each share of whole plain gradients, the one in-place multi-tensor
kernel of mixed precision's loss scaler (``torch._amp_foreach_non_finite_check_and_unscale_``
at an inverse scale of 1.0: it writes each value back unchanged and sets one flag when any is
NaN or Inf), so the host's work is one launch per device and dtype and no tensor per gradient;
the CUDA kernel takes float16, float32 and float64 (bfloat16 only on the CPU): other dtypes, slices
of large gradients and DTensor shards get ``check``'s norms instead (``torch._foreach_norm``,
accumulated in float32 at least: NaN or Inf when a value is; finite values read as non-finite
only when a gradient's norm passes ~1.8e19, an explosion in any case). Either starts a
non-blocking copy to the host; ``poll`` reads the copies that have landed, a step or more
later on a GPU, at once on the CPU. Nothing waits on the device.

A flag says that a share held NaN/Inf, not which gradient: where its gradients are still at
hand (on the CPU, read at once; on a GPU, a check waited for before the optimizer step) their
norms name them; a flag that lands a step later names none (``Finding.unnamed``), and the
sample it asks for shows the modules.

On a GPU every gradient is checked on every step: the pass costs the device microseconds
and the host one launch. On the CPU the pass is a synchronous read of memory, several per
cent of a short step, so each step checks the next share of the gradients in turn, at most
``1 / CPU_ROTATION`` of their bytes (or ``CPU_MIN_BYTES``; a gradient larger than that is
checked a slice a step) and at most ``CPU_MAX_TENSORS`` tensors (the host's work is per tensor,
whatever its bytes): every value is checked at least every ``rotation`` steps
(``CPU_ROTATION``, more for a model of many tensors). A NaN that stays (weights updated with
it stay NaN) is found within that many steps; a NaN in a single step's gradients may be
missed there.

Where the check costs the host more than its share of the overhead budget, the budget spreads
it over more steps (``watch(..., spread=)``, on a GPU as on the CPU): a share then holds at
most a ``spread``-th of the tensors, and a NaN in a single step's gradients
outside that step's share is found when it reaches the weights (their gradients turn NaN too).

On the CPU, ``ord=inf`` (which never overflows) runs 10x slower and ``ord=1`` 2x slower.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from layerwatch.distributed.sharding import is_dtensor
from layerwatch.guards.hooks import is_compiling
from layerwatch import stats as S
from layerwatch.stats import norms as N  # as a module: a test counts its calls


@dataclass
class Finding:
    """A step whose gradients held NaN or Inf."""

    step: int
    tensors: list[str]  # the parameters whose gradient held them
    stepped: Optional[bool]  # whether the optimizer stepped (False: a GradScaler skip); None: unknown
    nan: bool  # NaN/Inf values for certain (a NaN norm, a flag); else only infinite norms (finite values past ~1.8e19 give them)
    rotation: int = 1  # steps the sentinel took to check every gradient once (see NonfiniteSentinel.rotation)
    seen_by: str = ""  # who found it, when not the sentinel's own check (DeepSpeed's skip of the step)
    unnamed: bool = False  # a flag landed after its gradients were gone: ``tensors`` are not known


CPU_ROTATION = 32  # a 32nd of the bytes: about 0.3 ms of a 45 ms CPU step, read from memory
CPU_MIN_BYTES = 1 << 18
CPU_MAX_TENSORS = 16  # a CPU share's tensors: a norm costs the host ~1 us a tensor, however small


Piece = tuple[str, torch.nn.Parameter, Optional[slice]]  # a parameter's gradient, or the slice of its values to check
class KeptFlag:
    """The sentinel's flag kept between steps on the CPU: a float32 tensor over memory the host
    reads as a Python array (reading it dispatches no op). A copy is a new flag over memory of
    its own: the tensor and the array copied apart would no longer share it."""

    __slots__ = ("memory", "tensor")

    def __init__(self) -> None:
        self.memory = array.array("f", [0.0])
        self.tensor = torch.frombuffer(self.memory, dtype=torch.float32)

    def __deepcopy__(self, memo: dict) -> "KeptFlag":
        return KeptFlag()

    def __reduce__(self) -> tuple[type, tuple]:
        return KeptFlag, ()


# whole gradients of one device and dtype, their names, and for the flag kernel (None: norms instead) its inverse
# scale (1.0, on their device) and the flag kept between steps (None: the share is read later, a fresh flag a step)
Group = tuple[list[torch.nn.Parameter], list[str], Optional[torch.Tensor], Optional[KeptFlag]]
# peaks or a flag, the names, a flag's parameters (None: peaks), whether a non-finite peak is a NaN/Inf value for certain
Check = tuple[torch.Tensor, list[str], Optional[list[torch.nn.Parameter]], bool]


class NonfiniteSentinel:
    def __init__(self) -> None:
        # the checks enqueued, not yet read: [step, what each keeps (names, a flag's parameters, certain),
        # their host copies, stepped], read once the copies landed
        self._pending = S.Landings()
        self._shares: list[list[Piece]] = []
        self._plans: list[Optional[list[Group]]] = []  # per share, when it is whole plain gradients
        self._free: list[bool] = []  # per share: whether the host reads all its checks at once (the CPU's)
        self._ones: dict[torch.device, torch.Tensor] = {}  # the fused check's inverse scale, 1.0, per device
        self._kept: Optional[KeptFlag] = None  # the CPU's flag kept between steps
        self.lands_later: Optional[bool] = None  # not known before watch(): taken as later (see Faults.check)
        self._next = 0

    def watch(self, params: Sequence[tuple[str, torch.nn.Parameter]], local: Any, spread: int = 1) -> None:
        """The parameters to check, split into the shares checked in turn (one on a GPU); a
        gradient larger than a share is split into slices of its values. ``local`` maps a
        gradient to the part this rank holds. ``spread``: check them over at least that many
        steps, a share holding at most ``1 / spread`` of the gradient tensors (the overhead
        budget's doing, when the check costs the host more than its share of it)."""
        self._local = local
        params = [(name, p) for name, p in params if p.requires_grad]  # a frozen one never has a gradient
        on_gpu = any(p.device.type != "cpu" for _, p in params)
        self.lands_later = any(not S.host_reads_free(p.device) for _, p in params)  # read later, or waited for (a sync)
        total = sum(p.numel() * p.element_size() for _, p in params)
        budget = total if on_gpu else max(CPU_MIN_BYTES, -(-total // CPU_ROTATION))
        most = max(-(-len(params) // spread), 1)  # tensors a share may hold: its host work is per tensor
        most = most if on_gpu else min(most, CPU_MAX_TENSORS)
        self._shares, share, size = [], [], 0
        for name, p in params:
            nbytes = p.numel() * p.element_size()
            per_slice = max(budget // max(p.element_size(), 1), 1)
            pieces = [(None, nbytes)] if nbytes <= budget else [
                (slice(start, start + per_slice), min(per_slice, p.numel() - start) * p.element_size())
                for start in range(0, p.numel(), per_slice)
            ]
            for values, piece_bytes in pieces:
                if share and (size + piece_bytes > budget or len(share) == most):
                    self._shares.append(share)
                    share, size = [], 0
                share.append((name, p, values))
                size += piece_bytes
        if share:
            self._shares.append(share)
        self._free = [all(S.host_reads_free(p.device) for _, p, _ in share) for share in self._shares]
        self._plans = [self._plan(share, free) for share, free in zip(self._shares, self._free)]

    @property
    def rotation(self) -> int:
        """Steps it takes to check every gradient once."""
        return max(len(self._shares), 1)

    def check_next(self, step: int, stepped: Optional[bool]) -> None:
        """Enqueue the check of this step's share of the gradients."""
        if not self._shares:
            return
        index = self._next % len(self._shares)
        self._next += 1
        plan = self._plans[index]
        if plan is not None:  # no tensor per gradient: one kernel per device and dtype
            checks: Optional[list[Check]] = []
            try:
                for params, names, ones, kept in plan:
                    grads = [p.grad for p in params]
                    if ones is None:  # a dtype the kernel does not take
                        checks.append((N.stacked_norms(grads), names, None, False))
                        continue
                    # The loss scaler's kernel at an inverse scale of 1.0 (``ones``) writes every value back as it
                    # was and sets the flag on a NaN or Inf; a flag kept between steps (read at once), else a fresh one
                    flag = torch.zeros(1, dtype=torch.float32, device=ones.device) if kept is None else kept.tensor
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, ones)
                    checks.append((flag, names, params, True))
            except (TypeError, RuntimeError):  # a gradient missing (unused this step), sparse, or expanded (not writable)
                if self._kept is not None:  # a group flagged before the failure: the norms check it again
                    self._kept.tensor.zero_()
                checks = None
            if checks is not None:
                self._enqueue(step, checks, stepped, self._free[index])
                return
        share = self._shares[index]
        local = self._local
        named = [(n, local(p.grad), values) for n, p, values in share if p.grad is not None and not p.grad.is_sparse]
        self.check(step, [(n, g if values is None else g.reshape(-1)[values]) for n, g, values in named], stepped)

    def check(self, step: int, named_grads: Sequence[tuple[str, torch.Tensor]], stepped: Optional[bool]) -> None:
        """Enqueue the check of ``step``'s gradients."""
        if not named_grads:
            return
        groups = N.fused_norms([grad for _, grad in named_grads])
        free = all(S.host_reads_free(peaks.device) for _, peaks in groups)
        checks: list[Check] = [(peaks, [named_grads[i][0] for i in indices], None, False) for indices, peaks in groups]
        self._enqueue(step, checks, stepped, free)

    def _plan(self, share: list[Piece], free: bool) -> Optional[list[Group]]:
        """``share``'s parameters grouped by device and dtype, when each is checked whole and is a
        plain tensor (no DTensor to take the local part of); else None. ``free``: the share is
        read at once, so its flags are kept between steps (the kernel only ever sets one; a hit
        zeroes it): one op fewer a step."""
        if any(values is not None or is_dtensor(p) for _, p, values in share):
            return None
        params = [p for _, p, _ in share]
        plan: list[Group] = []
        for indices in N.device_dtype_groups(params):
            group, device = [params[i] for i in indices], params[indices[0]].device
            ones = kept = None
            if _flagged(group[0]):
                if device not in self._ones:
                    self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
                ones, kept = self._ones[device], self._cpu_flag() if free and device.type == "cpu" else None
            plan.append((group, [share[i][0] for i in indices], ones, kept))
        return plan

    def _cpu_flag(self) -> KeptFlag:
        if self._kept is None:
            self._kept = KeptFlag()
        return self._kept

    def _enqueue(self, step: int, checks: list[Check], stepped: Optional[bool], free: bool) -> None:
        """Read the checks at once where that is ``free`` (the CPU), else start their copies to the host."""
        if free:  # read at once: nothing waits
            kept = self._kept
            hits = [check for check in checks if _hit(check, kept)]
            if hits:  # a flag's gradients are at hand: their peaks name them
                self._pending.add(*_landed(step, [_named(*check) for check in hits], stepped))
                for t, _, params, _ in hits:
                    if params is not None:
                        t.zero_()
            return
        self._pending.add(*_landed(step, checks, stepped))

    def poll(self, wait: bool = False, at_hand: Optional[int] = None) -> list[Finding]:
        """The checks that have landed, oldest first, that found a NaN or Inf. With ``wait``,
        every check enqueued so far: on a GPU the host waits for them (a device sync).
        ``at_hand``: the step whose gradients are still those checked (a flag's are named)."""
        found = []
        for step, kept, copies, stepped in self._pending.landed(wait):
            names: list[str] = []
            nan = unnamed = False
            for host, (group, params, certain) in zip(copies, kept):
                values = host.tolist()  # a landed host copy: reading it waits for nothing
                if params is not None:  # a flag: set when some value of the group's is NaN or Inf
                    if values[0]:
                        nan = True
                        named = _offenders(group, params) if step == at_hand else []
                        names += named
                        unnamed = unnamed or not named
                    continue
                bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
                names += [group[i] for i in bad]
                nan = nan or (bool(bad) and certain) or any(math.isnan(values[i]) for i in bad)
            if names or unnamed:  # a parameter's slices: named once
                found.append(Finding(step, list(dict.fromkeys(names)), stepped, nan, self.rotation, unnamed=unnamed))
        return found

    def settle(self, step: int, stepped: Optional[bool]) -> None:
        """Whether the optimizer stepped, for the checks of ``step`` enqueued before it knew
        (before the optimizer step: a GradScaler may still skip it)."""
        for kept, _ in self._pending.entries:
            if kept[0] == step and kept[3] is None:
                kept[3] = stepped

    def clear(self) -> None:
        self._pending.clear()


class StepCounter:
    """Counts the steps of the optimizers it tracks (a post-hook each), so that a step an
    optimizer skipped (a GradScaler overflow) is told from a fault. ``remove()`` is safe twice.

    A compiled ``optimizer.step`` runs no hook: traced, the hook only notes that it was
    (a store Dynamo replays after the compiled step; reading the count there would guard the
    compiled step on its value and recompile it every step), and the count is unknown from
    then on."""

    def __init__(self) -> None:
        self._count: Optional[list[int]] = None
        self._compiled = [False]
        self._handles: list[Any] = []
        self._seen = 0

    def track(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        counter = self._count = self._count or [0]
        compiled = self._compiled

        def count(*_: Any) -> None:
            if is_compiling():
                compiled[0] = True
                return
            counter[0] += 1

        self._handles += [optimizer.register_step_post_hook(count) for optimizer in optimizers]

    def add(self, stepped: bool) -> None:
        """Count one optimizer step the caller saw (or saw skipped), without a hook."""
        self._count = self._count or [0]
        self._count[0] += int(stepped)

    @property
    def count(self) -> Optional[int]:
        """Optimizer steps so far; None when no optimizer is tracked or a step ran compiled."""
        return None if self._count is None or self._compiled[0] else self._count[0]

    def stepped_since_last_check(self) -> Optional[bool]:
        """Whether an optimizer stepped since the last call (None: not known)."""
        if self.count is None:
            return None
        stepped, self._seen = self._count[0] != self._seen, self._count[0]
        return stepped

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _flagged(p: torch.Tensor) -> bool:
    """Whether the fused flag kernel takes ``p``'s gradients (their dtype, on their device)."""
    return p.dtype in (torch.float16, torch.float32, torch.float64) or (p.dtype == torch.bfloat16 and p.device.type == "cpu")


def _hit(check: Check, kept: Optional[KeptFlag]) -> bool:
    """Whether a check read at once found a NaN or Inf: its flag set (the ``kept`` flag read in
    its memory), or a norm not finite. Only where the host reads it freely (the CPU: a read of
    memory, no sync), one read a group."""
    t, _, params, _ = check
    if params is None:
        return not math.isfinite(float(t.sum()))
    return kept.memory[0] != 0.0 if kept is not None and t is kept.tensor else bool(t.item())


def _named(t: torch.Tensor, names: list[str], params: Optional[list[torch.nn.Parameter]], certain: bool) -> Check:
    """A check that found NaN/Inf, as peaks that name the gradients: a flag's, the largest magnitude
    of each of its gradients present (which no finite value overflows: a non-finite one is certain)."""
    return (t, names, None, certain) if params is None else (*_peaks(names, params), None, True)


def _peaks(names: list[str], params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, list[str]]:
    """The largest magnitude of each parameter's gradient (on the host, in their dtype), and the
    names of those that have one."""
    present = [(name, p.grad) for name, p in zip(names, params) if p.grad is not None]
    if not present:
        return torch.zeros(0), []
    with torch.no_grad():
        return torch.stack(torch._foreach_norm([g for _, g in present], math.inf)).cpu(), [name for name, _ in present]


def _offenders(names: list[str], params: list[torch.nn.Parameter]) -> list[str]:
    """The parameters whose gradient (as it is now) holds a NaN or Inf."""
    peaks, present = _peaks(names, params)
    return [present[i] for i, v in enumerate(peaks.tolist()) if not math.isfinite(v)]


def _landed(step: int, checks: list[Check], stepped: Optional[bool]) -> tuple[list, list[Any]]:
    """A pending entry of ``step``'s checks: [step, what each keeps (names, a flag's parameters,
    certain), their copies on the host, stepped], and the events that say the copies landed."""
    copies = [S.to_host_nonblocking(t) for t, _, _, _ in checks]
    kept = [(names, params, certain) for _, names, params, certain in checks]
    return [step, kept, [host for host, _ in copies], stepped], [event for _, event in copies]
