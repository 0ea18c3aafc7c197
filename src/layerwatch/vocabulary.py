"""The names layerwatch's writer and readers share: tags, series keys, families, the model's
own name, and the LAYERWATCH tab's data format. No torch and no NumPy here: TensorBoard's
process imports it with the tab.

Tag contract (see ``docs/tags.md``): the family comes first so TensorBoard groups cards
by it, then the qualified name as ``model.named_parameters()`` spells it. A per-layer tag's
head, before its ``/``, is its **series key** (``grads_norm``, ``fwd_ms``): the LAYERWATCH
tab's series and ``layerwatch report``'s tables are keyed by it.
"""

from __future__ import annotations

import enum

ROOT = "(root)"  # the name layerwatch gives the model itself (named_modules() names it "")



class Family(str, enum.Enum):
    """A family of measurements (the ``families=`` option). A ``str`` enum: a family equals its
    name (``Family.GRADS == "grads"``), so the families a user passes as strings work as they are."""

    WEIGHTS = "weights"
    GRADS = "grads"
    UPDATES = "updates"
    OPTIMIZER = "optimizer"
    STRUCTURE = "structure"
    LATENCY = "latency"
    MEMORY = "memory"
    ACTIVATIONS = "activations"
    NONFINITE = "nonfinite"
    ATTENTION = "attention"
    LOGITS = "logits"
    MOE = "moe"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# The families by kind, as their names (what tags are built from).
TENSOR_FAMILIES = (Family.WEIGHTS.value, Family.GRADS.value)
PROBE_FAMILIES = tuple(f.value for f in (Family.LATENCY, Family.MEMORY, Family.ACTIVATIONS, Family.NONFINITE, Family.ATTENTION,
                                         Family.LOGITS, Family.MOE))
FAMILIES = TENSOR_FAMILIES + (Family.UPDATES.value, Family.OPTIMIZER.value, Family.STRUCTURE.value) + PROBE_FAMILIES

# The per-tensor statistics (the ``stats=`` option): tagged <family>_<stat>/<name>.
STATS = ("mean", "std", "min", "max", "norm", "zero_frac", "nonfinite")

# Run-wide tags.
RUN_WIDE = "layerwatch/"  # the prefix of the run-wide tags below
GRAD_NORM = "layerwatch/grad_norm"
OVERHEAD_MS = "layerwatch/overhead_ms"
SAMPLE_INTERVAL = "layerwatch/sample_interval"  # the overhead budget's interval from this sample on
STRUCTURE = "layerwatch/structure"
PARAMS_TOTAL = "layerwatch/params_total"
PARAMS_LEARNABLE = "layerwatch/params_learnable"
PARAMS_FROZEN = "layerwatch/params_frozen"
MACS_PER_STEP = "layerwatch/macs_per_step"
ALERTS = "layerwatch/alerts"  # the count (scalar) and the table (text)
ALERTS_TEXT = ALERTS + "/text_summary"  # the tag torch's text builder gives the table
OPTIMIZER_SKIPPED = "layerwatch/optimizer_skipped"
NONFINITE_MODULES = "layerwatch/nonfinite_modules"
FIRST_OFFENDER = "layerwatch/first_offender"  # text
FIRST_NONFINITE_STEP = "layerwatch/first_nonfinite_step"
LOSS = "layerwatch/loss"  # the loss as the spike check saw it: each spike's lead-up, every step of it
GRAD_NORM_LEAD_UP = "layerwatch/grad_norm_lead_up"  # the global gradient norm as the spike check saw it, likewise
LEAD_UPS = (LOSS, GRAD_NORM_LEAD_UP)  # written a step each at a spike, not at samples

