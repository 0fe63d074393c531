"""A size or a duration typed without its unit is refused with the forms to use, never read as
bytes or seconds; numbers keep their documented unit (a JSON number of bytes or seconds, a
Python number of seconds, a Python number of bytes from 1 MiB up).

Where the text is what a notebook shows, a real kernel through the server runs the cell.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from traitlets import TraitError

from jupyter_gpusched.config import host_memory_budget
from jupyter_gpusched.core import GiB, MissingUnit, SchedulingError, parse_duration, parse_memory

from conftest import api, live_lease

pytestmark = pytest.mark.slow


# -- the core's parsers ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["16", " 16 ", "1.5", "4096"])
def test_a_size_typed_without_a_unit_is_refused_with_the_forms(text):
    with pytest.raises(MissingUnit) as info:
        parse_memory(text, "memory")
    message = str(info.value)
    number = text.strip()
    assert message.startswith(f"memory needs a unit: '{number}' alone would be {number} bytes.")
    assert "'16GiB', '512MiB' or '80GB'" in message


def test_the_fix_offered_fits_the_number():
    assert "Write '16GiB' or '16MiB'" in str(pytest.raises(MissingUnit, parse_memory, "16").value)
    # A byte count was probably meant as bytes: that is offered first.
    assert "Write '17179869184B' or '17179869184GiB'" in str(pytest.raises(MissingUnit, parse_memory, "17179869184").value)
    assert "Write '30m' or '30s'" in str(pytest.raises(MissingUnit, parse_duration, "30").value)
    assert "Write '3600s' or '3600m'" in str(pytest.raises(MissingUnit, parse_duration, "3600").value)


@pytest.mark.parametrize("text", ["30", "1.5", " 90 "])
def test_a_duration_typed_without_a_unit_is_refused_with_the_forms(text):
    with pytest.raises(MissingUnit) as info:
        parse_duration(text, "keep")
    message = str(info.value)
    number = text.strip()
    assert message.startswith(f"keep needs a unit: '{number}' alone would be {number} seconds.")
    assert "'90s', '30m', '1h30m' or '2h'" in message


def test_a_huge_number_without_a_unit_is_quoted_short():
    for parse, text in ((parse_memory, "9" * 10_000), (parse_duration, "9" * 10_000)):
        message = str(pytest.raises(MissingUnit, parse, text, "x").value)
        assert message.startswith("x needs a unit:") and "(10000 characters)" in message and len(message) < 300


def test_numbers_keep_their_documented_units_and_zero_needs_none():
    assert parse_memory(16 * GiB) == 16 * GiB  # a number is bytes (JSON, Python config)
    assert parse_memory("16GiB") == 16 * GiB and parse_memory("4096B") == 4096
    assert parse_duration(30) == 30.0  # a number is seconds
    assert parse_duration("0") == 0.0 and parse_duration("0.0") == 0.0  # no time needs no unit
    assert parse_duration("30", bare_seconds=True) == 30.0  # where the option says S, seconds
    assert isinstance(pytest.raises(MissingUnit, parse_duration, "30").value, SchedulingError)
    # Zero is zero in any unit: a claim for it is refused for what it is.
    assert "must be more than 0 bytes" in str(pytest.raises(SchedulingError, parse_memory, "0").value)


# -- settings: the provisioner, the kernelspec command, the checkpoint budget ----------------------
def test_a_kernelspec_memory_without_a_unit_is_refused():
    from jupyter_gpusched.provisioner import GPUSchedProvisioner

    with pytest.raises(TraitError, match=r"memory needs a unit: '16' alone would be 16 bytes\. Write '16GiB'"):
        GPUSchedProvisioner(memory="16")
    assert GPUSchedProvisioner(memory="16GiB").memory == "16GiB"


def test_kernelspec_install_refuses_a_memory_without_a_unit(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_gpusched.cli", "kernelspec", "install", "--name", "g16", "--gpus", "1",
         "--memory", "16", "--prefix", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "--memory needs a unit: '16' alone would be 16 bytes. Write '16GiB' or '16MiB'" in said
    assert not list(tmp_path.rglob("kernel.json")), "nothing is installed"


def test_the_checkpoint_budget_from_text_needs_a_unit():
    with pytest.raises(TraitError, match="checkpoint_host_memory needs a unit: '16' alone would be 16 bytes"):
        host_memory_budget("16")
    assert host_memory_budget(16 * GiB) == 16 * GiB  # a number in a Python config file is bytes
    assert host_memory_budget("16GiB") == 16 * GiB


def test_the_checkpoint_budget_on_the_command_line_needs_a_unit():
    from jupyter_gpusched.server.app import GPUSchedApp

    app = GPUSchedApp()
    app.parse_command_line(["--GPUSchedApp.checkpoint_host_memory=320GiB"])
    assert app.checkpoint_host_memory == "320GiB"
    app = GPUSchedApp()
    app.parse_command_line(["--GPUSchedApp.checkpoint_host_memory=0"])
    assert app.checkpoint_host_memory == 0
    app = GPUSchedApp()
    with pytest.raises((TraitError, SystemExit)):
        app.parse_command_line(["--GPUSchedApp.checkpoint_host_memory=16"])
    assert app.checkpoint_host_memory != 16


# -- the REST API: JSON numbers are bytes and seconds, strings need their unit ----------------------
async def test_rest_refuses_a_string_without_a_unit_and_keeps_json_numbers(jp_fetch, start_kernel, gpu_kernelspec):
    gpu_kernelspec("gpu", bind="launch")
    kernel = await start_kernel("gpu")
    lease = await live_lease(jp_fetch, kernel.id)
    code, body = await api(jp_fetch, "leases", lease["id"], "keep", method="POST", body={"seconds": "30"})
    assert code == 400 and body["message"].startswith("seconds needs a unit: '30' alone would be 30 seconds.")
    assert (await live_lease(jp_fetch, kernel.id))["keep_until"] is None, "nothing was kept"
    code, body = await api(jp_fetch, "leases", lease["id"], "keep", method="POST", body={"seconds": 30})
    assert code == 200 and body["keep_until"]
    code, body = await api(jp_fetch, "leases", lease["id"], "keep", method="POST", body={"seconds": "0"})
    assert code == 200 and body["keep_until"] is None

    other = await start_kernel("gpu")
    await api(jp_fetch, "leases", (await live_lease(jp_fetch, other.id))["id"], method="DELETE")
    code, body = await api(jp_fetch, "leases", method="POST", body={"kernel_id": other.id, "memory": "16"})
    assert code == 400 and body["message"].startswith("memory needs a unit: '16' alone would be 16 bytes.")
    code, body = await api(jp_fetch, "leases", method="POST", body={"kernel_id": other.id, "memory": 16 * GiB})
    assert code == 201 and body["memory"] == 16 * GiB


def test_the_published_grammar_refuses_strings_without_a_unit():
    import re

    from jupyter_gpusched.api.openapi import openapi_document

    doc = openapi_document()

    def body(path: str) -> dict:
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        if "$ref" in schema:
            schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return schema["properties"]

    claim, keep = body("/api/gpusched/leases"), body("/api/gpusched/leases/{lease_id}/keep")
    memory = next(k["pattern"] for k in claim["memory"]["anyOf"] if k.get("pattern"))
    seconds = next(k["pattern"] for k in keep["seconds"]["anyOf"] if k.get("pattern"))
    assert not re.search(memory, "16") and re.search(memory, "16GiB") and re.search(memory, "")
    assert not re.search(seconds, "30") and re.search(seconds, "30m") and re.search(seconds, "0")
    assert "a string without a unit such as '16' is refused" in claim["memory"]["description"]


# -- what a notebook shows: the magics and the Python API in a real kernel --------------------------
async def _no_lease(jp_fetch, kernel_id: str) -> bool:
    code, leases = await api(jp_fetch, "leases", params={"kernel_id": kernel_id})
    return code == 200 and not [le for le in leases if le["state"] != "released"]


def _said(out: dict) -> str:
    return out["stdout"] + out["stderr"] + (out["error"] or "") + "".join(out["display"])


async def test_magics_refuse_a_number_without_a_unit_and_change_nothing(jp_fetch, gpu_kernelspec, start_kernel):
    gpu_kernelspec("gpu", gpus=0)  # no GPU before a cell: only what the magics ask for
    kernel = await start_kernel("gpu")

    said = _said(await kernel.execute("%gpu acquire --memory 16"))
    assert (
        "`--memory 16` needs a unit: a number alone would be 16 bytes. Write `--memory 16GiB` or "
        "`--memory 16MiB` (sizes look like 16GiB, 512MiB or 80GB)." in said
    ), said
    assert "Traceback" not in said
    assert await _no_lease(jp_fetch, kernel.id), "no claim was made"

    said = _said(await kernel.execute("%gpu acquire --wait 10"))
    assert "`--wait 10` needs a unit: a number alone would be 10 seconds. Write `--wait 10m` or `--wait 10s`" in said
    assert "--no-wait does not wait" in said
    assert await _no_lease(jp_fetch, kernel.id)

    out = await kernel.execute("%gpu acquire --memory 16GiB --shared")
    assert out["error"] is None, out
    lease = await live_lease(jp_fetch, kernel.id)
    assert lease["memory"] == 16 * GiB

    said = _said(await kernel.execute("%gpu keep 30"))
    assert (
        "`%gpu keep 30` needs a unit: a number alone would be 30 seconds. Write `%gpu keep 30m` or "
        "`%gpu keep 30s` (durations look like 90s, 30m, 1h30m or 2h; 0 or off stops keeping)." in said
    ), said
    assert (await live_lease(jp_fetch, kernel.id))["keep_until"] is None, "nothing was kept"
    out = await kernel.execute("%gpu keep 30m")
    assert out["error"] is None and "kept for 30m00s" in _said(out), out
    out = await kernel.execute("%gpu keep 0")
    assert out["error"] is None and "no longer kept" in _said(out), out


async def test_the_python_api_refuses_a_size_without_a_unit(jp_fetch, gpu_kernelspec, start_kernel):
    gpu_kernelspec("gpu", gpus=0)
    kernel = await start_kernel("gpu")
    out = await kernel.execute("from jupyter_gpusched import gpu\ngpu.acquire(memory=16)")
    assert out["error"] == (
        "ValueError: memory=16 would be 16 bytes: give the unit, as in memory='16GiB' (sizes look like "
        "'16GiB', '512MiB' or '80GB'; a number is read as bytes)"
    ), out
    out = await kernel.execute("gpu.acquire(memory='16')")
    assert out["error"].startswith("MissingUnit: memory needs a unit: '16' alone would be 16 bytes."), out
    out = await kernel.execute("gpu.keep('30')")
    assert out["error"].startswith("MissingUnit: keep needs a unit: '30' alone would be 30 seconds."), out
    assert await _no_lease(jp_fetch, kernel.id), "no claim was made"
    out = await kernel.execute(f"lease = gpu.acquire(memory={16 * GiB}, mode='shared')")
    assert out["error"] is None, out
    assert (await live_lease(jp_fetch, kernel.id))["memory"] == 16 * GiB
