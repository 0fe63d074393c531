"""No names, kernel ids or pids across users in hub mode with ``show_holders`` off.

A broker's arbiter (the hub's rules, holders hidden) on simulated GPUs holds leases of alice and
bob in states that make reasons: bob's idle lease beyond his share taken back while alice waits
(an idle forecast that quotes the reclaim's reason, a notice to bob), alice's claims queued with
their standing, recent usage. Every string of every answer and event each user gets is walked:
nobody finds another user's name, kernel id or GPU process id anywhere, not even in free text;
each finds their own in full, and a hub admin sees everyone.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from typing import Any, Iterator

import pytest

from conftest import FakeClock
from jupyter_gpusched.api.events import shape
from jupyter_gpusched.api.input import Claim
from jupyter_gpusched.api.views import ANOTHER_USER, Identities, Principal, for_viewer
from jupyter_gpusched.arbiter.local import LocalArbiter
from jupyter_gpusched.core import SchedConfig
from jupyter_gpusched.devices.simulated import SimulatedBackend
from jupyter_gpusched.hub.service import BrokerPolicy
from jupyter_gpusched.ledger import Ledger

GIB = 1 << 30
USERS = ("alice", "bob", "carol")


class Kernels:
    """The broker's view of its servers' kernels, as a test sets it: each kernel one real process."""

    server_id = "broker"

    def __init__(self) -> None:
        self.user: dict[str, str] = {}
        self.pid: dict[str, int] = {}
        self.busy: dict[str, bool] = {}
        self.last_busy: dict[str, float] = {}

    def add(self, user: str, pid: int, at: float) -> str:
        kernel_id = str(uuid.uuid4())
        self.user[kernel_id], self.pid[kernel_id] = user, pid
        self.busy[kernel_id], self.last_busy[kernel_id] = False, at
        return kernel_id

    # KernelHost
    def activity(self):
        return {k: (self.busy[k], self.last_busy[k], self.last_busy[k]) for k in self.user}

    def alive(self, kernel_id: str) -> bool | None:
        return True if kernel_id in self.user else None

    def executing(self, kernel_id: str) -> bool:
        return self.busy.get(kernel_id, False)

    def asking(self, kernel_id: str) -> None:
        return None

    def restarting(self, kernel_id: str) -> bool:
        return False

    def adopted(self, kernel_id: str) -> None:
        return None

    def kernel_pid(self, kernel_id: str) -> int | None:
        return self.pid.get(kernel_id)

    def process_tree(self, kernel_id: str) -> set[int]:
        return {self.pid[kernel_id]} if kernel_id in self.pid else set()

    def process_trees(self) -> dict[str, set[int]]:
        return {k: {pid} for k, pid in self.pid.items()}

    def notebook(self, kernel_id: str) -> str | None:
        return f"{self.user[kernel_id]}/analysis.ipynb" if kernel_id in self.user else None

    async def refresh_notebooks(self) -> None:
        return None

    def user_of(self, kernel_id: str) -> str | None:
        return self.user.get(kernel_id)

    async def restart(self, kernel_id: str) -> None:
        return None

    async def shutdown(self, kernel_id: str) -> None:
        return None

    # what the hub's rules ask
    def known(self, kernel_id: str) -> bool:
        return kernel_id in self.user

    def verified_server(self, server_id: str, user: str) -> bool:
        return False

    def owner_of(self, pid: int) -> dict:
        for kernel_id, kpid in self.pid.items():
            if kpid == pid:
                return {"server_id": f"server-{self.user[kernel_id]}", "user": self.user[kernel_id], "pod": None}
        return {"server_id": None, "user": None, "pod": None}

    def stranded(self) -> list:
        return []

    def servers(self) -> list:
        return [
            {"server_id": f"server-{u}", "user": u, "kernels": sorted(k for k in self.user if self.user[k] == u)}
            for u in sorted(set(self.user.values()))
        ]


@pytest.fixture
def sleepers():
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(5)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait(10)


def strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string in a JSON value (keys too), with where it is."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.{key}", str(key)
            yield from strings(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for n, item in enumerate(value):
            yield from strings(item, f"{path}[{n}]")


def numbers(value: Any, path: str = "") -> Iterator[tuple[str, int]]:
    """Every integer under a key that names a process."""
    if isinstance(value, dict):
        for key, item in value.items():
            if "pid" in str(key) and isinstance(item, int) and not isinstance(item, bool):
                yield f"{path}.{key}", item
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for n, item in enumerate(value):
            yield from numbers(item, f"{path}[{n}]")


def leaks(answer: Any, names: set[str], kernel_ids: set[str], pids: set[int]) -> list[str]:
    """Where ``answer`` shows any of ``names`` (as a word), ``kernel_ids`` or ``pids``."""
    found = []
    for path, text in strings(answer):
        for name in names:
            if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text):
                found.append(f"{path}: name {name!r} in {text!r}")
        for kernel_id in kernel_ids:
            if kernel_id in text:
                found.append(f"{path}: kernel id {kernel_id} in {text!r}")
        for pid in pids:
            if re.search(rf"(?<![\w.:-]){pid}(?![\w.:-])", text):
                found.append(f"{path}: pid {pid} in {text!r}")
    for path, number in numbers(answer):
        if number in pids:
            found.append(f"{path}: pid {number}")
    return found


class Scene:
    """alice waits, bob's idle borrowed lease is taken back for her, carol computes."""

    def __init__(self, arb: LocalArbiter, kernels: Kernels, events: list) -> None:
        self.arb, self.kernels, self.events = arb, kernels, events

    def kernel_ids(self, user: str) -> set[str]:
        return {k for k, u in self.kernels.user.items() if u == user}

    def pids(self, user: str) -> set[int]:
        return {self.kernels.pid[k] for k in self.kernel_ids(user)}

    async def answers(self, who: Principal) -> dict[str, Any]:
        """Everything ``who`` gets: the REST answers, and each event as the broker sends it."""
        arb = self.arb
        ctx = arb.view_context()
        status = await arb.status(who)
        leases = await arb.leases(who)
        out: dict[str, Any] = {
            "status": status,
            "leases": leases,
            "devices": await arb.devices(who),
            "queue": status["queue"],
            "lease": [await arb.lease(who, le["id"]) for le in leases],
            "events": [shape(e, who, arb, ctx, own_notices_only=True) for e in self.events],
            # A server's own socket sends every notice; one for another user is shaped all the same.
            "all_notices": [shape(e, who, arb, ctx) for e in self.events if e.type == "notice"],
        }
        return out