# Per-module scalars of the runtime probes, tagged <field>/<module> after the ModuleTrace field.
FWD_MS, BWD_MS = "fwd_ms", "bwd_ms"
ACTIVATION_BYTES, SAVED_BYTES, CUDA_ALLOC_BYTES = "activation_bytes", "saved_bytes", "cuda_alloc_bytes"
NONFINITE = "nonfinite"  # 1 when the module's output or gradient held NaN/Inf
MODULE_SCALARS = (FWD_MS, BWD_MS, ACTIVATION_BYTES, SAVED_BYTES, CUDA_ALLOC_BYTES, NONFINITE)
TIME_SERIES = (FWD_MS, BWD_MS)
MEMORY_SERIES = (ACTIVATION_BYTES, SAVED_BYTES, CUDA_ALLOC_BYTES)
UPDATE_RATIO = "update_ratio"
UPDATE_RATIO_ESTIMATE = "update_ratio_estimate"  # from a strided sample of each weight

# Per-tensor series of Adam's own state (the "optimizer" family), tagged <series>/<param>.
ADAM_UPDATE_RMS = "adam_update_rms"  # RMS(m̂ / (√v̂ + ε)) after the step
ADAM_EPS_FRAC = "adam_eps_frac"  # share of the coordinates with v > 0 whose √v̂ < 10ε
ADAM_SPIKE_FRAC = "adam_spike_frac"  # share of the coordinates with v > 0 whose g² > θ·v̂ before the step
ADAM_SERIES = (ADAM_UPDATE_RMS, ADAM_EPS_FRAC, ADAM_SPIKE_FRAC)

# Per attention module (the "attention" family; probes/attention.py), its heads folded: the
# largest logit of any head, the lowest mean entropy of any head; and each head's, as a row
# <module>#<head> of its own in the tab.
ATTENTION_LOGIT_MAX = "attention_logit_max"
ATTENTION_ENTROPY = "attention_entropy"
ATTENTION_HEAD_LOGIT_MAX = "attention_head_logit_max"
ATTENTION_HEAD_ENTROPY = "attention_head_entropy"

# The output head's logits (the "logits" family; probes/logits.py): log Z, the logsumexp of a
# token's logits over the vocabulary, its mean and its largest over the step's tokens.
LOGSUMEXP_MEAN = "logsumexp_mean"
LOGSUMEXP_MAX = "logsumexp_max"

# Per Mixture-of-Experts router (the "moe" family; probes/routers.py), tagged <series>/<router>, the
# router module's name; the per-expert series as rows <router>#<expert> of their own (expert_name).
MOE_TOKENS = "moe_tokens"  # per expert: tokens routed to it at the step (exact, summed over micro-batches and ranks)
MOE_IMBALANCE = "moe_imbalance"  # max over experts of tokens / mean tokens (1: balanced; E/k, its largest: k experts take every token)
MOE_DEAD = "moe_dead"  # experts that got no token at the step
MOE_ENTROPY = "moe_entropy"  # mean over tokens of the entropy of softmax(router logits), nats
MOE_MARGIN = "moe_margin"  # mean over tokens of the top-1 margin: the first routing probability less the second
MOE_ROUTER_Z = "moe_router_z"  # mean over tokens of logsumexp(router logits)
MOE_ROUTER_Z_MAX = "moe_router_z_max"  # its largest
MOE_DROPPED = "moe_dropped"  # tokens a capacity limit dropped (a router declared with a capacity factor)
MOE_BIAS = "moe_bias"  # per expert: the aux-free balancing bias (DeepSeek's e_score_correction_bias, torchtitan's expert_bias)
MOE_EXPERT_SERIES = (MOE_TOKENS, MOE_BIAS)

# Per module output (the "activations" family): max|h| / RMS(h), outlier features' mark.
ACTIVATION_OUTLIER = "activations_outlier"
ACTIVATION_KURTOSIS = "activations_kurtosis"  # mean(s⁴) / mean(s²)² of its per-channel RMS s (eager forwards)

