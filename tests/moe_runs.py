"""Mixture-of-Experts runs for the tests of what reads them (the notebook, the report, the tab and
its share): logs written from chosen router loads (:func:`write_loads`: exact numbers, no model),
and a tiny Mixtral trained under an Inspector (:func:`train_mixtral`), one of its routers made to
collapse onto expert 0 from a chosen step (:func:`collapse`). Importing :func:`train_mixtral`'s
transformers is left to the call."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

from layerwatch import Inspector
from layerwatch.probes.result import ProbeResult, RouterLoad
from layerwatch.sinks.record import build
from layerwatch.sinks.tensorboard import TensorBoardSink

RUN = "mixtral"  # the trained run, as the tab lists it
STEPS, EVERY = 24, 2  # sampled at 0, 2, ..., 22
EXPERTS, TOP_K, LAYERS = 8, 2, 2
COLLAPSED = "model.layers.0.mlp.gate"  # the router collapse() pushes onto expert 0
PUSH = 30.0  # what collapse() adds to expert 0's logit


def write_loads(path, loads: dict[int, dict[str, RouterLoad]]) -> None:
    """A run at ``path`` holding, at each step, the routers' ``loads`` as the engine writes them
    (``sinks.record.build``, then the TensorBoard sink)."""
    sink = TensorBoardSink(SummaryWriter(str(path)), owns_writer=True)
    for step, routers in loads.items():
        sink.write(build(step, probes=ProbeResult(modules=[], offender=None, routers=routers)))
    sink.close()


def load(tokens, bias=None) -> RouterLoad:
    return RouterLoad(np.asarray(tokens, dtype=np.int64), entropy=1.0, margin=0.1, z_mean=2.0, z_max=3.0,
                      bias=None if bias is None else np.asarray(bias, dtype=np.float64))


def collapse(router: torch.nn.Module, state: dict) -> torch.utils.hooks.RemovableHandle:
    """A forward hook on a transformers top-k router (``(logits, scores, indices)``) that, while
    ``state["on"]``, adds ``PUSH`` to expert 0's logit and routes by the pushed logits: every
    token's first choice becomes expert 0."""

    def push(module, args, output):
        if not state["on"]:
            return None
        logits, _, _ = output
        pushed = logits.clone()
        pushed[..., 0] += PUSH
        probs = torch.softmax(pushed.float(), dim=-1)
        top, indices = torch.topk(probs, module.top_k, dim=-1)
        return pushed, top / top.sum(dim=-1, keepdim=True), indices

    return router.register_forward_hook(push)


def sequences(batch: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Token sequences of a rule a model can learn (from a random start, each token is the one
    before it plus 7, and a little more at some positions, modulo 64). Not random tokens: on
    those a tiny model's hidden states lose each token's identity and its routers collapse on
    their own, load-balancing loss or not."""
    start = torch.randint(0, 64, (batch[0], 1), generator=generator)
    at = torch.arange(batch[1])
    return (start + at * 7 + (at * at) % 5) % 64


def train_mixtral(log_dir, steps: int = STEPS, every: int = EVERY, collapse_from: Optional[int] = None, *,
                  layers: int = LAYERS, width: int = 32, batch: tuple[int, int] = (4, 16), aux_loss: float = 0.02,
                  seed: int = 0) -> None:
    """A tiny Mixtral (``layers`` layers of ``EXPERTS`` experts, top-``TOP_K``, trained with its
    load-balancing loss weighted ``aux_loss``) under an Inspector; with ``collapse_from``, router
    ``COLLAPSED`` collapses onto expert 0 from that step on."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=width, intermediate_size=2 * width,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=width // 4, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                        output_router_logits=aux_loss > 0, router_aux_loss_coef=aux_loss)
    model = transformers.MixtralForCausalLM(config)
    state = {"on": False}
    handle = collapse(model.get_submodule(COLLAPSED), state) if collapse_from is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # too few samples for the trend rules
        with Inspector(model, log_dir=log_dir, every_n_steps=every, optimizer=opt) as inspector:
            for step in range(steps):
                state["on"] = collapse_from is not None and step >= collapse_from
                ids = sequences(batch, generator)
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                inspector.step()
    if handle is not None:
        handle.remove()
