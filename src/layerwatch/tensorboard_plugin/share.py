"""``layerwatch report LOGDIR --html OUT``: runs shared as one HTML file that opens in any
browser, offline, and shows what the LAYERWATCH tab shows.

One front end: the file runs the tab's own ``index.js``. Only where its data comes from
differs: every request the page can make (each route, for each run, statistic and layer) is
answered here, ahead of time, by the tab's own route functions over TensorBoard's own data
provider, and the answers, exactly as the routes send them (status and JSON), are inlined in
the page (:mod:`layerwatch.tensorboard_plugin.packing`). ``index.js`` answers its requests from them when the page
holds them (the ``#layerwatch-data`` element), and from the routes otherwise.
"""

from __future__ import annotations

import base64
import fnmatch
import html
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Container, Iterator, Optional

import numpy as np

from layerwatch import __version__
from layerwatch import vocabulary as V
from layerwatch.tensorboard_plugin.packing import Float32Rows, pack

logger = logging.getLogger("layerwatch")
DATA_ELEMENT_ID = "layerwatch-data"  # index.js reads the answers from the element with this id
_EXPERIMENT = ""
# Only what the file holds: no request leaves the page (canvas drawing needs no source).
_CONTENT_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:"
Answer = list[Any]  # [HTTP status, reason, JSON body]: what a route sends


class ShareError(Exception):
    """The file cannot be written: a bad argument or log directory, named in the message."""


@dataclass(frozen=True)
class Shared:
    """What :func:`write_html` wrote."""

    path: Path
    size: int  # bytes
    runs: list[str]
    stats: int  # the statistics of the runs, together
    layers: int  # the layers whose detail the file holds, over its runs


@dataclass(frozen=True)
class Narrowing:
    """What ``--stats``, ``--steps`` and ``--every-nth`` keep of each run (None: all)."""

    stats: Optional[list[str]] = None
    steps: Optional[Container[int]] = None  # step numbers
    every_nth: Optional[int] = None  # of the samples within ``steps``

    def narrows(self) -> bool:
        return self.stats is not None or self.steps is not None or self.every_nth is not None


def write_html(logdir: str | os.PathLike, out: str | os.PathLike, *, runs: Optional[str] = None,
               narrowing: Narrowing = Narrowing()) -> Shared:
    """Writes the runs of ``logdir`` (those matching the glob ``runs``) as one self-contained
    HTML file ``out``; nothing is written when anything fails.

    Raises:
        ShareError: ``out`` cannot be written; ``logdir`` is missing or holds no data of the
            LAYERWATCH tab; ``runs`` matches no run; ``narrowing`` names an unknown
            statistic or keeps no sampled step.
    """
    out = Path(out)
    check_writable(out)
    chosen = _chosen_runs(logdir, runs)
    source = _provider(logdir, chosen)
    whole = _plugin(source)
    names = _runs_with_data(whole, logdir, chosen)
    if narrowing.stats is not None:
        _check_stats(whole, names, narrowing.stats)
    view = _plugin(_Narrowed(source, narrowing.stats, _kept_steps(whole, names, narrowing))) \
        if narrowing.narrows() else whole
    answers = collect_answers(whole, view, names)
    text = page(base64.b64encode(pack(answers)).decode("ascii"), title=f"layerwatch · {', '.join(names)}")
    _write(out, text.encode("utf-8"))
    return _shared(out, names, answers)


def _shared(out: Path, runs: list[str], answers: dict[str, Any]) -> Shared:
    stats = {stat["key"] for run in runs for stat in _body(answers["stats"][run]).get("stats", [])}
    layers = sum(1 for of_runs in answers["layer"].values() for answer in of_runs.values() if answer[0] == 200)
    return Shared(out, out.stat().st_size, runs, len(stats), layers)


# ---------------------------------------------------------------------- reading


def _chosen_runs(logdir: str | os.PathLike, pattern: Optional[str]) -> list[str]:
    """The names of the runs under ``logdir`` that the glob ``pattern`` matches (all for None)."""
    from layerwatch.reading.events import ReportError, find_runs

    try:
        found = list(find_runs(logdir))
    except ReportError as e:
        raise ShareError(str(e)) from None
    chosen = [name for name in found if pattern is None or fnmatch.fnmatchcase(name, pattern)]
    if not chosen:
        raise ShareError(f"--runs {pattern!r} matches no run under {str(logdir)!r}; its runs: {', '.join(found)}")
    return chosen


