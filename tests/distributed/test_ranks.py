"""The harness every distributed test runs through (:mod:`ranks`): its ranks, forked from a
server started long before the test, see the test's environment and check collectives."""

import os
from pathlib import Path

import torch.distributed as dist

from ranks import run_ranks


def environment_worker(rank: int, world: int, out: str) -> None:
    level = dist.get_debug_level()
    Path(out, f"rank{rank}").write_text(f"{os.environ.get('LAYERWATCH_TEST_MARK')} {level.name} {dist.get_world_size()}")


def test_ranks_see_the_tests_environment_and_check_every_collective(tmp_path, monkeypatch):
    run_ranks(environment_worker, str(tmp_path), tmp=tmp_path)  # the server runs from here on, at the latest
    monkeypatch.setenv("LAYERWATCH_TEST_MARK", tmp_path.name)
    run_ranks(environment_worker, str(tmp_path), tmp=tmp_path)
    assert [Path(tmp_path, f"rank{r}").read_text() for r in range(2)] == [f"{tmp_path.name} DETAIL 2"] * 2
