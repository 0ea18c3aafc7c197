"""The runs the browser tests open: the demo's, with its NaN and its loss spike between samples
(``INJECT``, ``SPIKE``; the ``demo_logs`` fixture writes it), and an SdpaLM's with attention
heads (:func:`train`)."""

from __future__ import annotations

import warnings

import torch

from layerwatch import Inspector
from models import SdpaAttention, SdpaLM, lm_step

INJECT = 183  # the demo's NaN, from encoder.fault, between samples: found by replaying step 183
# The demo's loss spike, from encoder.fault too, between samples: replayed at step 166. Not
# earlier: while the loss still falls 50 times over the window (its first 40 steps), a spike
# stands fewer than 6 deviations of the window's logarithm above it.
SPIKE = 166

HEADS = 4
RUN = "sdpa"  # the heads' run, as the tab lists it
STEPS, EVERY = 24, 2  # sampled at 0, 2, ..., 22; the attention from the first sample on


def train(log_dir, steps=STEPS, every=EVERY, heads=HEADS, width=32):
    """SdpaLM with ``heads`` heads per block, trained under an Inspector."""
    torch.manual_seed(0)
    model = SdpaLM(d=width)
    for block in model.blocks:
        block.attn = SdpaAttention(width, heads=heads)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # too few samples for the trend rules
        with Inspector(model, log_dir=log_dir, every_n_steps=every, optimizer=opt) as inspector:
            for _ in range(steps):
                ids = torch.randint(0, 32, (8, 16), generator=generator)
                lm_step(model, opt, ids)
                inspector.step()
