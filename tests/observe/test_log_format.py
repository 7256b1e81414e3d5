"""`relay serve --log-format text` (issue 34 item 7): one human line per event for a terminal,
the same fields as the JSON line (the default), a value from a client escaped so that it can
neither end the line nor forge another, nor drive the terminal."""

from __future__ import annotations

import asyncio
import json
import re
import signal

import pytest

from relay.observe.log import Log, LogFormat, text_line, text_value
from tests.support import httpc
from tests.support.processes import kill, start

TS = 1700000000.25


def lines_of(fmt: LogFormat) -> tuple[list[bytes], Log]:
    out: list[bytes] = []
    log = Log(sink=out.append, fmt=fmt)
    return out, log


def test_json_stays_the_default_and_text_carries_the_same_fields():
    out, log = lines_of(LogFormat.JSON)
    assert Log().format is LogFormat.JSON
    log.event("upstream_down", upstream="gpu", error="connect refused", n=3, ok=True)
    [line] = out
    rec = json.loads(line)
    assert (rec["event"], rec["upstream"], rec["error"], rec["n"], rec["ok"]) == (
        "upstream_down",
        "gpu",
        "connect refused",
        3,
        True,
    )
    out, log = lines_of(LogFormat.TEXT)
    log.event("upstream_down", upstream="gpu", error="connect refused", n=3, ok=True)
    [line] = out
    assert re.fullmatch(
        rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z upstream_down upstream=gpu "
        rb'error="connect refused" n=3 ok=true\n',
        line,
    ), line


def test_a_text_line_reads_time_event_then_fields_in_order():
    entry = {"ts": TS, "event": "config_reloaded", "added": ["b"], "changed": [], "keys": 2}
    assert text_line(entry) == (
        b'2023-11-14T22:13:20.250Z config_reloaded added=["b"] changed=[] keys=2\n'
    )
    assert text_line({"ts": TS, "event": "relay_stopped"}) == (
        b"2023-11-14T22:13:20.250Z relay_stopped\n"
    )


@pytest.mark.parametrize(
    "value,shown",
    [
        ("gpu-1", "gpu-1"),
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("", '""'),
        ("two words", '"two words"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("a=b", '"a=b"'),
        # a forged second line, a terminal's escape (ESC and the one-byte CSI), separators
        (
            "x\n2023-11-14T22:13:20.250Z relay_stopped",
            '"x\\n2023-11-14T22:13:20.250Z relay_stopped"',
        ),
        ("x\r\x00\x7f", '"x\\r\\u0000\\u007f"'),
        ("\x1b[2J\x9b31m", '"\\u001b[2J\\u009b31m"'),
        ("a\u2028b\u2029c\x85", '"a\\u2028b\\u2029c\\u0085"'),
        ("caf\u00e9", '"caf\u00e9"'),
        (None, "null"),
        (1.5, "1.5"),
        (["a b", "c\x9b\u2028"], '["a b","c\\u009b\\u2028"]'),
        ({"k": "v\n"}, '{"k":"v\\n"}'),
    ],
)
def test_a_value_is_bare_only_when_plain_and_never_holds_a_raw_control(value, shown):
    assert text_value(value) == shown
    line = text_line({"ts": TS, "event": "e", "f": value})
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]", line.decode())


async def test_serve_logs_text_lines_and_a_client_cannot_forge_one(tmp_path):
    proc = await start("serve", "--demo", "--port", "0", "--log-format", "text", cwd=str(tmp_path))
    seen: list[str] = []
    try:
        while True:
            line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
            assert line, seen
            seen.append(line)
            if " relay_listening " in line:
                port = int(re.search(r" port=(\d+)", line).group(1))
                break
        forged = "demo\n2023-11-14T22:13:20.250Z relay_stopped forged=1\x1b[2J"
        body = httpc.chat(2)
        body["model"] = forged
        resp = await httpc.fetch(port, "POST", "/v1/chat/completions", body)
        assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        seen += (await proc.stderr.read()).decode().splitlines(keepends=True)
    finally:
        await kill(proc)
    assert all(re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z [a-z_]+( |\n)", line) for line in seen), seen
    events = [line.split(" ")[1].strip() for line in seen]
    assert "demo_simulator" in events and events[-1] == "relay_stopped"
    assert events.count("relay_stopped") == 1
    [access] = [line for line in seen if " access " in line]
    assert ' model="demo\\n2023-11-14T22:13:20.250Z relay_stopped forged=1\\u001b[2J" ' in access


async def test_workers_write_text_lines_too(tmp_path):
    """The format reaches the worker processes: their lines are text beside the parent's."""
    proc = await start(
        "serve", "--demo", "--port", "0", "--workers", "2", "--log-format", "text",
        cwd=str(tmp_path),
    )  # fmt: skip
    seen: list[str] = []
    try:
        while sum(" worker_listening " in line for line in seen) < 2:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            assert line, seen
            seen.append(line)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        seen += (await proc.stderr.read()).decode().splitlines(keepends=True)
    finally:
        await kill(proc)
    assert all(re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z [a-z_]+( |\n)", line) for line in seen), seen
    assert sum(" worker_stopped " in line for line in seen) == 2