def _runs_with_data(whole: Any, logdir: str | os.PathLike, chosen: list[str]) -> list[str]:
    """The runs the tab lists (those with its data), in its order."""
    listed = _ask(whole.runs, {})
    if listed[0] != 200:
        raise ShareError(f"cannot read {str(logdir)!r}: {_body(listed)['error']}")
    names = [run["run"] for run in _body(listed)["runs"]]
    if not names:
        raise ShareError(f"no layerwatch data in {str(logdir)!r}: none of its runs ({', '.join(chosen)}) holds the "
                         "LAYERWATCH tab's data (was it written by Inspector or InspectCallback?)")
    return names


def _provider(logdir: str | os.PathLike, runs: list[str]) -> Any:
    """TensorBoard's data provider over ``runs``, read as ``tensorboard --logdir`` reads them
    (the Python reader), every sample of the tab's data kept."""
    from tensorboard.backend.event_processing import (
        data_ingester,
        data_provider,
        plugin_event_multiplexer,
    )

    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=data_ingester.DEFAULT_SIZE_GUIDANCE,
        tensor_size_guidance={**data_ingester.DEFAULT_TENSOR_SIZE_GUIDANCE, V.PLUGIN_NAME: 0},
    )
    for run in runs:
        multiplexer.AddRun(str(Path(logdir, run)), run)
    multiplexer.Reload()
    return data_provider.MultiplexerDataProvider(multiplexer, str(logdir))


def _plugin(provider: Any) -> Any:
    from tensorboard.plugins import base_plugin

    from layerwatch.tensorboard_plugin.plugin import LayerwatchPlugin

    return LayerwatchPlugin(base_plugin.TBContext(data_provider=provider))


class _Narrowed:
    """A data provider that shows of the runs only the statistics ``stats`` and, of their series
    and histograms, the steps ``steps[run]``; the layouts and events whole."""

    def __init__(self, inner: Any, stats: Optional[list[str]], steps: Optional[dict[str, frozenset[int]]]) -> None:
        self._inner = inner
        self._stats = None if stats is None else set(stats)
        self._steps = steps

    def list_tensors(self, ctx: Any, *, experiment_id: str, plugin_name: str, **kwargs: Any) -> Any:
        listing = self._inner.list_tensors(ctx, experiment_id=experiment_id, plugin_name=plugin_name, **kwargs)
        if plugin_name != V.PLUGIN_NAME or self._stats is None:
            return listing
        return {run: {tag: meta for tag, meta in tags.items() if self._shows(tag)} for run, tags in listing.items()}

    def read_tensors(self, ctx: Any, *, experiment_id: str, plugin_name: str, **kwargs: Any) -> Any:
        data = self._inner.read_tensors(ctx, experiment_id=experiment_id, plugin_name=plugin_name, **kwargs)
        return {run: {tag: [d for d in points if self._keeps(run, tag, d.step)] for tag, points in tags.items()
                      if plugin_name != V.PLUGIN_NAME or self._shows(tag)}
                for run, tags in data.items()}

    def _shows(self, tag: str) -> bool:
        return self._stats is None or not tag.startswith(V.SERIES) or tag[len(V.SERIES) :] in self._stats

    def _keeps(self, run: str, tag: str, step: int) -> bool:
        if self._steps is None or tag == V.LAYOUT or tag.startswith(V.EVENTS):
            return True
        return step in self._steps.get(run, ())


def _kept_steps(whole: Any, runs: list[str], narrowing: Narrowing) -> Optional[dict[str, frozenset[int]]]:
    """Each run's sampled steps that ``narrowing`` keeps: those in its ``steps``, every
    ``every_nth`` of them, and with ``every_nth`` the steps its events name too (the first
    NaN/Inf, the spikes), so thinning never drops an incident's column."""
    if narrowing.steps is None and narrowing.every_nth is None:
        return None
    kept = {}
    for run in runs:
        sampled = _body(_ask(whole.stats, {"run": run}))["steps"]
        within = [step for step in sampled if narrowing.steps is None or step in narrowing.steps]
        if not within:
            raise ShareError(f"--steps keeps no sampled step of run {run!r} (it has {len(sampled)} samples, steps "
                             f"{sampled[0]}..{sampled[-1]})")
        chosen = set(within[:: narrowing.every_nth or 1])
        if narrowing.every_nth is not None:
            chosen |= _event_steps(_body(_ask(whole.events, {"run": run}))) & set(within)
        kept[run] = frozenset(chosen)
    return kept


