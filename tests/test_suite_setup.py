"""How the suite itself runs: `make test` shares the cores out between its pytest-xdist workers."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.skipif("DFLASH_TEST_SHARED_THREADS" not in os.environ,
                    reason="not in pytest-xdist workers, or OMP_NUM_THREADS was set by hand")
def test_the_workers_thread_pools_together_fit_the_cores():
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    cores = os.cpu_count() or 1
    assert torch.get_num_threads() == int(os.environ["DFLASH_TEST_SHARED_THREADS"])
    assert torch.get_num_threads() * workers <= max(cores, workers)  # no core has two pools' threads
    assert os.environ["OMP_NUM_THREADS"] == str(torch.get_num_threads())  # what its subprocesses inherit
