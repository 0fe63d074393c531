"""A process that claims and releases GPUs through a shared ledger, for the multi-process tests.

``churn``: for ``--seconds``, claim a simulated GPU (sometimes two) for a fresh kernel, wait for
the grant, hold it briefly, release it; a few claims are abandoned by raising inside their
transaction. Writes what it committed and what it abandoned to ``--out`` (JSON) at the end. With
``--history S``, after each release it also prunes the leases released more than S seconds ago.

``pause``: claim one GPU and commit, then open a second transaction, write a second claim, create
``--ready`` and sleep inside the transaction until killed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from typing import Sequence

from jupyter_gpusched.core import Device, Lease, SchedConfig, admit, new_claim, plan, released
from jupyter_gpusched.ledger import Ledger, OwnerId, Transaction

DEVICES = tuple(Device(uuid=f"GPU-{i}", index=i) for i in range(4))
CFG = SchedConfig()


class Abandon(Exception):
    """Raised inside a transaction to roll it back."""


def schedule(tx: Transaction, leases: Sequence[Lease]) -> None:
    """One scheduling pass over ``leases``; persist what it changed."""
    result = plan(DEVICES, leases, {}, tx.now, CFG)
    for lease_id in result.changed:
        tx.put(result.lease(lease_id))


def claim(tx: Transaction, worker: int, me: OwnerId, count: int = 1) -> str:
    lease_id, kernel_id = str(uuid.uuid4()), str(uuid.uuid4())
    live = tx.leases()
    lease = new_claim(lease_id, kernel_id, f"user-{worker % 3}", tx.now, count=count)
    admit(lease, DEVICES, live, CFG)
    tx.put(lease)
    tx.set_owner(lease_id, kernel_id, f"worker-{worker}", me)
    schedule(tx, [*live, lease])
    return lease_id


def churn(ledger: Ledger, worker: int, seconds: float, rng: random.Random, history: float | None = None) -> dict:
    me = OwnerId.current()
    committed: list[str] = []
    abandoned: list[str] = []
    pruned = 0
    deadline = time.time() + seconds
    while time.time() < deadline:
        count = 2 if rng.random() < 0.2 else 1
        if rng.random() < 0.05:
            try:
                with ledger.transaction() as tx:
                    abandoned.append(claim(tx, worker, me, count))
                    raise Abandon
            except Abandon:
                continue
        with ledger.transaction() as tx:
            lease_id = claim(tx, worker, me, count)
        committed.append(lease_id)
        give_up = time.time() + seconds + 60
        while True:
            with ledger.transaction() as tx:
                mine = tx.lease(lease_id)
                if not mine.holding:
                    # Nobody handed it a GPU yet: run the pass ourselves, as any server would.
                    schedule(tx, tx.leases())
                    mine = tx.lease(lease_id)
            if mine.holding:
                break
            if time.time() > give_up:
                raise SystemExit(f"worker {worker}: lease {lease_id} was never granted")
            time.sleep(rng.uniform(0.001, 0.005))
        time.sleep(rng.uniform(0.0, 0.02))
        with ledger.transaction() as tx:
            tx.put(released(tx.lease(lease_id), tx.now, f"worker {worker} is done with it"))
            schedule(tx, tx.leases())  # hand the freed GPU to whoever waits
        if history is not None:
            pruned += ledger.prune(time.time() - history, batch=rng.choice((1, 5, 500)))
    return {"committed": committed, "abandoned": abandoned, "pruned": pruned}


def pause(ledger: Ledger, ready: str) -> None:
    me = OwnerId.current()
    with ledger.transaction() as tx:
        first = claim(tx, 0, me)
    with ledger.transaction() as tx:
        second = claim(tx, 0, me)
        with open(ready + ".tmp", "w") as f:
            json.dump({"committed": first, "uncommitted": second}, f)
        os.replace(ready + ".tmp", ready)
        time.sleep(600)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["churn", "pause"])
    parser.add_argument("ledger")
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--history", type=float, help="prune leases released this many seconds ago")
    parser.add_argument("--out")
    parser.add_argument("--ready")
    args = parser.parse_args(argv)
    ledger = Ledger(args.ledger, busy_timeout=30.0)
    try:
        if args.mode == "pause":
            pause(ledger, args.ready)
        else:
            result = churn(ledger, args.worker, args.seconds, random.Random(args.seed), args.history)
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
