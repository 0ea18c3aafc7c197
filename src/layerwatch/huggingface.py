"""``InspectTrainerCallback``: the engine driven by Hugging Face ``Trainer``'s callbacks.

The only module that imports ``transformers``; importing ``layerwatch`` never does. It uses
nothing of the engine but its public protocol (:mod:`layerwatch.engine.engine`).

How the Trainer's events map onto the protocol, for optimizer step ``k`` (``state.global_step``
goes from ``k - 1`` to ``k``):

=========================  ==========================================================
``on_step_begin``          ``begin_step(k)``: once per optimizer step, at its first
                           micro-batch (gradient accumulation: only optimizer steps count)
the model's forward        ``replay_with(closure)``: each micro-batch's inputs, as the
                           model is called with them (a forward pre-hook)
``on_pre_optimizer_step``  ``before_optimizer_step(optimizer)``: the sentinel's check
                           and, on a finding, the replay; gradients, after HF's
                           clipping; the weights' snapshot for the update ratios
``on_optimizer_step``      ``after_optimizer_step(optimizer)``: update ratios, weights
``on_step_end``            ``end_step()``: a sampled step is written (the Trainer has
                           cleared the gradients by then)
=========================  ==========================================================

So step ``k``'s charts sit at the same x as the ``train/loss`` HF logs for that batch (HF
logs it at the global step after the optimizer step).

The replay: the Trainer hands its callbacks no batch, but the model is called with it. A
forward pre-hook on the outermost module the Trainer calls (``trainer.model_wrapped``: the
DDP or ``torch.compile`` wrapper, whose own hooks run eagerly) keeps each micro-batch's
positional and keyword inputs for the open step, and offers the engine a closure that calls
the model itself again with them and returns its loss (``outputs.loss``, what the Trainer's
default ``compute_loss`` takes). Nothing is copied: the references are dropped when the step
ends.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch
from torch import nn

from typing_extensions import override

from layerwatch import vocabulary as V
from layerwatch.health.alert import Alert
from layerwatch.engine.engine import Engine
from layerwatch.guards.hooks import FailedForwardGuard, GradNormTaken, engine_step_hooks, is_compiling
from layerwatch.options import AlertRules, SpikeRule, DEFAULT_STATS, options_from
from layerwatch.probes import ModuleFilter
from layerwatch.engine.rerun import first_rows
from layerwatch.schedule import ScheduleLike

try:
    from transformers import Trainer, TrainerCallback
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import CallbackHandler
except ImportError as e:  # pragma: no cover - exercised by the import test in a subprocess
    raise ImportError(
        "layerwatch.huggingface needs Hugging Face transformers and accelerate: "
        'pip install "layerwatch[huggingface]"'
    ) from e


class InspectTrainerCallback(TrainerCallback):
    """Logs per-layer weights, gradients, update ratios, latency, memory and NaN/Inf during
    ``Trainer.train()``, into the same TensorBoard run as HF's own loss.

    Example:
        >>> from transformers import Trainer, TrainingArguments
        >>> from layerwatch.huggingface import InspectTrainerCallback
        >>> trainer = Trainer(model=model, args=TrainingArguments("out", report_to=["tensorboard"]),
        ...                   train_dataset=data, callbacks=[InspectTrainerCallback()])
        >>> trainer.train()  # doctest: +SKIP

    The step is HF's global step after the optimizer step (see the module's docstring), so
    the default overhead budget samples steps 1 and 2, then the multiples of the interval it
    chooses, and ``every_n_steps=50`` samples steps 50, 100, ... With HF's
    ``TensorBoardCallback`` (``report_to=["tensorboard"]``) its writer is reused, so
    everything is one run; otherwise the logs go to ``<output_dir>/runs/layerwatch``, said
    once. Under a distributed launch only rank 0 writes; with sharded parameters (FSDP2)
    every rank takes part in the reductions.

    Gradients are read in ``on_pre_optimizer_step``, **after** HF has clipped them to
    ``max_grad_norm`` (Lightning's ``InspectCallback`` reads them before clipping). The NaN
    sentinel checks them there too, before the optimizer steps with them.

    Args: the options of :class:`~layerwatch.Inspector` (``every_n_steps``, ``schedule``,
        ``overhead_budget``, ``families``, ``stats``, ``histograms``, ``histogram_bins``,
        ``alerts``, ``modules``, ``sentinel``, ``memory_budget``, ``output_head``, ``moe_routers``, ``spikes``: the loss the model's outputs
        hold and the gradient norm the Trainer computes each step, before clipping), with the
        same meaning and checks, and:

        replay: On the sentinel's first hit, and at a loss spike found before its step's
            optimizer step (on the CPU), run that step's micro-batches again through the
            model (its own forward inputs, kept by a forward pre-hook) with every probe armed,
            then backward from the model's own loss, before the optimizer step, so the first
            offender is the module that made the NaN (``"replayed from step N"``), not merely
            the first to use a poisoned weight a step later. RNG states, buffers, gradients
            and modes are restored; the optimizer then steps as it would have. On a GPU it
            makes the sentinel's read a device sync before each optimizer step;
            ``replay=False`` keeps it a step later, without a replay. Not under fp16's
            GradScaler (its skipped steps are not faults), DeepSpeed, sharded parameters
            (FSDP), or with a loss computed outside the model (``compute_loss_func``, label
            smoothing): each is said at the fault. With a ``compute_loss`` of your own, the replay backpropagates the
            model's own loss (``outputs.loss``) instead of yours. Under ``torch_compile=True`` each sampled
            step's inputs are run through the model again the same way, forward only and without a gradient,
            before the step's own forward: its per-module families are measured there, nothing of layerwatch
            running inside compiled code (``replay=False`` turns that off too).

    Raises:
        ValueError, TypeError: A bad option, at construction.
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        *,
        schedule: Optional[ScheduleLike] = None,
        overhead_budget: Optional[float] = None,
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
        replay: bool = True,
    ) -> None:
        if not isinstance(replay, bool):
            raise TypeError(f"replay must be a bool, got {type(replay).__name__}")
        self._options = options_from(locals())
        self._replay = replay
        self._deepspeed = False  # the Trainer runs DeepSpeed, whose step the optimizer events come after
        self._engine: Optional[Engine] = None
        self._inputs: Optional[_InputsKept] = None
        self._alerts: list[Alert] = []
        self.log_dir: Optional[str] = None

    @property
    def alerts(self) -> list[Alert]:
        """The health alerts raised in this run so far (on rank 0)."""
        return list(self._alerts)

    # ------------------------------------------------------------------ the Trainer's events

    @override
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self._finish()
        if model is None:
            return
        target: dict[str, Any] = {}
        handler = sys._getframe(1).f_locals.get("self")  # the CallbackHandler calling this event
        if state.is_world_process_zero:
            writer = _tensorboard_writer(handler)
            if writer is not None:
                target = {"writer": writer}
                self.log_dir = writer.log_dir if hasattr(writer, "log_dir") else None
            else:
                self.log_dir = os.path.join(args.output_dir, "runs", "layerwatch")
                target = {"log_dir": self.log_dir}
                print(f"layerwatch: no TensorBoardCallback (report_to=['tensorboard']); writing TensorBoard logs to {self.log_dir}")
        self._engine = Engine(model, self._options, **target)
        self._alerts = self._engine.alerts
        trainer = _calling_trainer()
        deepspeed = trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else None
        self._engine.start(compiled_by_caller=bool(getattr(args, "torch_compile", False)), deepspeed=deepspeed)
        self._deepspeed = deepspeed is not None
        client = self._engine.deepspeed_client
        if client is not None:  # DeepSpeed steps inside training_step, before the Trainer's optimizer events
            self._engine.track_optimizers([client])
            self._engine.attach(engine_step_hooks(self._engine, client))
        outer = trainer.model_wrapped if trainer is not None and isinstance(trainer.model_wrapped, nn.Module) else model
        unreplayable = _why_not_replayed(self._replay, trainer, args, optimizer)
        note = _own_loss_note(trainer) if unreplayable is None else ""
        if unreplayable is not None or note:
            self._engine.describe_replay(unreplayable=unreplayable, differs=note or None)
        losses = self._options.spikes is not None  # the loss the model's outputs hold, for the spike check
        rerun = self._replay and bool(getattr(args, "torch_compile", False))  # a compiled model's sampled steps: run again
        if unreplayable is None or losses or rerun:
            self._inputs = _InputsKept(self._engine, outer, model, replay=unreplayable is None, rerun=rerun, losses=losses)
            self._inputs.attach()
            self._engine.attach([self._inputs])
        if losses and getattr(trainer, "accelerator", None) is not None:  # the Trainer asks it for the norm, each step
            self._engine.attach([GradNormTaken(self._engine, trainer.accelerator, "clip_grad_norm_")])

    @override
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._engine is not None:
            self._engine.begin_step(state.global_step + 1)
            if self._inputs is not None:
                self._inputs.attach()  # again, after a forward that raised

    @override
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self._engine is not None and not self._deepspeed:  # DeepSpeed has stepped already: its hooks read it
            self._engine.before_optimizer_step(optimizer)

    @override
    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self._engine is not None and not self._deepspeed:  # accelerate's optimizer knows whether its GradScaler skipped
            self._engine.after_optimizer_step(optimizer, stepped=not getattr(optimizer, "step_was_skipped", False))

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._engine is not None:
            self._engine.end_step()

    @override
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        engine, self._engine, self._inputs = self._engine, None, None
        if engine is not None:
            engine.finish()