async def make_scene(tmp_path, sleepers) -> Scene:
    clock = FakeClock()
    backend = SimulatedBackend(3, state_path=str(tmp_path / "sim.sqlite"))
    kernels = Kernels()
    cfg = SchedConfig(
        policy="hybrid", quotas={"*": 1}, idle_timeout=60, contended_idle_timeout=60, grace_period=120,
        release_timeout=3600,
    )
    arb = LocalArbiter(
        cfg=cfg, ledger=Ledger(tmp_path / "ledger.sqlite"), backend=backend, kernels=kernels, clock=clock,
        mode="hub", show_holders=False, policy=BrokerPolicy(kernels, "node-1"),
    )
    events: list = []
    arb.subscribe(events.append)
    await arb.tick()
    pids = iter(sleepers)
    bob1 = kernels.add("bob", next(pids), clock())
    bob2 = kernels.add("bob", next(pids), clock())
    carol = kernels.add("carol", next(pids), clock())
    alice1 = kernels.add("alice", next(pids), clock())
    alice2 = kernels.add("alice", next(pids), clock())
    held = {}
    for user, kernel_id in (("bob", bob1), ("carol", carol), ("bob", bob2)):
        result = await arb.claim(Principal(user=user, show_holders=False), Claim(kernel_id=kernel_id))
        assert result.lease["state"] == "active", result.lease
        held[kernel_id] = result.lease
        backend.add_process(result.lease["devices"][0], kernels.pid[kernel_id], 2 * GIB, 0.0)
    kernels.busy[carol] = True
    clock.advance(30)
    await arb.tick()
    # bob's kernels idle past the contended timeout; alice asks for a GPU twice.
    clock.advance(120)
    kernels.last_busy[carol] = clock()
    for kernel_id in (alice1, alice2):
        result = await arb.claim(Principal(user="alice", show_holders=False), Claim(kernel_id=kernel_id, wait=0))
        assert result.lease["state"] == "pending", result.lease
        clock.advance(1)
    await arb.tick()
    states = {le.kernel_id: le.state.value for le in arb.state.leases}
    assert "reclaiming" in (states[bob1], states[bob2]), states
    assert states[alice1] == states[alice2] == "pending", states
    return Scene(arb, kernels, events)


