"""``layerwatch report LOGDIR --html OUT``: runs shared as one HTML file, opened from file:// in
a real browser (Debian's chromium, driven by Playwright) with every network request refused,
over the demo's run with its NaN incident and a run with attention heads."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

import pytest
from browser_runs import HEADS, INJECT, SPIKE, train
from torch.utils.tensorboard import SummaryWriter

from layerwatch.cli import main
from layerwatch.tensorboard_plugin.packing import unpack

pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

ATTENTION_RUN = "sdpa"
DEMO_RUN = "demo/version_0"
VIEWPORT = {"width": 1400, "height": 900}


@pytest.fixture(scope="module")
def logdir(demo_logs):
    train(demo_logs / ATTENTION_RUN)
    return demo_logs


@pytest.fixture(scope="module")
def shared(logdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("shared") / "run.html"
    assert main(["report", str(logdir), "--html", str(out)]) == 0
    return out


def answers_in(path: Path) -> dict:
    """The answers a shared file holds, unpacked as index.js unpacks them."""
    import base64

    data = re.search(r'<script id="layerwatch-data" type="application/octet-stream">([^<]*)</script>', path.read_text())
    return unpack(base64.b64decode(data.group(1)))


def open_offline(browser, path: Path):
    """The file in a new page, every request but the file's own refused; the refused and the
    page's errors are listed in ``page.refused`` and ``page.errors``."""
    page = browser.new_page(viewport=VIEWPORT)
    page.refused, page.errors = [], []

    def only_the_file(route):
        if route.request.url == path.as_uri():
            route.continue_()
        else:
            page.refused.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_file)
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("console", lambda message: page.errors.append(message.text) if message.type == "error" else None)
    page.goto(path.as_uri())
    page.wait_for_selector("#lw-heatmap[data-rows]", timeout=30_000)
    return page


def open_over_routes(browser, logdir: Path):
    """index.js as TensorBoard loads it (an ES module whose render() is called), its requests
    answered by the tab's routes: the tab, without TensorBoard's page around it."""
    from layerwatch.tensorboard_plugin.share import _ask, _plugin, _provider
    from layerwatch.tensorboard_plugin.plugin import STATIC

    plugin = _plugin(_provider(logdir, [DEMO_RUN, ATTENTION_RUN]))
    page = browser.new_page(viewport=VIEWPORT)
    base = "http://layerwatch.test/"

    def serve(route):
        url = urllib.parse.urlsplit(route.request.url)
        name = url.path.strip("/")
        if name == "":
            return route.fulfill(content_type="text/html", body=(
                '<!doctype html><html><head><meta charset="utf-8"></head><body>'
                '<script type="module">import {render} from "./index.js"; render();</script></body></html>'))
        if name == "index.js":
            return route.fulfill(content_type="text/javascript", body=(STATIC / "index.js").read_text())
        status, _, body = _ask(getattr(plugin, name), dict(urllib.parse.parse_qsl(url.query)))
        route.fulfill(status=status, json=body)

    page.route("**/*", serve)
    page.goto(base)
    page.wait_for_selector("#lw-heatmap[data-rows]", timeout=30_000)
    return page


def click_layer(page, name: str):
    page.locator(f'.lw-row-label[data-name="{name}"]').first.click()
    detail = page.locator(f'#lw-detail[data-layer="{name}"]')
    detail.wait_for(timeout=30_000)
    return detail


def show(page, selector: str, value: str, ready: str) -> None:
    page.select_option(selector, value)
    page.wait_for_selector(ready, timeout=30_000)


def show_attention(page, stat: str) -> None:
    """The attention run's heatmap of ``stat``."""
    page.select_option("#lw-run", ATTENTION_RUN)
    page.wait_for_selector(f'#lw-stat option[value="{stat}"]', state="attached", timeout=30_000)
    show(page, "#lw-stat", stat, f'#lw-heatmap[data-stat="{stat}"]')


