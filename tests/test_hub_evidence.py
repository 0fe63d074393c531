"""The evidence rule for a server's word that its kernel is busy, as a table: what the server
says, what the broker saw of the kernel's processes, and the verdict. No processes, no psutil."""

from __future__ import annotations

import pytest

from jupyter_gpusched.hub.evidence import EVIDENCE_WINDOW, Seen, Word, weigh

NOW = 10_000.0
HEARTBEAT = 30.0
MAX_WITHOUT_GPU = 600.0


def judge(word: Word, seen: Seen, connected: bool = True, now: float = NOW):
    return weigh(word, seen, connected=connected, now=now, heartbeat_timeout=HEARTBEAT,
                 max_busy_without_gpu=MAX_WITHOUT_GPU)


BUSY = Word(busy=True, last_busy_at=NOW, started_at=NOW - 5)

# (what the server says, what was seen, connected, busy?, why the word was doubted)
TABLE = [
    pytest.param(BUSY, Seen(cpu_seen_at=NOW - 1), True, True, None, id="busy-with-cpu-just-now"),
    pytest.param(BUSY, Seen(gpu_now=True), True, True, None, id="busy-using-the-gpu"),
    pytest.param(BUSY, Seen(gpu_seen_at=NOW - EVIDENCE_WINDOW), True, True, None, id="gpu-use-at-the-window-edge"),
    pytest.param(BUSY, Seen(), True, False, "but its processes are not running", id="busy-with-no-evidence-at-all"),
    pytest.param(BUSY, Seen(cpu_seen_at=NOW - EVIDENCE_WINDOW - 1), True, False,
                 "but its processes are not running", id="cpu-evidence-too-old"),
    pytest.param(BUSY, Seen(cpu_seen_at=NOW - 1), False, False, None, id="server-disconnected"),
    pytest.param(Word(busy=False, last_busy_at=NOW - 100), Seen(cpu_seen_at=NOW - 1), True, False, None,
                 id="server-says-idle"),
    pytest.param(Word(busy=True, last_busy_at=NOW, last_claim_at=NOW - 1),
                 Seen(cpu_seen_at=NOW - 1, claimed_since=NOW - MAX_WITHOUT_GPU - 1), True, False,
                 "without GPU use for longer than max_busy_without_gpu", id="claiming-without-gpu-too-long"),
    pytest.param(Word(busy=True, last_busy_at=NOW, last_claim_at=NOW - 1),
                 Seen(cpu_seen_at=NOW - 1, claimed_since=NOW - MAX_WITHOUT_GPU + 1), True, True, None,
                 id="claiming-without-gpu-within-the-limit"),
]


@pytest.mark.parametrize(("word", "seen", "connected", "busy", "doubt"), TABLE)
def test_the_word_counts_only_with_evidence(word, seen, connected, busy, doubt):
    verdict = judge(word, seen, connected)
    assert verdict.busy is busy
    assert verdict.doubt == doubt
    assert verdict.started_at == (word.started_at if busy else None), "a cell's start only for a busy kernel"


def test_reported_activity_is_capped_by_what_was_seen():
    verdict = judge(Word(busy=False, last_busy_at=NOW), Seen(cpu_seen_at=NOW - 200))
    assert verdict.last_busy_at == NOW - 200, "a server cannot make a kernel look active later than it was"
    assert judge(Word(busy=False, last_busy_at=NOW), Seen()).last_busy_at is None, "nothing seen backs nothing"
    assert judge(Word(busy=False, last_busy_at=NOW - 500), Seen(cpu_seen_at=NOW - 1)).last_busy_at == NOW - 500


def test_activity_claimed_without_the_gpu_ends_at_the_limit():
    since = NOW - MAX_WITHOUT_GPU - 100
    verdict = judge(Word(busy=True, last_busy_at=NOW, last_claim_at=NOW - 1),
                    Seen(cpu_seen_at=NOW - 1, claimed_since=since))
    assert verdict.last_busy_at == since + MAX_WITHOUT_GPU


def test_gpu_use_now_is_remembered_and_ends_a_claim_without_it():
    verdict = judge(Word(busy=True, last_claim_at=NOW - 1), Seen(gpu_now=True, claimed_since=NOW - 50))
    assert verdict.gpu_seen_at == NOW and verdict.claimed_since is None


def test_a_claim_without_recent_gpu_use_starts_the_clock_and_an_old_claim_stops_it():
    started = judge(Word(busy=True, last_claim_at=NOW - 1), Seen(cpu_seen_at=NOW - 1, gpu_seen_at=NOW - 100))
    assert started.claimed_since == NOW
    kept = judge(Word(busy=True, last_claim_at=NOW - 1), Seen(cpu_seen_at=NOW - 1, claimed_since=NOW - 7))
    assert kept.claimed_since == NOW - 7, "the clock is not restarted by each claim"
    stopped = judge(Word(busy=True, last_claim_at=NOW - HEARTBEAT - 1), Seen(claimed_since=NOW - 7))
    assert stopped.claimed_since is None
    recent_gpu = judge(Word(busy=True, last_claim_at=NOW - 1), Seen(gpu_seen_at=NOW - 1))
    assert recent_gpu.claimed_since is None, "GPU use within the window: no claim without the GPU"