@pytest.fixture
def scene_of(tmp_path, sleepers):
    """An async factory of the scene (the async tests' loop runs it); closed at the end."""
    made: list[Scene] = []

    async def make() -> Scene:
        made.append(await make_scene(tmp_path, sleepers))
        return made[-1]

    yield make
    for one in made:
        one.arb.close()


async def test_the_scene_names_everyone_to_an_admin(scene_of):
    scene = await scene_of()
    """The reasons do name users, kernels and pids: what the other tests hide is really there."""
    seen = await scene.answers(Principal(user="root", admin=True, show_holders=False))
    text = repr(seen)
    assert "alice" in text and "bob" in text and "carol" in text
    reclaimed = next(le for le in seen["status"]["leases"] if le["state"] == "reclaiming")
    assert reclaimed["user"] == "bob"
    assert "while alice waits for a GPU" in reclaimed["reason"], reclaimed
    assert "bob used" in reclaimed["idle_forecast"]["reason"], reclaimed
    queued = [q for q in seen["queue"] if q["user"] == "alice"]
    assert len(queued) == 2 and "alice used" in queued[1]["reason"] and "of alice" in queued[1]["reason"], queued
    pids = {p["pid"] for d in seen["devices"] for p in d["processes"]}
    assert scene.pids("bob") | scene.pids("carol") <= pids
    assert {u["user"] for u in seen["status"]["usage"]} >= {"bob", "carol"}
    assert any(n and n.get("kind") == "reclaim_warning" and "alice" in n["message"] for n in seen["all_notices"])


@pytest.mark.parametrize("viewer", USERS)
async def test_no_user_sees_another_users_name_kernel_or_pid(scene_of, viewer):
    scene = await scene_of()
    who = Principal(user=viewer, show_holders=False)
    seen = await scene.answers(who)
    others = set(USERS) - {viewer}
    kernel_ids = set().union(*(scene.kernel_ids(u) for u in others))
    pids = set().union(*(scene.pids(u) for u in others))
    found = leaks(seen, others, kernel_ids, pids)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("viewer", USERS)
async def test_each_user_sees_their_own_in_full(scene_of, viewer):
    scene = await scene_of()
    seen = await scene.answers(Principal(user=viewer, show_holders=False))
    status = seen["status"]
    mine = [le for le in status["leases"] if le["mine"]]
    assert {le["kernel_id"] for le in mine} == scene.kernel_ids(viewer)
    assert all(le["user"] == viewer and le["notebook"] == f"{viewer}/analysis.ipynb" for le in mine)
    assert all(le["user"] == ANOTHER_USER and le["kernel_id"] is None for le in status["leases"] if not le["mine"])
    own_processes = {
        p["pid"]: p["kernel_id"] for d in seen["devices"] for p in d["processes"] if p["kernel_id"] is not None
    }
    on_gpu = {scene.kernels.pid[le["kernel_id"]]: le["kernel_id"] for le in mine if le["devices"]}
    assert own_processes == on_gpu
    assert viewer in {u["user"] for u in status["usage"]}
    if viewer == "alice":
        queued = [q for q in seen["queue"] if q["user"] == "alice"]
        assert len(queued) == 2 and all(q["kernel_id"] in scene.kernel_ids("alice") for q in queued)
        assert "alice used" in queued[1]["reason"] and "1 earlier claim of alice" in queued[1]["reason"], queued
    if viewer == "bob":
        reclaimed = next(le for le in mine if le["state"] == "reclaiming")
        # bob is told why, without the name of who waits for his GPU.
        assert f"while {ANOTHER_USER} waits for a GPU" in reclaimed["reason"], reclaimed
        assert "bob used" in reclaimed["reason"] and "bob used" in reclaimed["idle_forecast"]["reason"], reclaimed
        warnings = [e for e in seen["events"] if e and e["type"] == "notice" and e["kind"] == "reclaim_warning"]
        assert warnings and all(w["user"] == "bob" and w["kernel_id"] in scene.kernel_ids("bob") for w in warnings)
        assert f"while {ANOTHER_USER} waits" in warnings[0]["message"], warnings


