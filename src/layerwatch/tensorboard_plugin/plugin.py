"""The LAYERWATCH tab's backend: JSON routes over TensorBoard's data provider.

Everything is read through the data provider (so the Python reader, ``--load_fast`` and the
Rust data server all work): the tab's own compact tensors (:mod:`layerwatch.reading.events`) for the
heatmaps, rankings and markers, and the histograms plugin's data for a layer's histograms.
A run's series are read once per change of the run (TensorBoard reports each tag's last step
and wall time) and kept.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import werkzeug
from tensorboard import plugin_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import exceptions, wrappers

from layerwatch.reading import rankings
from layerwatch import vocabulary as V
from layerwatch.reading.events import Reader, decode
from layerwatch.reading.experts import experts_of
from layerwatch.vocabulary import EVENTS, LAYOUT, PLUGIN_NAME, SERIES

logger = logging.getLogger("layerwatch")
STATIC = Path(__file__).parent / "static"
_ALL = 10**9  # downsample to this many: all (the loader asks TensorBoard to keep every sample)

# How each series is shown: label, unit, default colour scale, and how a collapsed block's row
# is made from its children when the block has no row of its own.
_STATS: dict[str, tuple[str, str, str, str]] = {
    V.series_key("grads", "norm"): ("gradient norm", "L2 norm", "log", "rss"),
    V.series_key("weights", "norm"): ("weight norm", "L2 norm", "log", "rss"),
    V.UPDATE_RATIO: ("update ratio", "‖Δw‖ / ‖w‖ per step", "log", "max"),
    V.ATTENTION_LOGIT_MAX: ("largest attention logit", "q·k/√d, the largest head's", "log", "max"),
    V.ATTENTION_ENTROPY: ("attention entropy", "nats, the lowest head's", "linear", "min"),
    V.ATTENTION_HEAD_LOGIT_MAX: ("largest attention logit, per head", "q·k/√d", "log", "max"),
    V.ATTENTION_HEAD_ENTROPY: ("attention entropy, per head", "nats", "linear", "min"),
    V.ACTIVATION_OUTLIER: ("activation outliers", "max|h| / RMS(h)", "log", "max"),
    V.ACTIVATION_KURTOSIS: ("per-channel kurtosis of activations", "mean(s⁴) / mean(s²)², s a channel's RMS", "log", "max"),
    V.ADAM_UPDATE_RMS: ("Adam's normalized update RMS", "RMS(m̂ / (√v̂ + ε)): 1 = sign-like", "linear", "max"),
    V.ADAM_EPS_FRAC: ("Adam's ε-bound share", "share of coordinates with √v̂ < 10ε", "linear", "max"),
    V.ADAM_SPIKE_FRAC: ("Adam's gradient-spike share", "share of coordinates with g² > 5000 v̂", "linear", "max"),
    V.FWD_MS: ("forward time", "ms", "log", "sum"),
    V.BWD_MS: ("backward time", "ms", "log", "sum"),
    V.ACTIVATION_BYTES: ("activation bytes", "bytes", "log", "sum"),
    V.SAVED_BYTES: ("bytes saved for backward", "bytes", "log", "sum"),
    V.CUDA_ALLOC_BYTES: ("GPU memory growth", "bytes", "linear", "sum"),
    V.NONFINITE: ("non-finite output or gradient", "0 / 1", "linear", "max"),
    V.series_key("grads", "nonfinite"): ("NaN/Inf gradient values", "count", "linear", "sum"),
    V.series_key("weights", "nonfinite"): ("NaN/Inf weight values", "count", "linear", "sum"),
    V.MOE_IMBALANCE: ("expert load imbalance", "max / mean tokens per expert", "linear", "max"),
    V.MOE_DEAD: ("dead experts", "experts given no token", "linear", "sum"),
    V.MOE_TOKENS: ("tokens per expert", "tokens routed to it", "linear", "sum"),
    V.MOE_ENTROPY: ("routing entropy", "nats, mean over tokens", "linear", "min"),
    V.MOE_MARGIN: ("routing top-1 margin", "p₁ − p₂, mean over tokens", "linear", "max"),
    V.MOE_ROUTER_Z: ("router log Z", "logsumexp, mean over tokens", "linear", "max"),
    V.MOE_ROUTER_Z_MAX: ("router log Z, largest", "logsumexp, largest token's", "linear", "max"),
    V.MOE_DROPPED: ("dropped tokens", "tokens over an expert's capacity", "linear", "sum"),
    V.MOE_BIAS: ("balancing bias per expert", "added to the routing scores", "linear", "max"),
}
_STAT_NAMES = {"mean": "mean", "std": "std", "min": "min", "max": "max", "norm": "norm", "zero_frac": "zero fraction"}


def describe(key: str, rerun: bool = False) -> dict[str, Any]:
    """The tab's description of a series key (known or not); ``rerun``: the run's per-module values
    are of a compiled model's eager re-run, whose forward time is eager time."""
    if key in _STATS:
        label, unit, scale, collapse = _STATS[key]
        if rerun and key == V.FWD_MS:
            label, unit = "forward time (eager re-run)", "ms, the compiled model run eagerly, autograd off"
    else:
        family, _, stat = key.partition("_")
        label = f"{family} {_STAT_NAMES.get(stat, stat)}"
        unit, scale, collapse = ("count", "linear", "sum") if stat == "nonfinite" else ("value", "linear", "max")
        if stat == "norm":
            unit, scale, collapse = "L2 norm", "log", "rss"
    described = {"key": key, "label": label, "unit": unit, "scale": scale, "collapse": collapse}
    if key in V.MOE_EXPERT_SERIES:  # rows <router>#<e>, folded into their router as a module's heads are
        described["parts"] = "experts"
    return described


