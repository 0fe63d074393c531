"""The driver checkpointer's restore, against the real ``cuda.bindings`` structs (no GPU needed):
the GPU map it hands the driver, and how the driver's failures reach the server."""

from __future__ import annotations

import pytest

from jupyter_gpusched.core.placement import device_map
from jupyter_gpusched.reclaim.checkpoint import CheckpointError, DriverCheckpointer, RestoreNoRoom

driver = pytest.importorskip("cuda.bindings.driver")

OLD = "GPU-00112233-4455-6677-8899-aabbccddeeff"
NEW = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"


class FakeDriver:
    """The structs of cuda.bindings, and restore calls that record what they were given."""

    CUuuid = driver.CUuuid
    CUcheckpointGpuPair = driver.CUcheckpointGpuPair
    CUcheckpointRestoreArgs = driver.CUcheckpointRestoreArgs

    def __init__(self, restore=driver.CUresult.CUDA_SUCCESS, fail: Exception | None = None) -> None:
        self.result = restore
        self.fail = fail
        self.pairs: list[tuple[bytes, bytes]] = []
        self.calls: list[str] = []

    def cuCheckpointProcessRestore(self, pid, args):
        self.calls.append("restore")
        if self.fail is not None:
            raise self.fail
        if args is not None:
            self.pairs = [(p.oldUuid.bytes, p.newUuid.bytes) for p in args.gpuPairs][: args.gpuPairsCount]
        return (self.result,)

    def cuCheckpointProcessUnlock(self, pid, args):
        self.calls.append("unlock")
        return (driver.CUresult.CUDA_SUCCESS,)


def test_a_restore_onto_another_gpu_hands_the_driver_both_uuids():
    fake = FakeDriver()
    DriverCheckpointer(fake).restore(1234, {OLD: NEW})
    assert fake.pairs == [(bytes.fromhex(OLD[4:].replace("-", "")), bytes.fromhex(NEW[4:].replace("-", "")))]
    assert fake.calls == ["restore", "unlock"]


def test_a_restore_the_driver_finds_no_memory_for_says_so_and_leaves_the_process_locked():
    assert RestoreNoRoom is not CheckpointError and issubclass(RestoreNoRoom, CheckpointError)
    fake = FakeDriver(restore=driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(RestoreNoRoom):
        DriverCheckpointer(fake).restore(1234, None)
    assert fake.calls == ["restore"]


def test_anything_a_binding_raises_reaches_the_server_as_a_checkpoint_error():
    fake = FakeDriver(fail=TypeError("an argument of the wrong type"))
    with pytest.raises(CheckpointError, match="wrong type"):
        DriverCheckpointer(fake).restore(1234, {OLD: NEW})


def test_the_device_map_pairs_every_gpu_with_one_of_its_model_and_keeps_those_at_home():
    models = {"a0": "A100", "a1": "A100", "h0": "H100", "h1": "H100"}
    assert device_map(("a0", "h0"), ("h1", "a0"), models) == {"a0": "a0", "h0": "h1"}
    assert device_map(("a0",), ("h0",), models) is None
    assert device_map(("a0", "a1"), ("a1",), models) is None
    assert device_map(("a0",), ("zz",), models) is None
