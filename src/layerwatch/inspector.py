"""``Inspector``: the front door for a plain PyTorch training loop.

It holds an :class:`~layerwatch.engine.engine.Engine` and drives its public protocol from
``step()`` and, when given the optimizer, from that optimizer's step hooks (from ``start()`` to ``finish()``; they do
nothing on unsampled steps and inside a compiled ``optimizer.step``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch
from torch import nn

from layerwatch.sinks import record as R
from layerwatch import vocabulary as V
from layerwatch.health.alert import Alert
from layerwatch.engine.budget import Pacer
from layerwatch.engine.engine import Engine
from layerwatch.guards.hooks import engine_step_hooks
from layerwatch.options import AlertRules, SpikeRule, DEFAULT_STATS, Options, options_from
from layerwatch.probes import ModuleFilter
from layerwatch.schedule import Schedule, ScheduleLike


class Inspector:
    """Logs per-parameter weight and gradient statistics and histograms to TensorBoard.

    Call :meth:`step` once per optimizer step, after ``optimizer.step()``. The first
    call closes step 0; step ``k`` is sampled when the schedule says so. By default the
    overhead budget chooses: steps 0 and 1, then every ``n``-th step, ``n`` on a 1-2-5 grid,
    as often as keeps sampling within 1% of the training time.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from layerwatch import Inspector
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with Inspector(model, log_dir="runs/example", every_n_steps=2, optimizer=opt) as inspector:
        ...     for _ in range(4):
        ...         loss = model(torch.randn(16, 4)).pow(2).mean()
        ...         opt.zero_grad(); loss.backward(); opt.step()
        ...         inspector.step()

    Args:
        model: The module to watch. Held by weak reference.
        writer: A ``SummaryWriter`` to write into (flushed, never closed). Exclusive
            with ``log_dir``.
        log_dir: Directory for a ``SummaryWriter`` the inspector owns and closes.
            With neither, ``SummaryWriter()``'s default ``runs/...`` directory.
        every_n_steps: Sample step ``k`` when ``k % every_n_steps == 0``: a fixed interval, the
            same on every machine (for run-to-run comparisons).
        schedule: Instead of ``every_n_steps``: a :class:`~layerwatch.schedule.Schedule`,
            a list of steps, or a callable ``step -> bool``.
        overhead_budget: The share of the training time sampling may add, in (0, 1]; the
            default schedule, with ``0.01`` when none of these three is given. The interval
            it chooses is logged as ``layerwatch/sample_interval`` and said on stderr when
            it changes (see docs/usage.md, "The overhead budget").
        optimizer: When given, gradients are read just before ``optimizer.step()`` and
            weights just after it, and ``update_ratio/<param>`` is logged, by its step
            hooks (until :meth:`finish`; they return at once on unsampled steps). A
            compiled ``optimizer.step`` runs no hook: then gradients and weights are read
            in :meth:`step` and no update ratio is logged. Under DeepSpeed ZeRO, pass your own
            optimizer, the one given to ``deepspeed.initialize``: it leads to DeepSpeed's
            partitions, where the gradients it steps with are read (``engine.optimizer`` works too).
            Or watch the engine (``Inspector(engine)``: the optimizer it steps is hooked for you).
        families: Which families to log (all by default). Per parameter: ``"weights"``,
            ``"grads"``, ``"updates"``. Once: ``"structure"``, the layer table
            (``layerwatch/structure``) and the parameter and MAC counts, from the forward
            of the first sampled step. Per module, by hooks that exist only during a
            sampled step: ``"latency"`` (``fwd_ms``, ``bwd_ms``), ``"memory"``
            (``activation_bytes``, ``saved_bytes``, ``cuda_alloc_bytes``),
            ``"activations"`` (histograms and stats of module outputs) and
            ``"nonfinite"`` (NaN/Inf flags and the first offender).
        stats: Per-tensor scalars to log for weights and grads, from
            ``mean std min max norm zero_frac nonfinite``.
        histograms: Log ``weights/<param>`` and ``grads/<param>`` histograms.
        histogram_bins: Buckets per histogram, 2 to 254 (default 32, as TensorBoard's own
            default of 30; each bucket adds 16 bytes to the event file and to its write).
        alerts: Health alerts (dead, stuck, exploding, vanishing, nonfinite layers):
            ``True`` for the default :class:`~layerwatch.AlertRules`, an ``AlertRules`` with
            your thresholds, or ``False`` for none. See :attr:`alerts`.
        modules: Restrict the per-module families to modules whose qualified name matches
            one of these glob patterns (``"blocks.*.attn"``; the model itself is
            ``"(root)"``) or that are instances of one of these types (``nn.Linear``).
            Default: every module.
        sentinel: Check the gradients for NaN/Inf between samples (on a GPU all of them every
            step, on the CPU a rotating share; one fused kernel that sets a flag, read without
            stalling the device); on the first hit log
            ``layerwatch/first_nonfinite_step``, warn, and replay that step's batch with every
            probe armed when :meth:`replay_with` gave it (else sample the next step with every
            probe armed: it shows what came after the fault). Pass ``optimizer=`` when a
            GradScaler may skip steps, so its overflow steps are told apart from faults.
        memory_budget: The most memory a sampled step may hold for exact update ratios (their
            snapshot copies every trainable weight): an int of bytes, or a float share of
            the parameters' bytes (``0.5``: half). Beyond it, and on a GPU beyond its free
            memory less 5%, the ratios are estimated from a strided sample of each weight
            (``update_ratio_estimate/<param>``, said once). Default: no limit but the GPU's.
        spikes: Judge each step's loss and global gradient norm (``step(loss=...,
            grad_norm=...)``), each against its own steps before it: a value more than 6
            standard deviations above the mean of the last 128 (once 32 were seen, on the
            logarithm of the values) is a spike, said once; the next 3 steps are
            sampled in full, whatever the schedule, and the spiking step too where it is found
            in it (on the CPU), and the next sample ranks the layers that grew most (a ``spike``
            alert). ``SpikeRule(z=, window=, warmup=, capture=)`` changes them; False: off.
            Nothing waits for them: on a GPU they are judged once their copies landed.
        output_head: The module whose output is the model's logits (as ``named_modules()`` names
            it: ``"lm_head"``), for ``logsumexp_mean/<head>`` and ``logsumexp_max/<head>``.
            Default: the module Hugging Face's ``get_output_embeddings()`` returns.
        moe_routers: A custom MoE's routers for the ``moe`` family (transformers' are found):
            module names or glob patterns (``"layers.*.moe.gate"``), each outputting the router
            logits ``[..., experts]`` (or as its first element), mapped to ``top_k`` or to
            ``{"top_k": 2, "capacity_factor": 1.25}`` (an expert takes at most
            ``ceil(1.25 * tokens * top_k / experts)`` tokens a call; ``moe_dropped``: the rest).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``optimizer`` not an optimizer,
            or ``writer`` lacks the ``SummaryWriter`` interface.
        ValueError: A bad option value, both ``writer`` and ``log_dir``, both
            of ``every_n_steps``, ``schedule`` and ``overhead_budget``, or a ``log_dir`` that
            cannot be written.
    """

    def __init__(
        self,
        model: nn.Module,
        writer: Any = None,
        *,
        log_dir: Optional[str | os.PathLike] = None,
        every_n_steps: Optional[int] = None,
        schedule: Optional[ScheduleLike] = None,
        overhead_budget: Optional[float] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        families: Collection[str] = V.FAMILIES,
        stats: Sequence[str] = DEFAULT_STATS,
        histograms: bool = True,
        histogram_bins: int = 32,
        alerts: AlertRules | bool = True,
        modules: Optional[ModuleFilter] = None,
        sentinel: bool = True,
        memory_budget: Optional[int | float] = None,
        spikes: SpikeRule | bool = True,
        output_head: Optional[str] = None,
        moe_routers: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self._deepspeed = None  # a DeepSpeed ZeRO optimizer given as optimizer=: the engine reads its partitions
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) \
                    or not hasattr(optimizer, "dp_process_group"):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
            self._deepspeed, optimizer = optimizer, optimizer.optimizer  # DeepSpeed's: it steps the one it was given
        options = options_from(locals())
        self._engine = Engine(model, options, writer=writer, log_dir=log_dir, owner="Inspector")
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        self._optimizer_hook_ran = False
        self._first_step = 0  # the step start() opens: 0, or a resumed run's

    @property
    def options(self) -> Options:
        """The validated options."""
        return self._engine.options

    @property
    def log_dir(self) -> Optional[os.PathLike]:
        return self._engine.log_dir

    @property
    def schedule(self) -> Schedule | Pacer:
        """What chooses the sampled steps: the :class:`~layerwatch.schedule.Schedule` given, or
        the overhead budget's pacer (its ``interval``)."""
        return self._engine.schedule

    @property
    def families(self) -> tuple[str, ...]:
        return self._engine.options.families

    @property
    def stats(self) -> tuple[str, ...]:
        return self._engine.options.stats

    @property
    def alerts(self) -> list[Alert]:
        """Every health alert raised so far, in the order first seen."""
        return self._engine.alerts

    @property
    def current_step(self) -> int:
        """The step open now: :meth:`step` closes it."""
        return self._first_step if self._engine.state == "new" else self._engine.current_step

    @property
    def sampled(self) -> bool:
        """Whether the open step is sampled."""
        return self._engine.sampled

    def add_sink(self, sink: Callable[[R.StepRecord], None]) -> None:
        """Also hand every record written to ``sink``."""
        self._engine.add_sink(sink)

    def track_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Count the steps of optimizers besides ``optimizer=`` (see
        :meth:`~layerwatch.engine.engine.Engine.track_optimizers`)."""
        self._engine.track_optimizers(optimizers)

    def before_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """For an optimizer besides ``optimizer=``: call it just before that optimizer steps (its
        step pre-hook), so its gradients are read and its step can be replayed."""
        self._engine.before_optimizer_step(optimizer)

    def after_optimizer_step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """For an optimizer besides ``optimizer=``: call it just after that optimizer steps."""
        self._engine.after_optimizer_step(optimizer)

    def start(self) -> "Inspector":
        """Open the writer, write the chart layout, and open the first step (armed if it is sampled)."""
        engine = self._engine
        if engine.state != "new":
            raise RuntimeError(f"start() called on an inspector that is {engine.state}")
        optimizer = self._optimizer() if self._optimizer is not None else None
        engine.start(deepspeed=self._deepspeed, optimizer=optimizer)  # ZeRO-1/2: DeepSpeed's client leads to its partitions
        optimizer = optimizer or engine.deepspeed_client  # DeepSpeed ZeRO's gradients exist in its step alone
        if optimizer is not None:
            if self.options.sentinel:  # told apart: a GradScaler's skipped step
                engine.track_optimizers([optimizer])
            inspector = weakref.ref(self)  # the optimizer must not keep the inspector alive

            def noted() -> None:
                me = inspector()
                if me is not None:
                    me._optimizer_hook_ran = True

            engine.attach(engine_step_hooks(engine, optimizer, noted))
        engine.begin_step(self._first_step)
        return self

    def finish(self) -> None:
        """Remove every hook, flush and (if owned) close the writer. Safe to call twice."""
        self._engine.finish()

    def replay_with(self, closure: Callable[[], Any]) -> None:
        """Let this step be replayed if its gradients go NaN/Inf. Call it before the step's
        forward with a closure that computes the step's loss again from the same batch; call
        it for each micro-batch when you accumulate gradients. Nothing is done with it unless
        the sentinel finds NaN/Inf gradients at this step: then, in the optimizer's step
        pre-hook (before the weights change), layerwatch runs the closure again with every
        probe armed, calls ``backward()`` on the loss it returns, and names the module that
        made the NaN (``layerwatch/first_offender``, "replayed from step N"). RNG states,
        buffers, gradients and module modes are restored; the optimizer then steps as it
        would have. The closure is dropped at :meth:`step`. It runs with autograd on, in no
        other context: a forward under ``torch.autocast`` must enter it inside the closure.
        Not for an optimizer stepped with
        a closure of its own (``opt.step(closure)``, LBFGS): its pre-hook runs before that
        closure's backward.

        A model that runs compiled is measured on it too: on a sampled step, the first closure
        is run again at once, eagerly, forward only and without a gradient, and the per-module
        families are measured there (nothing of layerwatch runs inside compiled code; see
        docs/usage.md, "Compiled code"). For a model called from a compiled function
        (``torch.compile(loss_fn)``) it is the only way they are measured.

        Example:
            >>> for x, y in loader:  # doctest: +SKIP
            ...     compute_loss = lambda: loss_fn(model(x), y)
            ...     inspector.replay_with(compute_loss)
            ...     loss = compute_loss()
            ...     opt.zero_grad(); loss.backward(); opt.step()
            ...     inspector.step()

        Raises:
            ValueError: the Inspector was made without ``optimizer=`` (the replay runs in its
                step pre-hook).
            TypeError: ``closure`` is not callable.
        """
        if self._optimizer is None:
            raise ValueError("replay_with() needs Inspector(..., optimizer=opt): the replay runs in the optimizer's "
                             "step pre-hook, after the backward and before the weights change")
        self._engine.replay_with(closure)

    def step(self, loss: Any = None, grad_norm: Any = None) -> None:
        """Close the current step (after ``optimizer.step()``); open the next one. ``loss``: this
        step's loss, and ``grad_norm``: its global gradient norm before clipping (what
        ``torch.nn.utils.clip_grad_norm_`` returns), each a tensor or a number, judged for a
        spike (the ``spikes`` option) once it has reached the host, without waiting for it."""
        engine = self._engine
        if engine.state != "running":
            raise RuntimeError(
                f"step() called on an inspector that is {engine.state}; call start() or use it as a context manager"
            )
        if engine.sampled and self._optimizer is not None and not self._optimizer_hook_ran:
            engine.failures.warn_once(
                "optimizer-hooks",
                f"layerwatch: the optimizer's step hooks did not run on sampled step {engine.current_step} (a compiled "
                "optimizer.step runs none, or optimizer.step() was not called before step()); gradients and weights "
                "are read in step() instead, and update ratios are not logged at such steps",
            )
        self._optimizer_hook_ran = False
        if loss is not None:
            engine.observe(loss)
        if grad_norm is not None:
            engine.observe(grad_norm, "grad_norm")
        engine.end_step()
        engine.begin_step(engine.current_step + 1)

    def __enter__(self) -> "Inspector":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    def state_dict(self) -> dict[str, int]:
        """The schedule position and the overhead budget's interval, so a resumed run
        continues them."""
        return {"step": self.current_step, **self._engine.state_dict()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state['step'] must be an int >= 0, got {step!r}")
        self._engine.load_state_dict(state)
        if self._engine.state == "running":
            self._engine.begin_step(step)
        else:
            self._first_step = step