def _event_steps(events: dict[str, Any]) -> set[int]:
    offender = events.get("first_offender") or {}
    steps = {events.get("first_nonfinite_step"), offender.get("step")}
    for spike in events.get("spikes", []):
        steps |= {spike.get("step"), spike.get("sampled_at")}
    return {step for step in steps if isinstance(step, int)}


def _check_stats(whole: Any, runs: list[str], stats: list[str]) -> None:
    known = list(dict.fromkeys(stat["key"] for run in runs for stat in _body(_ask(whole.stats, {"run": run}))["stats"]))
    unknown = [stat for stat in stats if stat not in known]
    if unknown:
        raise ShareError(f"--stats: no statistic {', '.join(map(repr, unknown))} in the runs chosen; they have "
                         f"{', '.join(known)}")


# ---------------------------------------------------------------------- the answers


def collect_answers(whole: Any, view: Any, runs: list[str]) -> dict[str, Any]:
    """Every answer the page can ask for, by route and then by the values of the route's query
    parameters in the order of their names (as index.js looks them up): ``runs``;
    ``stats[run]``, ``heatmap[run][stat]``, ``layer[name][run]``, ``events[run]``,
    ``rankings[run]`` and, for a run with Mixture-of-Experts routers, ``experts[run]``.
    ``view`` answers them, save the events and rankings: ``whole`` (the runs unnarrowed) does,
    so a narrowed file keeps every alert and ranks over every sample."""
    answers: dict[str, Any] = {"runs": _ask(view.runs, {}), "stats": {}, "heatmap": {}, "layer": {},
                               "events": {}, "rankings": {}, "experts": {}}
    for run in runs:
        answers["stats"][run] = stats = _ask(view.stats, {"run": run})
        answers["events"][run] = events = _ask(whole.events, {"run": run})
        answers["rankings"][run] = rankings = _ask(whole.rankings, {"run": run})
        keys = [stat["key"] for stat in _body(stats).get("stats", [])]
        heatmaps = {key: _ask(view.heatmap, {"run": run, "stat": key}) for key in keys}
        answers["heatmap"][run] = {stat: _packable_heatmap(answer) for stat, answer in heatmaps.items()}
        if V.MOE_TOKENS in keys:  # the experts view (index.js asks for it only then)
            answers["experts"][run] = _packable_experts(_ask(view.experts, {"run": run}))
        rows = [name for answer in heatmaps.values() for name in _body(answer).get("rows", [])]
        named = [*_layers_named(_body(events)), *_layers_named(_body(rankings))]
        for name, answer in _layer_answers(view, run, _with_ancestors([*rows, *named])).items():
            answers["layer"].setdefault(name, {})[run] = answer
    return answers


def _ask(handler: Callable[..., dict[str, Any]], args: dict[str, str]) -> Answer:
    """A route's answer as the tab's server sends it (``plugin._route``): the JSON, or the
    error's status and message."""
    try:
        return [200, "OK", handler(_request(), _EXPERIMENT, args)]
    except Exception as e:
        return _failed(e, f"{handler.__name__} {args}")


def _failed(error: Exception, request: str) -> Answer:
    """What the tab's server sends for a route that raised ``error``."""
    from werkzeug import exceptions

    if isinstance(error, exceptions.HTTPException):
        return [error.code, error.name, {"error": error.description}]
    # a damaged log: its answer is the error, as the tab shows it
    logger.warning("layerwatch report --html: %s failed: %s: %s", request, type(error).__name__, error)
    return [500, "Internal Server Error", {"error": f"{type(error).__name__}: {error}"}]


def _request() -> Any:
    from tensorboard import context

    return context.RequestContext()


def _body(answer: Answer) -> dict[str, Any]:
    """An answer's JSON; an error's is ``{"error": ...}``."""
    return answer[2]


def _packable_heatmap(answer: Answer) -> Answer:
    """The heatmap's base64 values as their rows (:class:`~layerwatch.tensorboard_plugin.packing.Float32Rows`), so
    that a row equal to a layer's series is stored once."""
    return _as_rows(answer, lambda body: {"values": len(body["rows"])})


