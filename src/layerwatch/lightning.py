"""``InspectCallback``: the Inspector engine driven by Lightning's hooks.

The only module that imports Lightning. It works with ``lightning.pytorch`` or
``pytorch_lightning``, whichever is installed (``lightning`` first); the Trainers of both
call callbacks by their hook names, so one class serves either.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
from typing import Any, Callable, Collection, ContextManager, Mapping, Optional, Sequence

import torch
from typing_extensions import override

from layerwatch.sinks import record as R
from layerwatch import vocabulary as V
from layerwatch.health.alert import Alert
from layerwatch.engine.engine import Engine
from layerwatch.guards.hooks import GradNormTaken
from layerwatch.options import AlertRules, SpikeRule, DEFAULT_STATS, options_from
from layerwatch.probes import ModuleFilter
from layerwatch.engine.rerun import first_rows
from layerwatch.schedule import ScheduleLike

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _import_first(attribute_path: str) -> list[Any]:
    """``attribute_path`` ("loggers.TensorBoardLogger") from each installed Lightning package."""
    module_name, _, name = attribute_path.rpartition(".")
    found = []
    for package in _PACKAGES:
        try:
            found.append(getattr(importlib.import_module(f"{package}.{module_name}"), name))
        except ImportError:
            continue
    return found


_callback_bases = _import_first("callbacks.Callback")
if not _callback_bases:
    raise ImportError("layerwatch.InspectCallback needs Lightning: pip install lightning (or pytorch-lightning)")


class InspectCallback(_callback_bases[0]):  # type: ignore[misc, valid-type]
    """Logs per-parameter weight and gradient statistics and histograms during ``Trainer.fit``.

    The same engine and options as :class:`~layerwatch.Inspector`. The step is
    ``trainer.global_step`` (optimizer steps); by default the overhead budget chooses the
    sampled steps (see :class:`~layerwatch.Inspector`), else ``every_n_steps`` or
    ``schedule``; a resumed run goes on with the interval it had. Gradients are read in
    ``on_before_optimizer_step``, before Lightning clips them and before the optimizer
    changes the weights; weights and update ratios once the optimizer step is done.
    With gradient accumulation only the step's last micro-batch counts; with several
    optimizer steps in one batch, the batch is sampled when the global step at its start is.

    With a ``TensorBoardLogger`` everything goes into the logger's own writer, so the layer
    charts sit in the same run as your ``self.log`` metrics. Without one it writes its own
    ``<trainer.log_dir>/layerwatch`` and says so once; run-wide scalars
    (``layerwatch/*``) also go to the trainer's other loggers. Under DDP only global rank 0
    measures and writes (every rank holds the same synchronized gradients); with sharded
    parameters (FSDP2, DTensor) every rank reduces its shards and rank 0 writes the exact
    statistics of the whole tensors.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from layerwatch import InspectCallback
        >>> trainer = Trainer(max_steps=200, callbacks=[InspectCallback()])
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> # tensorboard --logdir lightning_logs

    Args:
        every_n_steps: Sample global step ``k`` when ``k % every_n_steps == 0`` (a fixed interval).
        schedule: Instead of ``every_n_steps``: a Schedule, a list of steps, or a callable.
        overhead_budget: The share of the training time sampling may add, in (0, 1]; the
            default schedule, with ``0.01`` when none of these three is given.
        families: Which families to log, all by default: ``"weights"``, ``"grads"``,
            ``"updates"``, ``"structure"`` (the layer table, once, from the first sampled
            step's training forward), and the per-module ``"latency"``, ``"memory"``,
            ``"activations"``, ``"nonfinite"`` (hooks that exist only on sampled steps).
        stats: Per-tensor scalars, from ``mean std min max norm zero_frac nonfinite``.
        histograms: Log ``weights/<param>`` and ``grads/<param>`` histograms.
        histogram_bins: Buckets per histogram, 2 to 254.
        alerts: Health alerts: ``True`` (default rules), an ``AlertRules``, or ``False``.
            Those raised are in :attr:`alerts`, also after ``fit`` returns.
        modules: Restrict the per-module families to modules matching these glob patterns
            (qualified names; the LightningModule itself is ``"(root)"``) or types.
        sentinel: Check the gradients for NaN/Inf between samples (on a GPU all of them every
            step, on the CPU a rotating share) and, on the first hit, log
            ``layerwatch/first_nonfinite_step`` and find the module that made it.
        memory_budget: The most memory a sampled step may hold for exact update ratios (their
            snapshot copies every trainable weight): an int of bytes, or a float share of
            the parameters' bytes (``0.5``: half). Beyond it, and on a GPU beyond its free
            memory less 5%, the ratios are estimated from a strided sample of each weight
            (``update_ratio_estimate/<param>``, said once). Default: no limit but the GPU's.
        spikes: As :class:`~layerwatch.Inspector`'s, on ``training_step``'s loss: taken before
            the backward (so that on the CPU a spike is found, and its step sampled and
            replayed, before its optimizer step), or after the step under a GradScaler; and on
            the gradient norm Lightning clips at (``gradient_clip_val``), before clipping.
        output_head: As :class:`~layerwatch.Inspector`'s: the module whose output is the logits.
        moe_routers: As :class:`~layerwatch.Inspector`'s: a custom MoE's routers.
        replay: On the sentinel's first hit, and at a loss spike found before its step's
            optimizer step (on the CPU), run that step's batch again (``training_step``,
            then backward) with every probe armed, before the optimizer step, so the first
            offender is the module that made the NaN, not merely the first to use a poisoned
            weight a step later. With gradient accumulation, each micro-batch of the step in
            turn. It leaves RNG states, buffers, gradients and modes as they were, and drops
            the replay's ``self.log`` calls. On a GPU it makes the sentinel's read a device
            sync before each optimizer step; ``replay=False`` keeps it a step later, without
            a replay. Under manual optimization ``training_step`` steps the optimizers itself
            and cannot be run again: pass a callable ``replay(module, batch, batch_idx)``
            returning the batch's loss without stepping anything (it is used in place of
            ``training_step`` in either mode). Not under a GradScaler (its skipped steps are
            not faults) or with sharded parameters (the ranks agree on a finding a step later).
            Python state ``training_step`` changes outside the module (a metric's ``update``, a
            counter) changes again in a replay. A compiled LightningModule
            (``Trainer.fit(torch.compile(module))``, or parts compiled in ``configure_model``) runs
            ``training_step`` again the same way, forward only and without a gradient, before each
            sampled step's own: its per-module families are measured there, nothing of layerwatch
            running inside compiled code (``replay=False`` turns that off too).

    Use one InspectCallback per Trainer: Lightning refuses a second one (or the same
    object twice) when the Trainer is built, because their checkpoint states would collide.

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
        replay: bool | Callable[[Any, Any, int], Any] = True,
    ) -> None:
        super().__init__()
        if not (isinstance(replay, bool) or callable(replay)):
            raise TypeError(f"replay must be a bool or a callable (module, batch, batch_idx) -> loss, got "
                            f"{type(replay).__name__}")
        self._options = options_from(locals())
        self._replay = replay
        self._replaying = False  # this run's steps can be replayed
        self._rerunning = False  # training_step can run again, forward only (a compiled module's sampled steps)
        self._loss_in_backward, self._accumulated = True, 1  # where the loss is taken (set at the start of training)
        self._engine: Optional[Engine] = None
        self._alerts: list[Alert] = []
        self._last_written_step = -1
        self._engine_state: dict[str, Any] = {}  # the engine's part of the checkpoint: loaded, or kept at the end
        self.log_dir: Optional[str] = None

    # ------------------------------------------------------------------ lifecycle

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        log_dir = trainer.log_dir  # a collective call: every rank must make it
        target: dict[str, Any] = {}
        others: list[Any] = []
        if trainer.is_global_zero:
            tensorboard_types = tuple(_import_first("loggers.TensorBoardLogger"))
            tensorboard = next((lg for lg in trainer.loggers if isinstance(lg, tensorboard_types)), None)
            if tensorboard is not None:
                target = {"writer": tensorboard.experiment}
                self.log_dir = tensorboard.log_dir
            else:
                self.log_dir = os.path.join(log_dir or trainer.default_root_dir, "layerwatch")
                target = {"log_dir": self.log_dir}
                _import_first("utilities.rank_zero.rank_zero_info")[0](
                    f"layerwatch: no TensorBoardLogger on the Trainer; writing TensorBoard logs to {self.log_dir}"
                )
            others = [lg for lg in trainer.loggers if lg is not tensorboard]
        # Every rank gets an engine: each takes part in the reductions of sharded parameters
        # (FSDP); only rank 0 reads replicated ones and writes.
        self._engine = Engine(pl_module, self._options, **target)
        self._engine.failures.pause_with(_progress_bar_pause(trainer))
        self._alerts = self._engine.alerts  # the monitor's own list: it outlives the engine
        if others:
            self._engine.add_sink(lambda rec: _log_run_wide(others, rec))

    @property
    def alerts(self) -> list[Alert]:
        """The health alerts raised in this run so far (on global rank 0)."""
        return list(self._alerts)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is None:
            return
        # strategy="fsdp" wraps pl_module itself; a compiled LightningModule (Trainer.fit(torch.compile(module)))
        # has its forward and steps compiled by Lightning: its sampled steps run training_step again, eagerly
        self._engine.start(within=getattr(trainer.strategy, "model", None),
                           compiled_by_caller=getattr(pl_module, "_compiler_ctx", None) is not None)
        self._engine.load_state_dict(self._engine_state)
        self._engine.track_optimizers(trainer.optimizers)
        custom = callable(self._replay)
        self._rerunning = bool(self._replay) and (custom or pl_module.automatic_optimization)
        self._replaying = self._rerunning and _scaler(trainer) is None
        # The loss before the backward, where a spike can still be sampled in its step; a GradScaler's is scaled then.
        self._loss_in_backward = _scaler(trainer) is None
        self._accumulated = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        plugin = getattr(trainer, "precision_plugin", None)
        if self._options.spikes is not None and _clips_as_torch_does(plugin):  # the norm it clips at, when it clips
            self._engine.attach([GradNormTaken(self._engine, plugin, "clip_grad_by_norm", lambda optimizer, clip_val: (
                torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), clip_val)))])
        if self._replay is False:
            self._engine.describe_replay(unreplayable="InspectCallback(replay=False) turned the replay of the bad step off")
        elif not self._replaying and not pl_module.automatic_optimization:
            self._engine.describe_replay(unreplayable=(
                "under manual optimization training_step steps the optimizers itself, so layerwatch cannot run it "
                "again; InspectCallback(replay=fn), fn(module, batch, batch_idx) returning the loss, replays it"
            ))
        self._begin(trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._engine is not None and self._rerunning:
            step = self._replay if callable(self._replay) else None
            closure = functools.partial(_training_step_again, trainer, pl_module, batch, batch_idx, step)
            rows = functools.partial(_first_rows_again, trainer, pl_module, batch, batch_idx, step)
            if self._replaying:
                self._engine.replay_with(closure, rows)
            else:  # a compiled module's sampled step runs it again, forward only
                self._engine.rerun_with(closure, rows)

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._engine is not None:
            self._engine.before_optimizer_step(optimizer)

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._engine is not None and self._loss_in_backward:  # a spike there is sampled in its step, where it is read
            n = self._accumulated  # Lightning divided each micro-batch's loss by their number
            self._engine.observe(loss if n == 1 else loss.detach() * n)  # averaged over the step

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = self._engine
        if engine is None:
            return
        if not self._loss_in_backward:  # training_step's (None: skipped), unscaled, divided as before the backward
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, torch.Tensor):
                engine.observe(loss if self._accumulated == 1 else loss.detach() * self._accumulated)
        if trainer.global_step == engine.current_step:
            return  # no optimizer step finished in this batch (gradient accumulation)
        engine.after_optimizer_step()
        written = engine.end_step()
        if written is not None:
            self._last_written_step = written
        self._begin(trainer.global_step)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish()

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish()

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish()

    @override
    def state_dict(self) -> dict[str, int]:
        engine = self._engine_state if self._engine is None else self._engine.state_dict()
        return {"last_written_step": self._last_written_step, **engine}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step = state_dict.get("last_written_step", -1)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"last_written_step must be an int, got {step!r}")
        self._last_written_step = step
        self._engine_state = {key: value for key, value in state_dict.items() if key != "last_written_step"}

    # ------------------------------------------------------------------ helpers

    def _begin(self, step: int) -> None:
        """Open ``step``, never sampling a step written before a resume."""
        self._engine.begin_step(step, may_sample=step > self._last_written_step)

    def _finish(self) -> None:
        if self._engine is not None:
            self._engine_state = self._engine.state_dict()  # a checkpoint saved after fit still holds it
            self._engine.finish()
            self._engine = None


_PRECISION_CLIP = ["parameters = self.main_params(optimizer)", "torch.nn.utils.clip_grad_norm_(parameters, clip_val)"]


def _clips_as_torch_does(plugin: Any) -> bool:
    """Whether ``plugin`` clips by norm as Lightning's base ``Precision`` does, to the line: one
    ``torch.nn.utils.clip_grad_norm_`` call, whose norm it drops, which the door then makes
    instead (a strategy's own clipping, FSDP's or DeepSpeed's, or a Lightning whose body
    differs, is left alone: its norm is not taken)."""
    method = getattr(type(plugin), "clip_grad_by_norm", None)
    if getattr(method, "__qualname__", "") != "Precision.clip_grad_by_norm" or not hasattr(plugin, "main_params"):
        return False
    try:
        lines = [line.strip() for line in inspect.getsource(method).splitlines()[1:]]
    except (OSError, TypeError):
        return False
    return [line for line in lines if line and not line.startswith(('"""', "#"))] == _PRECISION_CLIP


def _scaler(trainer: Any) -> Any:
    """The GradScaler of the Trainer's precision plugin ("16-mixed"), or None."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None)


def _training_step_again(trainer: Any, pl_module: Any, batch: Any, batch_idx: int, replay: Optional[Callable]) -> Any:
    """``training_step`` on ``batch`` again, as the Trainer calls it (its precision context;
    ``batch_idx`` when it takes one), or the user's ``replay(pl_module, batch, batch_idx)``;
    its ``self.log`` calls dropped: the replay is not a step."""
    with _logging_dropped(pl_module), trainer.precision_plugin.train_step_context():
        if replay is not None:
            return replay(pl_module, batch, batch_idx)
        step = pl_module.training_step
        parameters = inspect.signature(step).parameters.values()
        takes_index = len(parameters) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)
        return step(batch, batch_idx) if takes_index else step(batch)


def _first_rows_again(trainer: Any, pl_module: Any, batch: Any, batch_idx: int, replay: Optional[Callable],
                      rows: int) -> Callable[[], Any]:
    """:func:`_training_step_again` on the first ``rows`` of ``batch``, as a closure."""
    return functools.partial(_training_step_again, trainer, pl_module, first_rows(batch, rows), batch_idx, replay)


@contextlib.contextmanager
def _logging_dropped(pl_module: Any) -> Any:
    def drop(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log = pl_module.log_dict = drop  # instance attributes shadow the methods
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


def _progress_bar_pause(trainer: Any) -> Callable[[], ContextManager[object]]:
    """What to print a warning inside: with Lightning's tqdm bar showing, tqdm's own pause,
    which clears the bars and draws them again below the warning instead of breaking their line."""
    bar = trainer.progress_bar_callback
    tqdm_bars = tuple(_import_first("callbacks.TQDMProgressBar"))
    if bar is None or not isinstance(bar, tqdm_bars) or not bar.is_enabled:
        return contextlib.nullcontext
    from tqdm import tqdm

    return functools.partial(tqdm.external_write_mode, file=sys.stderr)


def _log_run_wide(loggers: Sequence[Any], record: R.StepRecord) -> None:
    """Send the run-wide scalars to loggers that are not TensorBoard (cheap: a few values)."""
    metrics = {tag: value for tag, value in record.scalars.items() if tag.startswith(V.RUN_WIDE)}
    for logger in loggers:
        logger.log_metrics(metrics, step=record.step)
