"""``InspectTrainerCallback``: the engine driven by Hugging Face ``Trainer``'s callbacks.

The only module that imports ``transformers``; importing ``layerwatch`` never does. It uses
nothing of the engine but its public protocol (:mod:`layerwatch.engine`).

How the Trainer's events map onto the protocol, for optimizer step ``k`` (``state.global_step``
goes from ``k - 1`` to ``k``):

=========================  ==========================================================
``on_step_begin``          ``begin_step(k)``: once per optimizer step, at its first
                           micro-batch (gradient accumulation: only optimizer steps count)
``on_pre_optimizer_step``  ``before_optimizer_step(optimizer)``: gradients, after HF's
                           clipping; the weights' snapshot for the update ratios
``on_optimizer_step``      ``after_optimizer_step(optimizer)``: update ratios, weights
``on_step_end``            ``end_step()``: the sentinel; a sampled step is written
=========================  ==========================================================

So step ``k``'s charts sit at the same x as the ``train/loss`` HF logs for that batch (HF
logs it at the global step after the optimizer step).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Collection, Optional, Sequence

from typing_extensions import override

from layerwatch import vocabulary as V
from layerwatch.alerts import Alert, AlertRules
from layerwatch.engine import Engine
from layerwatch.options import DEFAULT_STATS, options_from
from layerwatch.probes import ModuleFilter
from layerwatch.schedule import ScheduleLike

try:
    from transformers import TrainerCallback
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
    ``max_grad_norm`` (Lightning's ``InspectCallback`` reads them before clipping).

    Args: the options of :class:`~layerwatch.Inspector` (``every_n_steps``, ``schedule``,
        ``overhead_budget``, ``families``, ``stats``, ``histograms``, ``histogram_bins``,
        ``alerts``, ``modules``, ``sentinel``, ``memory_budget``), with the same meaning and
        checks.

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
    ) -> None:
        self._options = options_from(locals())
        self._engine: Optional[Engine] = None
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
        if state.is_world_process_zero:
            writer = _tensorboard_writer(sys._getframe(1))
            if writer is not None:
                target = {"writer": writer}
                self.log_dir = writer.log_dir if hasattr(writer, "log_dir") else None
            else:
                self.log_dir = os.path.join(args.output_dir, "runs", "layerwatch")
                target = {"log_dir": self.log_dir}
                print(f"layerwatch: no TensorBoardCallback (report_to=['tensorboard']); writing TensorBoard logs to {self.log_dir}")
        self._engine = Engine(model, self._options, **target)
        self._engine.replay_hint = ("the Hugging Face Trainer hands its callbacks no batch, so the bad step is not "
                                    "replayed; see docs/huggingface.md")
        self._alerts = self._engine.alerts
        self._engine.start(compiled_by_caller=bool(getattr(args, "torch_compile", False)))

    @override
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._engine is not None:
            self._engine.begin_step(state.global_step + 1)

    @override
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self._engine is not None:
            self._engine.before_optimizer_step(optimizer)

    @override
    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self._engine is not None:  # accelerate's optimizer knows whether its GradScaler skipped the step
            self._engine.after_optimizer_step(optimizer, stepped=not getattr(optimizer, "step_was_skipped", False))

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._engine is not None:
            self._engine.end_step()

    @override
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.finish()


def _tensorboard_writer(caller: Any) -> Any:
    """The ``SummaryWriter`` of HF's ``TensorBoardCallback``, when it has one. The Trainer hands
    callbacks no list of the others; the ``CallbackHandler`` calling this event holds it.
    ``TensorBoardCallback`` is a default callback, so it has opened its writer already."""
    handler = caller.f_locals.get("self") if caller is not None else None
    if not isinstance(handler, CallbackHandler):
        return None
    for callback in handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and getattr(callback, "tb_writer", None) is not None:
            return callback.tb_writer
    return None
