"""A checkpoint that lands while a cell runs: the cell's next GPU call asks for the lease back.

On the simulated GPUs the kernel agent tells the CUDA stand-in how to ask (a real driver's call
blocks until the server restores the process); here against the small fake server of
``test_kernel_agent.py``.
"""

from __future__ import annotations

import pytest

from jupyter_gpusched.devices.simulated import cuda as simulated_cuda
from jupyter_gpusched.kernel.client import GPUSchedError
from test_kernel_agent import load, provisioned, run, server, shell  # noqa: F401 - fixtures


@pytest.fixture
def simulated(provisioned, monkeypatch, tmp_path):  # noqa: F811 - the fixture imported above
    monkeypatch.setenv("JUPYTER_GPUSCHED_SIM_STATE", str(tmp_path / "sim.sqlite"))
    yield provisioned
    simulated_cuda.on_checkpointed(None)


def test_the_agent_tells_the_simulated_gpus_how_to_ask_for_the_lease_back(shell, simulated):  # noqa: F811
    agent, _ = load(shell)
    assert simulated_cuda._resume == agent.hooks.resume_running_cell
    agent.uninstall()
    assert simulated_cuda._resume is None


def test_a_gpu_call_of_a_checkpointed_running_cell_restores_the_lease(shell, simulated):  # noqa: F811
    agent, shown = load(shell)
    assert run(shell, "a = 1").success
    simulated.lease_of().update(state="suspended", devices=[], device_indices=[],
                                reason="suspended: GPU state checkpointed to host memory")
    agent.hooks.resume_running_cell()  # what the cell's GPU call does
    assert simulated.lease_of()["state"] == "active"
    assert any(t.startswith("Restored this kernel's GPU state onto GPU") for t in shown.texts)
    # Restored already: a second call from the same cell asks nothing.
    before = simulated.count("POST", "api/gpusched/leases")
    agent.hooks.resume_running_cell()
    assert simulated.count("POST", "api/gpusched/leases") == before


def test_a_checkpointed_cell_whose_lease_is_gone_is_told_so_at_once(shell, simulated):  # noqa: F811
    agent, _ = load(shell)
    assert run(shell, "a = 1").success
    simulated.lease_of().update(state="released", devices=[], device_indices=[], reason="released by the admin")
    with pytest.raises(GPUSchedError, match="its lease is gone"):
        agent.hooks.resume_running_cell()