def _packable_experts(answer: Answer) -> Answer:
    """The experts view's base64 rows likewise: its tokens and imbalance rows are stored once
    with the heatmaps' rows of ``moe_tokens`` and ``moe_imbalance``."""
    return _as_rows(answer, lambda body: {"tokens": sum(body["experts"]), "shares": sum(body["experts"]),
                                          "imbalance": len(body["routers"])})


def _as_rows(answer: Answer, fields: Callable[[dict[str, Any]], dict[str, int]]) -> Answer:
    """``answer`` with each of its base64 ``fields`` (name: number of rows, of a column a step) as
    :class:`~layerwatch.tensorboard_plugin.packing.Float32Rows`."""
    status, reason, body = answer
    if status != 200:
        return answer
    columns = len(body["steps"])
    rows = {name: Float32Rows(np.frombuffer(base64.b64decode(body[name]), dtype="<f4").reshape(count, columns))
            for name, count in fields(body).items()}
    return [status, reason, {**body, **rows}]


def _layer_answers(view: Any, run: str, names: list[str]) -> dict[str, Answer]:
    """The ``layer`` route's answer for each of ``names``, computed together."""
    from layerwatch.tensorboard_plugin.plugin import no_layer

    try:
        found = view.layers(_request(), _EXPERIMENT, run, names)
    except Exception as e:  # the run cannot be read: every name gets the route's error
        error = _failed(e, f"layer of run {run!r}")
        return {name: error for name in names}
    return {name: [200, "OK", found[name]] if name in found else _failed(no_layer(run, name), "layer")
            for name in names}


def _layers_named(value: Any) -> Iterator[str]:
    """Every ``layer`` named anywhere in an answer (alerts, offender, spikes, rankings)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "layer" and isinstance(item, str):
                yield item
            else:
                yield from _layers_named(item)
    elif isinstance(value, list):
        for item in value:
            yield from _layers_named(item)


def _with_ancestors(names: list[str]) -> list[str]:
    """``names`` and the blocks above them in the tab's module tree (index.js ``parentName``:
    a head's module, an expert's parameter, a dotted name's prefix, ``(root)``), each once."""
    out: dict[str, None] = {}
    for name in names:
        while name is not None and name not in out:
            out[name] = None
            name = _parent(name)
    return list(out)


def _parent(name: str) -> Optional[str]:
    if name == V.ROOT:
        return None
    module, hash_sign, head = name.rpartition("#")
    if hash_sign and head.isdecimal():
        return module
    param, bracket, expert = name.rpartition("[")  # V.expert_param_name's <param>[e]
    if bracket and expert.endswith("]") and expert[:-1].isdecimal():
        return param
    prefix, dot, _ = name.rpartition(".")
    return prefix if dot else V.ROOT


# ---------------------------------------------------------------------- the file


def page(data: str, title: str) -> str:
    """The HTML page: the tab's front end, run over ``data`` (the packed answers, base64)."""
    from layerwatch.tensorboard_plugin.plugin import STATIC

    script = (STATIC / "index.js").read_text(encoding="utf-8")
    if "</script" in script.lower():  # it would end the inline script early
        raise AssertionError("index.js holds '</script': it cannot be inlined as it is")
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CONTENT_POLICY}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="layerwatch {html.escape(__version__)} (layerwatch report --html)">
<title>{html.escape(title)}</title>
</head>
<body>
<script id="{DATA_ELEMENT_ID}" type="application/octet-stream">{data}</script>
<script type="module">
{script}
render();
</script>
</body>
</html>
"""


def check_writable(out: Path) -> None:
    """Raises ShareError naming ``out`` when no file can be written there."""
    if out.is_dir():
        raise ShareError(f"--html {str(out)!r} is a directory; name the file to write, e.g. {str(out / 'run.html')!r}")
    try:
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"):
            pass
    except OSError as e:
        raise ShareError(f"--html {str(out)!r}: cannot write in {str(out.parent)!r}: {e.strerror or e}") from None


def _write(out: Path, data: bytes) -> None:
    """``data`` into ``out``, whole or not at all (a temporary file beside it, renamed)."""
    handle, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, out)
    except OSError as e:
        Path(temporary).unlink(missing_ok=True)
        raise ShareError(f"--html {str(out)!r}: cannot write it: {e.strerror or e}") from None
