"""Each user's delays apart in the simulator: who waits, how long, and why; and the capacity at
which every user, not only the average, is served within 5 s."""

from __future__ import annotations

import json

import pytest

from jupyter_gpusched.cli import main
from jupyter_gpusched.simulate import ReplayOptions, SimulationError, parse_csv, simulate
from jupyter_gpusched.simulate.capacity import find_capacity
from jupyter_gpusched.simulate.users import by_user, worst


def test_the_cause_of_a_users_late_cells_is_the_larger_part_of_their_waiting():
    users = by_user([
        ("ann", 1, 0.0, 0.0), ("ann", 1, 30.0, 0.0), ("ann", 1, 20.0, 1.0),  # queued
        ("ben", 1, 12.0, 11.0), ("ben", 1, 0.5, 0.5),  # restored (the 0.5 s cell is not late)
        ("cat", 4, 20.0, 8.0),  # both, for a claim of 4 GPUs
        ("dan", 1, 0.2, 0.0),  # nobody's late cell
    ])
    assert (users["ann"].why, users["ben"].why, users["cat"].why, users["dan"].why) == (
        "queue", "restores", "both", "none")
    assert users["ann"].cells == 3 and users["ann"].queue_s == pytest.approx(49.0)
    assert users["ben"].restore_s == pytest.approx(11.0), "only late cells count"
    assert users["cat"].gpus_at_once == 4
    assert worst(users).user == "ann"
    assert "waited in the queue" in users["ann"].describe()
    assert "for a claim of 4 GPUs at once and for restores" in users["cat"].describe()
    assert worst({}) is None


# Two users on two GPUs: small's many one-GPU cells run at once; big's kernel asks for both GPUs
# and its cells wait for small's kernel to let go of one. The average is fine, big is not.
BIG_AND_SMALL = "session,user,start_s,duration_s,gpus,vram_gb,session_gpus,session_start_s,session_stop_s\n" + "".join(
    f"s,small,{t},50,1,1,1,0,4000\n" for t in range(0, 3600, 60)
) + "b,big,100,60,2,1,2,100,4000\nb,big,1900,60,2,1,2,100,4000\n"


def test_the_worst_user_is_named_with_why_they_waited():
    trace = parse_csv(BIG_AND_SMALL)
    result = simulate(trace, "static", 2)
    users = {u.user: u for u in result.users}
    assert set(users) == {"small", "big"}
    assert users["small"].cells == 60 and users["small"].p95_s == 0.0
    assert users["big"].gpus_at_once == 2 and users["big"].p95_s > 60, "big waits for small's GPU"
    assert users["big"].why == "queue"
    assert result.user_delay_p95_max_s == users["big"].p95_s
    assert result.cell_delay_p95_s < users["big"].p95_s, "the average hides the worst user"


def test_capacity_for_every_user_can_be_above_the_aggregate_capacity():
    trace = parse_csv(BIG_AND_SMALL)
    aggregate = find_capacity(trace, "static", progress=False)
    every = find_capacity(trace, "static", progress=False, every_user=True)
    assert aggregate == 2, "62 cells of which 2 wait: the p95 is within 5 s"
    assert every == 3, "big's cells start at once only when a GPU is left beside small's"


def test_cli_json_and_table_show_each_user_and_the_capacity_for_every_user(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text(BIG_AND_SMALL)
    assert main(["simulate", "--trace", str(path), "--gpus", "2", "--policy", "static", "--json",
                 "--find-capacity"]) == 0
    out = json.loads(capsys.readouterr().out)["static"]
    assert out["capacity"] == 2 and out["capacity_every_user"] == 3
    assert out["users"]["small"]["cells"] == 60 and out["users"]["big"]["gpus_at_once"] == 2
    assert out["worst_user"]["user"] == "big" and out["worst_user"]["why"] == "queue"
    assert main(["simulate", "--trace", str(path), "--gpus", "2", "--policy", "static", "--find-capacity"]) == 0
    text = capsys.readouterr().out
    assert "every user" in text.splitlines()[2], "a column of the table"
    assert "worst user under static: big: p95" in text and "for a claim of 2 GPUs at once" in text


# Alice's kernel (10 GB) is checkpointed for bob's cell; bob's session ends at 400 and the GPU is
# free when alice comes back for her cell at 3000.
COMES_BACK = """\
session,user,start_s,duration_s,gpus,vram_gb,session_gpus,session_start_s,session_stop_s
a,alice,0,100,1,10,1,0,4000
a,alice,3000,100,1,10,1,0,4000
b,bob,200,100,1,1,1,200,400
"""


def test_a_users_return_restores_the_kernel_before_the_cell_runs():
    trace = parse_csv(COMES_BACK)
    plain = simulate(trace, "hybrid", 1)
    assert plain.suspends == 1 and plain.restores == 1
    alice = plain.delays[1]
    assert alice > 5, "without the signal the cell waits for its restore"
    early = simulate(trace, "hybrid", 1, ReplayOptions(return_lead=15.0))
    assert early.restores == 1 and early.delays[1] == 0.0, "restored in the 15 s before the cell"
    short = simulate(trace, "hybrid", 1, ReplayOptions(return_lead=2.0))
    assert 0 < short.delays[1] == pytest.approx(alice - 2.0), "a short lead saves what it can"


def test_a_return_never_takes_a_gpu_from_anyone():
    # Bob's kernel lives on, idle, holding the GPU: alice's return restores nothing early.
    trace = parse_csv(COMES_BACK.replace("b,bob,200,100,1,1,1,200,400", "b,bob,200,100,1,1,1,200,4000"))
    plain = simulate(trace, "hybrid", 1)
    early = simulate(trace, "hybrid", 1, ReplayOptions(return_lead=15.0))
    assert plain.suspends == 2 and plain.delays[1] > 5, "bob is checkpointed only when alice's cell asks"
    assert early.delays == plain.delays and early.suspends == plain.suspends


def test_the_return_lead_is_checked():
    with pytest.raises(SimulationError, match="return lead must be 0 or more"):
        ReplayOptions(return_lead=-1)