def test_the_file_opens_offline_with_the_heatmap_the_nan_and_the_first_offender(browser, shared, tmp_path):
    page = open_offline(browser, shared)
    heatmap = page.locator("#lw-heatmap")
    expected = answers_in(shared)["heatmap"][DEMO_RUN]["grads_norm"][2]
    assert heatmap.get_attribute("data-stat") == "grads_norm"
    assert int(heatmap.get_attribute("data-rows")) == len(expected["rows"])
    assert int(heatmap.get_attribute("data-steps")) == len(expected["steps"])
    assert heatmap.get_attribute("data-first-nonfinite-step") == str(INJECT)
    assert f"first NaN/Inf @ step {INJECT}" in page.locator(".lw-hm-marks").first.inner_text()
    assert heatmap.get_attribute("data-spike-steps") == str(SPIKE)
    offender = page.locator(".lw-event-offender")
    assert offender.is_visible()
    assert "encoder.fault" in offender.inner_text() and f"replayed from step {INJECT}" in offender.inner_text()
    assert "encoder.fault" in page.locator("#lw-alerts").inner_text()
    assert "Slowest layers" in page.locator("#lw-rankings").inner_text()
    # the first offender's row, outlined and badged where it has one (modules' statistics)
    show(page, "#lw-stat", "fwd_ms", '#lw-heatmap[data-stat="fwd_ms"]')
    row = page.locator('.lw-row-label.lw-offender[data-name="encoder.fault"]')
    assert row.is_visible() and "offender" in row.inner_text()
    page.screenshot(path=str(tmp_path / "share-heatmap.png"))
    detail = click_layer(page, "encoder.fault")
    assert "forward time" in detail.inner_text() and detail.locator("canvas").count() >= 2
    # a second run to compare with
    show(page, "#lw-compare", ATTENTION_RUN, '#lw-heatmap-compare[data-rows]')
    assert ATTENTION_RUN in page.locator("#lw-heatmap-compare").locator("xpath=ancestor::section").inner_text()
    page.screenshot(path=str(tmp_path / "share-compare.png"), full_page=True)
    assert page.refused == [] and page.errors == []
    page.close()


def test_clicking_a_layer_shows_its_series_and_histograms_and_an_attention_layer_its_heads(browser, shared, tmp_path):
    page = open_offline(browser, shared)
    detail = click_layer(page, "encoder.2.weight")
    text = detail.inner_text()
    assert "gradient norm" in text and "weights/encoder.2.weight" in text
    assert detail.locator("canvas").count() >= 2  # a series chart and a histogram over time
    page.screenshot(path=str(tmp_path / "share-detail.png"), full_page=True)
    show_attention(page, "attention_logit_max")
    detail = click_layer(page, "blocks.1.attn")
    heads = detail.locator("#lw-heads .lw-heads")
    heads.first.wait_for(timeout=30_000)
    assert [figure.get_attribute("data-heads") for figure in heads.all()] == [str(HEADS)] * 2
    page.screenshot(path=str(tmp_path / "share-heads.png"), full_page=True)
    assert page.refused == [] and page.errors == []
    page.close()


def test_the_file_shows_what_the_routes_show(browser, shared, logdir):
    """The same index.js, once over the routes and once over the file: the same pixels and text."""
    pages = [open_offline(browser, shared), open_over_routes(browser, logdir)]
    for page in pages:
        page.wait_for_selector("#lw-rankings .lw-ranking")
    seen = []
    for page in pages:
        heatmap = page.locator("#lw-heatmap").locator("xpath=ancestor::section")
        detail = click_layer(page, "encoder.0.weight")
        page.wait_for_timeout(100)  # the charts are drawn in the frame after the detail's
        seen.append([page.locator("#lw-events").inner_text(), page.locator("#lw-rankings").inner_text(),
                     heatmap.screenshot(), detail.inner_text(), detail.screenshot()])
    assert seen[0] == seen[1]
    for page in pages:
        show_attention(page, "attention_head_entropy")
        click_layer(page, "blocks.0.attn").locator("#lw-heads").wait_for()
        page.wait_for_timeout(100)
    assert pages[0].locator("#lw-detail").screenshot() == pages[1].locator("#lw-detail").screenshot()
    for page in pages:
        page.close()


def test_the_file_holds_every_answer_exactly_as_the_routes_give_it(shared, logdir):
    from layerwatch.tensorboard_plugin.share import _ask, _plugin, _provider

    plugin = _plugin(_provider(logdir, [DEMO_RUN, ATTENTION_RUN]))
    held = answers_in(shared)
    assert held["runs"] == _ask(plugin.runs, {})
    for run in (DEMO_RUN, ATTENTION_RUN):
        for route in ("stats", "events", "rankings"):
            assert held[route][run] == _ask(getattr(plugin, route), {"run": run}), (route, run)
        for stat, answer in held["heatmap"][run].items():
            assert answer == _ask(plugin.heatmap, {"run": run, "stat": stat})
    names = [name for name, runs in held["layer"].items() if DEMO_RUN in runs]
    assert {"encoder.fault", "encoder.2.weight", "encoder", "(root)"} <= set(names)
    for name in names:
        assert held["layer"][name][DEMO_RUN] == _ask(plugin.layer, {"run": DEMO_RUN, "name": name}), name
    assert held["layer"]["encoder"][DEMO_RUN][0] in (200, 404)  # a block: the route's answer either way


