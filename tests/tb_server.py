"""A real TensorBoard server on 127.0.0.1 for the tests that read through it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> bytes:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=60) as response:
            return response.read()

    def get_json(self, path: str, **params: Any) -> Any:
        return json.loads(self.get(path, **params))

    def status(self, path: str, **params: Any) -> tuple[int, bytes]:
        try:
            return 200, self.get(path, **params)
        except urllib.error.HTTPError as e:
            return e.code, e.read()


@contextmanager
def serve(logdir: Any, *, load_fast: bool = False, ready: Callable[[Server], bool] = lambda s: True,
          timeout: float = 90) -> Iterator[Server]:
    """TensorBoard over ``logdir``, once ``ready(server)`` holds (HTTP errors mean not yet)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
         "--load_fast", "true" if load_fast else "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server = Server(port)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready(server):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise TimeoutError(f"TensorBoard over {logdir} was not ready in {timeout} s")
            time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def open_tab(browser: Any, url: str, *, timeout_ms: float = 60_000, ready: str = "#lw-heatmap[data-rows]") -> tuple[Any, Any]:
    """A Playwright page on TensorBoard's LAYERWATCH tab, and the tab's frame once ``ready``
    (a selector) is in it. TensorBoard loads the tab in an iframe of ``plugin_entry.html``."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{url}/#layerwatch")
    deadline = time.monotonic() + timeout_ms / 1e3
    frame = None
    while frame is None:
        frame = next((f for f in page.frames if "name=layerwatch" in f.url), None)
        if frame is None:
            if time.monotonic() > deadline:
                raise TimeoutError("TensorBoard did not open the LAYERWATCH tab's frame")
            page.wait_for_timeout(50)
    frame.wait_for_selector(ready, timeout=timeout_ms)
    return page, frame
