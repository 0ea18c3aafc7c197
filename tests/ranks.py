"""Run a function on two gloo ranks, one process each, so that a hang fails in seconds.

Every distributed test goes through :func:`run_ranks`:

* ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: gloo checks that every rank issues the same collective,
  and raises instead of hanging when they differ;
* a timeout on the process group (a collective that waits longer raises);
* a deadline on the join: processes still running then are killed, and the test fails.

The ranks are forked from a server (multiprocessing's ``forkserver``, started by the first
distributed test) that imported torch, layerwatch and the frameworks the workers use once, before
anything ran in it: a rank starts in a tenth of a second, not in the seconds a new interpreter
takes to import them. Each rank is given the test's environment, as a spawned rank inherits it.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 30
JOIN_TIMEOUT_S = 150
PRELOAD = ["torch", "torch.distributed", "numpy", "layerwatch", "models", "ranks", "lightning.pytorch", "transformers"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, done: str, env: dict, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()  # the test's, not the server's from when it started
    os.environ.update(env)
    dist.set_debug_level_from_env()  # read when torch.distributed was imported, in the server
    # What a launcher (torchrun, Lightning) would set: a framework that reads them finds the
    # processes launched already.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", GROUP_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(done, f"done{rank}").touch()


def run_ranks(fn: Callable[..., Any], *args: Any, tmp: Path, world: int = 2, timeout: float = JOIN_TIMEOUT_S,
              debug: str = "DETAIL") -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks (``fn`` at module level, so it pickles),
    with ``torch.distributed`` initialized; fails the test when a rank raises or any is still
    running after ``timeout`` seconds. ``debug``: ``TORCH_DISTRIBUTED_DEBUG`` (DDP on the CPU
    needs ``"INFO"``: under ``"DETAIL"`` torch 2.13's ``DistributedDataParallel`` constructor
    crashes with a segmentation fault, layerwatch or not).

    gloo sometimes aborts a rank while its process exits, after all of its work is done
    ("terminate called without an active exception", as in pytorch/pytorch#90549): a SIGABRT
    once every rank has finished its work is let through.
    """
    done = tmp / "ranks-done"
    done.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG=debug)
    context = mp.start_processes(_rank_main, args=(world, free_port(), str(done), env, fn, args), nprocs=world,
                                 join=False, start_method=_forkserver())
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                pytest.fail(f"the ranks were still running after {timeout:.0f} s: a hang")
    except mp.ProcessExitedException as e:
        finished = all((done / f"done{rank}").exists() for rank in range(world))
        if e.signal_name != "SIGABRT" or not finished:
            raise


def _forkserver() -> str:
    """multiprocessing's ``forkserver``, told what to import before it starts (once per session)."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def check_collectives_from_here() -> None:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for the process groups made from now on (layerwatch's
    own), in a rank started with ``debug="INFO"``: torch 2.13's ``DistributedDataParallel``
    constructor crashes under DETAIL, so a DDP test builds its model first, then calls this."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()


def run_python(code: str, *, timeout: float = JOIN_TIMEOUT_S) -> str:
    """``code`` in a new Python process, with ``tests/`` on its path, in a session of its own so
    that every process it starts (Lightning's ``ddp_spawn`` ranks) goes with it; fails the test
    when it fails, or kills them all and fails it when they still run after ``timeout`` seconds.
    Returns what it printed."""
    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"still running after {timeout:.0f} s: a hang\n{out[-4000:]}")
    if process.returncode != 0:
        pytest.fail(f"exited with {process.returncode}\n{out[-4000:]}")
    return out


@contextmanager
def tolerate_abort_at_exit(*done_markers: Path) -> Iterator[None]:
    """Let through a SIGABRT of a spawned rank once every rank has written its done marker.

    gloo sometimes aborts a rank while its process exits, after all of its work is done
    ("terminate called without an active exception", as in pytorch/pytorch#90549). About 1 run
    in 10 on this 2-core machine does it, with or without layerwatch. It says nothing of the
    code under test; an abort before the markers exist still fails the test.
    """
    from torch.multiprocessing import ProcessExitedException

    try:
        yield
    except ProcessExitedException as e:
        if e.signal_name != "SIGABRT" or not all(marker.exists() for marker in done_markers):
            raise