def test_runs_stats_and_steps_narrow_the_file(logdir, shared, tmp_path, capsys):
    out = tmp_path / "narrow.html"
    assert main(["report", str(logdir), "--html", str(out), "--runs", "demo*", "--stats", "grads_norm,fwd_ms",
                 "--every-nth", "4"]) == 0
    assert str(out) in capsys.readouterr().out
    held = answers_in(out)
    assert [run["run"] for run in held["runs"][2]["runs"]] == [DEMO_RUN]
    assert [stat["key"] for stat in held["stats"][DEMO_RUN][2]["stats"]] == ["grads_norm", "fwd_ms"]
    steps = held["heatmap"][DEMO_RUN]["grads_norm"][2]["steps"]
    sampled = answers_in(shared)["heatmap"][DEMO_RUN]["grads_norm"][2]["steps"]
    assert steps == sorted({*sampled[::4], INJECT, SPIKE}) != sampled  # every 4th sample, and the incidents' kept
    assert held["events"][DEMO_RUN][2]["first_nonfinite_step"] == INJECT  # the events whole
    layer = held["layer"]["encoder.2.weight"][DEMO_RUN][2]
    assert set(layer["series"]) == {"grads_norm"} and layer["steps"] == steps
    assert {entry["step"] for entry in layer["histograms"]["weights/encoder.2.weight"]} <= set(steps)
    ranged = tmp_path / "ranged.html"
    assert main(["report", str(logdir), "--html", str(ranged), "--runs", "demo*", "--steps", "100:150"]) == 0
    assert answers_in(ranged)["heatmap"][DEMO_RUN]["grads_norm"][2]["steps"] == list(range(100, 150, 10))


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_a_logdir_without_layerwatch_data_is_refused_and_nothing_written(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path / "logs" / "plain"))
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    out = tmp_path / "run.html"
    message = refused(["report", str(tmp_path / "logs"), "--html", str(out)], capsys)
    assert message == (f"layerwatch report: error: no layerwatch data in {str(tmp_path / 'logs')!r}: none of its runs "
                       "(plain) holds the LAYERWATCH tab's data (was it written by Inspector or InspectCallback?)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    missing = tmp_path / "nowhere"
    assert refused(["report", str(missing), "--html", str(out)], capsys) == (
        f"layerwatch report: error: log directory {str(missing)!r} does not exist")
    assert not out.exists()


def test_an_output_that_cannot_be_written_is_refused_before_reading(tmp_path, capsys):
    into_missing = tmp_path / "missing" / "run.html"
    assert refused(["report", str(tmp_path / "any"), "--html", str(into_missing)], capsys) == (
        f"layerwatch report: error: --html {str(into_missing)!r}: cannot write in {str(into_missing.parent)!r}: "
        "No such file or directory")
    assert refused(["report", str(tmp_path), "--html", str(tmp_path)], capsys) == (
        f"layerwatch report: error: --html {str(tmp_path)!r} is a directory; name the file to write, e.g. "
        f"{str(tmp_path / 'run.html')!r}")
    assert list(tmp_path.iterdir()) == []


def test_runs_stats_and_steps_that_choose_nothing_are_refused(logdir, tmp_path, capsys):
    out = tmp_path / "run.html"
    assert refused(["report", str(logdir), "--html", str(out), "--runs", "lr-*"], capsys) == (
        f"layerwatch report: error: --runs 'lr-*' matches no run under {str(logdir)!r}; its runs: "
        f"{DEMO_RUN}, {ATTENTION_RUN}")
    message = refused(["report", str(logdir), "--html", str(out), "--runs", "demo*", "--stats", "grads_norm,speed"], capsys)
    assert message.startswith("layerwatch report: error: --stats: no statistic 'speed' in the runs chosen; they have "
                              "grads_norm, weights_norm, ")
    assert refused(["report", str(logdir), "--html", str(out), "--runs", "demo*", "--steps", "500:"], capsys) == (
        f"layerwatch report: error: --steps keeps no sampled step of run {DEMO_RUN!r} (it has 25 samples, steps 0..190)")
    assert refused(["report", str(logdir), "--runs", "demo*"], capsys) == (
        "layerwatch report: error: argument --runs: only with --html (it narrows the file written)")
    assert refused(["report", str(logdir), "--html", str(out), "--json"], capsys) == (
        "layerwatch report: error: argument --json: not with --html (it writes the file only)")
    assert list(tmp_path.iterdir()) == []


def test_the_help_lists_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "--html OUT.html" in capsys.readouterr().out


def test_the_file_is_one_file_that_refers_to_nothing(shared):
    text = shared.read_text()
    assert text.count("<script") == 2  # the data and index.js
    assert not re.search(r"""\b(src|href)=["'][^"'#]""", text)
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert shared.stat().st_size < 2**20  # the small demo run's: the full demo's is measured by benchmarks/share_size.py
