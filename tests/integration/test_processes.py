"""Two JAX processes on this machine, joined by `jax.distributed` (one CPU device each,
collectives through gloo), train a data-parallel model with hooks: what a multi-host run
does. Each runs `tests/integration/processes_worker.py` and reports what it measured; nothing in the
library may assume one process, and both processes must take the same decisions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # most tests here take 15 s or more

ROOT = Path(__file__).resolve().parents[2]
LOSSLESS = ("identity", "offload", "remat")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> list[dict]:
    """The two processes' reports, process 0's first."""
    port, logs = str(_free_port()), tmp_path_factory.mktemp("processes")
    # One CPU device per process, whatever the suite's own process was given.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
    runs = []
    for i in (0, 1):  # to files: a pipe not read while waiting on the other would fill
        with open(logs / f"{i}.out", "w") as out, open(logs / f"{i}.err", "w") as err:
            runs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.integration.processes_worker", str(i), port],
                cwd=ROOT, env=env, stdout=out, stderr=err))
    try:
        for run in runs:
            run.wait(timeout=600)
    finally:
        for run in runs:  # one that failed leaves the other waiting on a collective
            if run.poll() is None:
                run.kill()
    reports = []
    for i, run in enumerate(runs):
        lines = [line for line in (logs / f"{i}.out").read_text().splitlines()
                 if line.startswith("RESULT ")]
        err = (logs / f"{i}.err").read_text()
        assert run.returncode == 0 and lines, f"process {i} failed:\n{err[-4000:]}"
        reports.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return reports


def _relative_error(got, want) -> float:
    got, want = np.concatenate(got), np.concatenate(want)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_each_process_has_one_device_of_two(processes):
    seen = [(r["processes"], r["local_devices"], r["devices"]) for r in processes]
    assert seen == [(2, 1, 2)] * 2


def test_lossless_policies_give_plain_gradients_on_each_process(processes):
    for report in processes:
        for name in LOSSLESS:
            for got, want in zip(report[name], report["plain"]):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=name)


def test_int8_and_a_scope_inside_the_function_are_near_plain_and_alike_on_both(processes):
    for name in ("int8", "scoped"):
        assert processes[0][name] == processes[1][name], name
        assert 0 < _relative_error(processes[0][name], processes[0]["plain"]) < 1e-2, name


def test_no_policy_adds_a_collective(processes):
    counts = processes[0]["collectives"]
    assert counts["plain"]["all-reduce"] >= 1, counts  # the gradient's, across processes
    assert all(counts[name] == counts["plain"] for name in counts), counts


def test_training_steps_agree_with_plain_and_between_processes(processes):
    plain, int8 = processes[0]["train_plain"], processes[0]["train_int8"]
    assert int8 == processes[1]["train_int8"] and plain == processes[1]["train_plain"]
    np.testing.assert_allclose(int8, plain, rtol=1e-2)
    assert plain[-1] < plain[0]


def test_inspect_and_plan_agree_between_processes(processes):
    first, second = processes
    assert first["inspect"] == second["inspect"]
    assert first["inspect"]["hooked_peak_bytes"] < first["inspect"]["plain_peak_bytes"]
    # The planner's timings and measured errors are the first process's on both: the
    # same plan, so the same programs and collectives on each.
    assert first["plan"]["decisions"] == second["plan"]["decisions"]
    assert "'int8'" in first["plan"]["decisions"] or "'remat'" in first["plan"]["decisions"]
    assert first["plan"]["memory"] < first["plan"]["plain_memory"]
    assert first["plan"]["gradient"] == second["plan"]["gradient"]
    assert _relative_error(first["plan"]["gradient"], first["plain"]) < 1e-2
    # Its gradient error reads an array sharded across the processes whole, on each.
    assert [round(r["sharded_error"], 6) for r in processes] == [0.01, 0.01]