def _order(key: str) -> tuple[int, str]:
    known = list(_STATS)
    return (known.index(key), key) if key in known else (len(known), key)


class LayerwatchPlugin(base_plugin.TBPlugin):
    """The LAYERWATCH tab."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider
        self._cache: dict[tuple[str, str, str], tuple[Any, list[tuple[int, float, Any]]]] = {}
        self._lock = threading.Lock()

    def is_active(self) -> bool:
        return False  # TensorBoard activates the tab from the data provider's plugin listing

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Layerwatch")

    def get_plugin_apps(self) -> dict[str, Callable]:
        return {
            "/index.js": self._serve_index,
            "/runs": self._route(self.runs),
            "/stats": self._route(self.stats),
            "/heatmap": self._route(self.heatmap),
            "/layer": self._route(self.layer),
            "/events": self._route(self.events),
            "/rankings": self._route(self.rankings),
            "/experts": self._route(self.experts),
        }

    @wrappers.Request.application
    def _serve_index(self, request: wrappers.Request) -> werkzeug.Response:
        return werkzeug.Response((STATIC / "index.js").read_bytes(), content_type="text/javascript; charset=utf-8")

    def _route(self, handler: Callable[..., dict[str, Any]]) -> Callable:
        @wrappers.Request.application
        def app(request: wrappers.Request) -> werkzeug.Response:
            ctx = plugin_util.context(request.environ)
            experiment = plugin_util.experiment_id(request.environ)
            try:
                body, status = handler(ctx, experiment, request.args), 200
            except exceptions.HTTPException as e:  # the page shows the message
                body, status = {"error": e.description}, e.code
            except Exception as e:  # a damaged log must not take the page down with an HTML error
                logger.exception("layerwatch tab: %s failed", request.path)
                body, status = {"error": f"{type(e).__name__}: {e}"}, 500
            return werkzeug.Response(json.dumps(body, allow_nan=False), status=status, content_type="application/json")

        return app

    # ------------------------------------------------------------------ reading

    def _tags(self, ctx: Any, experiment: str) -> dict[str, dict[str, Any]]:
        """Every run's tags; the decoded points of a run or tag no longer listed (deleted from
        the log directory) are dropped, so a long-lived server keeps only what it can show."""
        listing = self._provider.list_tensors(ctx, experiment_id=experiment, plugin_name=PLUGIN_NAME)
        with self._lock:
            for key in [k for k in self._cache if k[0] == experiment and k[2] not in listing.get(k[1], ())]:
                del self._cache[key]
        return listing

    def _reader(self, ctx: Any, experiment: str, run: str, series: Optional[list[str]] = None) -> Reader:
        """The run's layout and events, and the ``series`` asked for (all when None)."""
        listing = self._tags(ctx, experiment).get(run)
        if not listing:
            raise exceptions.NotFound(f"no layerwatch data in run {run!r}")
        wanted = [
            tag for tag in listing
            if tag == LAYOUT or tag.startswith(EVENTS)
            or (tag.startswith(SERIES) and (series is None or tag[len(SERIES) :] in series))
        ]
        reader = Reader()
        for tag in wanted:
            for step, wall_time, value in self._read(ctx, experiment, run, tag, listing[tag]):
                reader.add(step, wall_time, tag, value)
        return reader

    def _read(self, ctx: Any, experiment: str, run: str, tag: str, meta: Any) -> list[tuple[int, float, Any]]:
        """A tag's points, decoded, as kept since the tag last changed."""
        version = (meta.max_step, meta.max_wall_time)
        key = (experiment, run, tag)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        data = self._provider.read_tensors(
            ctx, experiment_id=experiment, plugin_name=PLUGIN_NAME, downsample=_ALL,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]),
        )
        points = [(datum.step, datum.wall_time, decode(tag, datum.numpy)) for datum in data.get(run, {}).get(tag, [])]
        with self._lock:
            self._cache[key] = (version, points)
        return points

    # ------------------------------------------------------------------ routes

    def runs(self, ctx: Any, experiment: str, args: Any) -> dict[str, Any]:
        out = []
        for run, tags in sorted(self._tags(ctx, experiment).items()):
            keys = _series_keys(tags)
            if keys:
                steps = self._reader(ctx, experiment, run, keys[:1]).steps()
                out.append({"run": run, "first_step": steps[0], "last_step": steps[-1], "samples": len(steps)})
        return {"runs": out}

    def stats(self, ctx: Any, experiment: str, args: Any) -> dict[str, Any]:
        run = _arg(args, "run")
        keys = _series_keys(self._tags(ctx, experiment).get(run) or {})
        if not keys:
            raise exceptions.NotFound(f"no layerwatch data in run {run!r}")
        reader = self._reader(ctx, experiment, run, keys[:1])
        rows = reader.layout_sizes()
        rerun = any(events.get("rerun") for _, events in reader.events)  # a compiled model's: see describe
        return {"run": run, "steps": reader.steps(),
                "stats": [dict(describe(key, rerun), rows=rows.get(key, 0)) for key in keys]}

    def heatmap(self, ctx: Any, experiment: str, args: Any) -> dict[str, Any]:
        run, stat = _arg(args, "run"), _arg(args, "stat")
        rows, steps, matrix = self._reader(ctx, experiment, run, [stat]).matrix(stat)
        if not rows:
            raise exceptions.NotFound(f"run {run!r} has no series {stat!r}")
        return {"run": run, "stat": stat, "rows": list(rows), "steps": steps, "values": _base64(matrix)}

    def experts(self, ctx: Any, experiment: str, args: Any) -> dict[str, Any]:
        """A run's Mixture-of-Experts routers for the tab's experts view: ``routers`` (model order),
        ``experts`` (each router's count), ``steps``; and as base64 float32 rows, one per expert
        (router by router, its experts in order) by step, ``tokens`` and ``shares`` (its share of
        the router's tokens: NaN where none was routed), and one per router, ``imbalance``; -inf
        where a router was not measured."""
        run = _arg(args, "run")
        found = experts_of(self._reader(ctx, experiment, run, [V.MOE_TOKENS, V.MOE_IMBALANCE]))
        if found is None:
            raise exceptions.NotFound(f"run {run!r} has no Mixture-of-Experts router (no {V.MOE_TOKENS} series)")
        return {
            "run": run, "routers": found.routers, "experts": found.counts, "steps": found.steps,
            "tokens": _base64(found.tokens), "shares": _base64(found.shares()), "imbalance": _base64(found.imbalance),
        }

    def layer(self, ctx: Any, experiment: str, args: Any) -> dict[str, Any]:
        """A layer's series, its histograms, and for an attention module each per-head series as
        heads x steps (``heads``: empty for a layer without heads)."""
        run, name = _arg(args, "run"), _arg(args, "name")
        answer = self.layers(ctx, experiment, run, [name]).get(name)
        if answer is None:
            raise no_layer(run, name)
        return answer

    def layers(self, ctx: Any, experiment: str, run: str, names: list[str]) -> dict[str, dict[str, Any]]:
        """The ``layer`` route's answer for each of ``names`` that has any series or head in
        ``run`` (a name with none is left out: the route answers it with :func:`no_layer`).
        One pass over the run's data for all of them."""
        reader = self._reader(ctx, experiment, run)
        wanted = set(names)
        points: dict[str, dict[str, dict[int, float]]] = {}
        heads: dict[str, dict[str, dict[str, Any]]] = {}
        for key in sorted(reader.keys(), key=_order):
            series = reader.series(key)
            for name, by_step in _points(series, wanted).items():
                points.setdefault(name, {})[key] = by_step
            for module, of_heads in _heads(series, wanted).items():
                heads.setdefault(module, {})[key] = of_heads
        found = [name for name in dict.fromkeys(names) if name in points or name in heads]
        histograms = self._histograms(ctx, experiment, run, found)
        return {name: _layer_answer(name, points.get(name, {}), heads.get(name, {}), histograms.get(name, {}))
                for name in found}

    def _histograms(self, ctx: Any, experiment: str, run: str, names: list[str]) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """For each of ``names``: the histograms of the name itself, and, for a module, of its own
        parameters (:func:`_histogram_owners`)."""
        listing = self._provider.list_tensors(ctx, experiment_id=experiment, plugin_name="histograms").get(run, {})
        wanted = set(names)
        tags_of: dict[str, list[str]] = {}
        for tag in sorted(listing):
            for owner in _histogram_owners(tag):
                if owner in wanted:
                    tags_of.setdefault(owner, []).append(tag)
        if not tags_of:
            return {}
        tags = sorted({tag for tags in tags_of.values() for tag in tags})
        data = self._provider.read_tensors(
            ctx, experiment_id=experiment, plugin_name="histograms", downsample=_ALL,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags),
        ).get(run, {})
        entries = {tag: [{"step": d.step, "buckets": np.asarray(d.numpy, dtype=float).tolist()} for d in data.get(tag, [])]
                   for tag in tags}
        return {name: {tag: entries[tag] for tag in of} for name, of in tags_of.items()}

    def events(self, ctx: Any, experiment: str, args: Any) -> dict[str, Any]:
        run = _arg(args, "run")
        reader = self._reader(ctx, experiment, run, [])
        alerts: list[dict[str, Any]] = []
        spikes: list[dict[str, Any]] = []
        offender, first_step = None, None
        for _, events in sorted(reader.events, key=lambda item: item[0]):
            alerts += events.get("alerts", [])
            spikes += events.get("spikes", [])
            offender = offender or events.get("first_offender")
            step = events.get("first_nonfinite_step")
            if step is not None and (first_step is None or step < first_step):
                first_step = step
        return {"alerts": alerts, "first_nonfinite_step": first_step, "first_offender": offender, "spikes": spikes}

    def rankings(self, ctx: Any, experiment: str, args: Any) -> dict[str, Any]:
        run = _arg(args, "run")
        grads_norm = V.series_key("grads", "norm")
        reader = self._reader(ctx, experiment, run, [*V.TIME_SERIES, *V.BYTE_SERIES, grads_norm])
        tables = {key: reader.table(key) for key in reader.keys()}
        slowest = rankings.top_by_median([tables[k] for k in V.TIME_SERIES if k in tables], "value", top=10)
        memory = rankings.top_by_median([tables[k] for k in V.BYTE_SERIES if k in tables], "value", top=10)
        growth = [] if grads_norm not in tables else rankings.growth(tables[grads_norm], top=10)
        rerun = any(events.get("rerun") for _, events in reader.events)  # a compiled model's: forward only, eager
        return {"rankings": [
            _ranking("slowest", "Slowest layers", "ms",
                     "leaf layers, median forward ms of the eager re-run over the samples (the model is compiled)"
                     if rerun else "leaf layers, median forward + backward ms over the samples",
                     slowest, "no fwd_ms/bwd_ms: the latency probes were off"),
            _ranking("memory", "Largest memory", "bytes",
                     "leaf layers, median activation bytes (the model is compiled: nothing saved for a backward)"
                     if rerun else "leaf layers, median activation + saved-for-backward bytes", memory,
                     "no activation_bytes/saved_bytes: the memory probes were off"),
            _ranking("grad_growth", "Largest gradient growth", "x",
                     "gradient norm, last sample / first: ×N grew N times, ÷N shrank",
                     [{"name": r["name"], "value": r["factor"]} for r in growth],
                     "no gradient norms over two samples or more"),
        ]}