async def test_holders_shown_when_the_admin_allows(scene_of):
    scene = await scene_of()
    """``show_holders``: every user sees who holds what, as before."""
    scene.arb.show_holders = True
    seen = await scene.answers(Principal(user="carol", show_holders=True))
    reclaimed = next(le for le in seen["status"]["leases"] if le["state"] == "reclaiming")
    assert reclaimed["user"] == "bob" and "while alice waits for a GPU" in reclaimed["reason"]
    assert "bob used" in reclaimed["idle_forecast"]["reason"]


# -- the one function that shapes text for a viewer ---------------------------------------------
KNOWN = Identities(
    users=frozenset({"alice", "bob"}),
    kernels={"k-alice-1": "alice", "k-bob-1": "bob", "k-lost": None},
    pids={4242: "alice", 5151: "bob"},
)


@pytest.mark.parametrize(
    "text, bob_sees",
    [
        ("idle beyond its user's guaranteed share while alice waits for a GPU (bob used 2 GPU-minutes recently)",
         "idle beyond its user's guaranteed share while another user waits for a GPU "
         "(bob used 2 GPU-minutes recently)"),
        ("2 earlier claims of alice; kernel k-alice-1 waits",
         "2 earlier claims of another user; another user's kernel waits"),
        ("user alice already has 3 claims waiting", "another user already has 3 claims waiting"),
        ("restored pid 4242 onto GPU-1; process 5151 stays; Process 4242 ends", "restored another user's process "
         "onto GPU-1; process 5151 stays; another user's process ends"),
        ("kernel k-bob-1 and kernel k-lost", "kernel k-bob-1 and another user's kernel"),
        ("alice.b and alice-2 and malice are other names; (alice) is hers.",
         "alice.b and alice-2 and malice are other names; (another user) is hers."),
        ("the kernel's process 777 is gone", "the kernel's process 777 is gone"),
        ("another user waits; it is idle", "another user waits; it is idle"),
    ],
)
def test_text_is_shaped_for_its_viewer(text, bob_sees):
    bob = Principal(user="bob", show_holders=False)
    assert for_viewer(text, bob, KNOWN, owner="bob") == bob_sees
    # Shaping twice changes nothing more.
    assert for_viewer(bob_sees, bob, KNOWN, owner="bob") == bob_sees
    # In another user's record every name, kernel and process is hidden, bob's own too.
    hidden = for_viewer(text, bob, KNOWN, owner="alice")
    assert not re.search(r"(?<![\w.-])(alice|bob)(?![\w-])", hidden.replace("alice.b", "").replace("alice-2", ""))
    assert not any(word in hidden for word in ("4242", "5151", "k-alice-1", "k-bob-1", "k-lost")), hidden
    # Admins, and everyone where holders are shown, see the text as it is.
    assert for_viewer(text, Principal(user="root", admin=True, show_holders=False), KNOWN, owner="alice") == text
    assert for_viewer(text, Principal(user="carol", show_holders=True), KNOWN, owner="alice") == text


def test_ids_and_fixed_words_are_never_rewritten():
    """A user named like a state ("idle") leaves states, modes and ids alone; free text is shaped."""
    carol = Principal(user="carol", show_holders=False)
    known = Identities(users=frozenset({"alice", "idle", "user", "another"}))
    assert for_viewer("another user's kernel: another user", carol, known) == "another user's kernel: another user"
    lease = {"id": "l1", "state": "idle", "mode": "shared", "devices": ["GPU-idle"], "reason": "idle while idle waits",
             "idle_forecast": {"step": "release", "contended_by": "anyone", "reason": "user idle waits"}}
    shaped = for_viewer(lease, carol, known)
    assert shaped["state"] == "idle" and shaped["devices"] == ["GPU-idle"] and shaped["mode"] == "shared"
    assert shaped["reason"] == "another user while another user waits"
    assert shaped["idle_forecast"] == {"step": "release", "contended_by": "anyone", "reason": "another user waits"}
    assert lease["reason"] == "idle while idle waits", "the record itself is not changed"