# Per-layer series kept out of TensorBoard's cards (see record.CardFilter); the LAYERWATCH tab has them.
BYTE_SERIES = (ACTIVATION_BYTES, SAVED_BYTES)
TAB_ONLY_SERIES = BYTE_SERIES + ADAM_SERIES + MOE_EXPERT_SERIES + (
    ATTENTION_HEAD_LOGIT_MAX, ATTENTION_HEAD_ENTROPY, ACTIVATION_OUTLIER, ACTIVATION_KURTOSIS)  # too many for cards
# ... and so are the rows <param>[e] of fused expert parameters (is_expert_param_row) in the weights', gradients' and
# update ratios' series: a model's experts times their parameters times three series.
NONFINITE_SERIES = ("weights_nonfinite", "grads_nonfinite", "activations_nonfinite", NONFINITE)

# The LAYERWATCH tab's data (written by sinks/plugin_data.py, read by reading/events.py):
# tensors owned by the plugin PLUGIN_NAME, at each sampled step.
PLUGIN_NAME = "layerwatch"
SERIES = "layerwatch/series/"  # + a series key: float32 [n], one value per layer of the layout's names
LAYOUT = "layerwatch/layout"  # JSON {"series": {series key: [layer names]}}
EVENTS = "layerwatch/events/"  # + alerts, first_offender, first_nonfinite_step, spikes, rerun: JSON


def series_key(family: str, stat: str) -> str:
    """The series of a per-tensor statistic: ``grads_norm``."""
    return f"{family}_{stat}"


def stat_prefix(family: str, stat: str) -> str:
    """The prefix of a per-tensor statistic's tags: ``weights_norm/`` (its series key and a ``/``)."""
    return f"{family}_{stat}/"


def module_prefix(field_name: str) -> str:
    """The prefix of a per-module scalar's tags (one of ``MODULE_SCALARS``): ``fwd_ms/``."""
    return f"{field_name}/"


def histogram_tag(family: str, name: str) -> str:
    return f"{family}/{name}"


def update_ratio_tag(name: str, estimated: bool = False) -> str:
    """``update_ratio/<param>``; ``update_ratio_estimate/<param>`` for a ratio of strided samples."""
    return f"{UPDATE_RATIO_ESTIMATE if estimated else UPDATE_RATIO}/{name}"


def nonfinite_total_tag(family: str) -> str:
    """The run-wide count of NaN/Inf values of a tensor family: ``layerwatch/grads_nonfinite``."""
    return RUN_WIDE + series_key(family, "nonfinite")


def head_name(module: str, head: int) -> str:
    """The tab's row of one attention head: ``transformer.h.0.attn#3``."""
    return f"{module}#{head}"


def expert_name(router: str, expert: int) -> str:
    """The row of one expert of a router in the per-expert series (``moe_tokens``, ``moe_bias``):
    ``model.layers.0.mlp.gate#5``; the same form as an attention head's (:func:`head_name`)."""
    return f"{router}#{expert}"


def expert_names(router: str, experts: int) -> list[str]:
    """:func:`expert_name` of each of a router's ``experts``, in one call (a sampled step's host
    work per router does not grow with its experts)."""
    return [f"{router}#{e}" for e in range(experts)]


def expert_param_name(param: str, expert: int) -> str:
    """The row of one expert's slice of a fused expert parameter (``[experts, ...]``) in the
    weights', gradients' and update ratios' series: ``model.layers.0.mlp.experts.gate_up_proj[5]``."""
    return f"{param}[{expert}]"


def is_expert_param_row(name: str) -> bool:
    """Whether a layer name is one expert's slice of a fused expert parameter (:func:`expert_param_name`)."""
    return name.endswith("]")


def parent(name: str) -> str:
    """The qualified name one level up: ``"blocks.0.mlp.weight"`` -> ``"blocks.0.mlp"``
    (a parameter's module; a module's parent); ``""`` (the model) at the top."""
    return name.rpartition(".")[0]