class _InputsKept:
    """The hooks on the module the Trainer calls, at each training forward of the open step:
    with ``replay``, a pre-hook offers the engine a closure that calls the model again with the
    same inputs (:meth:`Engine.replay_with`); with ``rerun`` alone, one that runs its forward
    again (:meth:`Engine.rerun_with`: a compiled model's sampled step is measured on it); with
    ``losses``, a hook hands the engine the loss
    the model's outputs hold (:meth:`Engine.observe`: the Trainer's default
    ``compute_loss`` takes it there). Evaluation (no autograd, or ``eval()``), traced calls and
    the replay's own forwards are passed over. A forward that raises takes the hooks off at once
    (the exception may end training, and no event of the Trainer's says so); the next step
    puts them back. It holds the engine and the modules weakly; ``remove()`` is safe twice."""

    def __init__(self, engine: Engine, outer: nn.Module, model: nn.Module, replay: bool = True, rerun: bool = False,
                 losses: bool = False) -> None:
        self._engine = weakref.ref(engine)
        self._outer = weakref.ref(outer)
        self._model = weakref.ref(model)
        self._replay, self._rerun, self._losses = replay, rerun, losses
        self._replaying = False
        self._handles: list[Any] = []

    def attach(self) -> None:
        outer, model = self._outer(), self._model()
        if self._handles or outer is None or model is None:
            return
        self._handles = [FailedForwardGuard(model, self._failed)]
        if self._replay or self._rerun:
            self._handles.append(outer.register_forward_pre_hook(self, with_kwargs=True))
        if self._losses:
            self._handles.append(outer.register_forward_hook(self._loss_seen, with_kwargs=True))

    def _passed_over(self, module: nn.Module) -> bool:
        """An evaluation forward (no autograd, or ``eval()``), a traced call, or the replay's own."""
        return is_compiling() or self._replaying or not torch.is_grad_enabled() or not module.training

    def _loss_seen(self, module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
        if self._passed_over(module):
            return
        engine = self._engine()
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        if engine is not None and engine.state == "running" and isinstance(loss, torch.Tensor):
            engine.observe(loss)

    def _failed(self) -> None:
        """The model's forward raised: the hooks come off, unless the forward was the replay's or
        the re-run's own (the engine handles that one, and puts the model back as it was)."""
        if not self._replaying:
            self.remove()

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._passed_over(module):
            return
        engine = self._engine()
        if engine is None or engine.state != "running":
            return
        rows = functools.partial(self._first_rows, args, kwargs)
        forward = functools.partial(self._forward, args, kwargs)
        if self._replay:
            engine.replay_with(lambda: _model_loss(forward(), "labels" in kwargs), rows, forward=forward)
        else:
            engine.rerun_with(forward, rows)

    def _first_rows(self, args: tuple, kwargs: dict, rows: int) -> Callable[[], Any]:
        return lambda: self._forward(first_rows(args, rows), first_rows(kwargs, rows))

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        """The model called again with ``args`` and ``kwargs`` (its own forward, not the wrapper's)."""
        self._replaying = True
        try:
            return self._model()(*args, **kwargs)
        finally:
            self._replaying = False


def _model_loss(outputs: Any, labels_given: bool) -> torch.Tensor:
    """The loss the Trainer's default ``compute_loss`` takes from the model's outputs.

    Raises:
        TypeError: the outputs hold none (the loss is computed outside the model).
    """
    if isinstance(outputs, dict) and outputs.get("loss") is not None:
        return outputs["loss"]
    if isinstance(outputs, (tuple, list)) and labels_given and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError("the model's outputs hold no loss to replay the step's backward with (the Trainer's "
                    "compute_loss computes it outside the model)")


def _why_not_replayed(replay: bool, trainer: Any, args: Any, optimizer: Any) -> Optional[str]:
    """Why the bad step cannot be replayed under this Trainer, as the fault's warning says it;
    None when it can be."""
    if not replay:
        return "InspectTrainerCallback(replay=False) turned the replay of the bad step off"
    if getattr(optimizer, "scaler", None) is not None:
        return ("under fp16 mixed precision a GradScaler may skip the step, so NaN/Inf gradients are told from its "
                "overflows only after the optimizer step and the bad step is not replayed")
    if trainer is None:
        return "the Trainer calling this callback was not found, so the bad step's inputs were not kept for a replay"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "under DeepSpeed the bad step is not replayed"
    if getattr(trainer, "compute_loss_func", None) is not None or getattr(trainer, "label_smoother", None) is not None:
        what = "compute_loss_func" if getattr(trainer, "compute_loss_func", None) is not None else "label smoothing"
        return (f"the Trainer computes the loss outside the model ({what}), so a replay of the model has no loss to "
                "run the backward of; the bad step is not replayed")
    return None


def _own_loss_note(trainer: Any) -> str:
    """What the replay does differently from a Trainer subclass with its own ``compute_loss``."""
    if trainer is None or type(trainer).compute_loss is Trainer.compute_loss:
        return ""
    return (f"the replay backpropagates the model's own loss (outputs.loss), not {type(trainer).__name__}.compute_loss's, "
            "so a fault in that loss is not run again")


def _calling_trainer() -> Any:
    """The ``Trainer`` whose ``train()`` calls this event: the frame above the callback
    handler's (HF hands callbacks the model, the optimizer and the data, not the Trainer)."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def _tensorboard_writer(handler: Any) -> Any:
    """The ``SummaryWriter`` of HF's ``TensorBoardCallback``, when it has one. The Trainer hands
    callbacks no list of the others; the ``CallbackHandler`` calling this event holds it.
    ``TensorBoardCallback`` is a default callback, so it has opened its writer already."""
    if not isinstance(handler, CallbackHandler):
        return None
    for callback in handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and getattr(callback, "tb_writer", None) is not None:
            return callback.tb_writer
    return None