def no_layer(run: str, name: str) -> exceptions.NotFound:
    """The ``layer`` route's answer for a name without any series or head in ``run``."""
    return exceptions.NotFound(f"run {run!r} has no layer {name!r}")


def _layer_answer(name: str, points: dict[str, dict[int, float]], heads: dict[str, dict[str, Any]],
                  histograms: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    steps = sorted({step for by_step in points.values() for step in by_step})
    series = {key: [_json_value(by_step.get(step)) for step in steps] for key, by_step in points.items()}
    return {"name": name, "steps": steps, "series": series, "heads": heads, "histograms": histograms}


def _points(series: dict[int, tuple[list[str], np.ndarray]], names: set[str]) -> dict[str, dict[int, float]]:
    """``{name: {step: value}}`` of one series, for the ``names`` it has."""
    found: dict[str, dict[int, float]] = {}
    picked: dict[int, tuple[list[str], np.ndarray]] = {}  # the steps of one layout share its list of names
    for step, (row_names, values) in series.items():
        pick = picked.get(id(row_names))
        if pick is None:
            at: dict[str, int] = {}
            for i, n in enumerate(row_names):
                if n in names:
                    at.setdefault(n, i)
            pick = picked[id(row_names)] = (list(at), np.fromiter(at.values(), dtype=np.int64, count=len(at)))
        for name, value in zip(pick[0], values[pick[1]].tolist()):
            found.setdefault(name, {})[step] = value
    return found


def _heads(series: dict[int, tuple[list[str], np.ndarray]], modules: set[str]) -> dict[str, dict[str, Any]]:
    """For each of ``modules`` with heads in this series (rows ``<module>#<h>``, an attention
    module's heads: ``V.head_name``): ``{"heads": [row names, by head], "steps": [...],
    "values": [[a head's value per step], ...]}``."""
    found: dict[str, dict[str, dict[int, float]]] = {}
    picked: dict[int, list[tuple[str, str, int]]] = {}  # the steps of one layout share its list of names
    for step, (names, values) in series.items():
        pick = picked.get(id(names))
        if pick is None:
            pick = picked[id(names)] = [(module, n, i) for i, n in enumerate(names)
                                        for module in [_head_module(n)] if module in modules]
        for module, head, i in pick:
            found.setdefault(module, {}).setdefault(head, {})[step] = float(values[i])
    return {module: _heads_answer(module, by_head) for module, by_head in found.items()}


def _head_module(name: str) -> Optional[str]:
    """The module of a head's row ``<module>#<h>``; None for any other row."""
    module, hash_sign, head = name.rpartition("#")
    return module if hash_sign and head.isdecimal() else None


def _heads_answer(module: str, found: dict[str, dict[int, float]]) -> dict[str, Any]:
    prefix = f"{module}#"
    names = sorted(found, key=lambda head: int(head[len(prefix) :]))
    steps = sorted({step for by_step in found.values() for step in by_step})
    return {"heads": names, "steps": steps, "values": [[_json_value(found[head].get(step)) for step in steps] for head in names]}


def _histogram_owners(tag: str) -> list[str]:
    """The layers whose detail shows the histogram ``tag`` (``family/name``): ``name`` itself,
    and for a parameter's (not an activation's) the module that owns it (``(root)`` for a
    top-level parameter)."""
    family, _, of = tag.partition("/")
    if family == V.Family.ACTIVATIONS:
        return [of]
    module, dot, _ = of.rpartition(".")
    return [of, module if dot else V.ROOT]


def _series_keys(listing: dict[str, Any]) -> list[str]:
    return sorted((tag[len(SERIES) :] for tag in listing if tag.startswith(SERIES)), key=_order)


def _ranking(key: str, title: str, unit: str, note: str, rows: list[dict[str, Any]], missing: str) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "title": title, "unit": unit, "note": note,
                           "rows": [{"layer": r["name"], "value": r["value"]} for r in rows]}
    if not rows:
        out["missing"] = missing
    return out


def _arg(args: Any, name: str) -> str:
    value = args.get(name)
    if not value:
        raise exceptions.BadRequest(f"missing query parameter {name!r}")
    return value


def _base64(matrix: np.ndarray) -> str:
    """A matrix as the routes send one: base64 of its float32 values, little-endian, row by row."""
    return base64.b64encode(np.ascontiguousarray(matrix, dtype="<f4").tobytes()).decode("ascii")


def _json_value(value: Optional[float]) -> Any:
    """A number, "NaN" (a non-finite statistic: a finding), or None (not measured)."""
    if value is None or value == -math.inf:
        return None
    return value if math.isfinite(value) else "NaN"
