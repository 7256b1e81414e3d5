"""The operator page (issue 13 item 4) in a real headless Chromium, driven over the DevTools
protocol (tests/support/cdp.py): it loads without console errors, shows each upstream's state, a
request made meanwhile appears in its table within 2 s, and the admin key prompt refuses a
wrong key and shows the data with the right one. Screenshots go under the test's temp dir."""

from __future__ import annotations

import json
import time
from collections import deque

import pytest

from relay.config import UpstreamConfig
from tests.support import httpc
from tests.support.cdp import Browser, chromium_path
from tests.support.helpers import closed_port
from tests.support.keys import ADMIN, SECRET, bearer, key, sha
from tests.support.need import missing

CHAT = "/v1/chat/completions"


@pytest.fixture
async def browser(tmp_path):
    exe = chromium_path()
    if exe is None:
        missing("needs Chromium, not found: apt-get install chromium (.ci/run installs it)")
    b = await Browser.start(exe, str(tmp_path / "chromium-profile"))
    yield b
    await b.close()


def upstreams(sim) -> list[UpstreamConfig]:
    return [
        UpstreamConfig(name="llm", url=sim.url, models=["tiny"], parallel=4),
        UpstreamConfig(
            name="gone", url=f"http://127.0.0.1:{closed_port()}", models=["other"], parallel=2
        ),
    ]


def state_of(name: str) -> str:
    return f"document.querySelector('[data-upstream=\"{name}\"] [data-role=state]')?.textContent"


def row_cells(rid: str) -> str:
    return (
        f"(() => {{ const r = document.querySelector('tr[data-request-id=\"{rid}\"]');"
        " return r && [...r.cells].map(c => c.textContent); })()"
    )


async def test_page_live_in_chromium(make_relay, sim, browser, tmp_path):
    app = await make_relay(
        upstreams=upstreams(sim), keys=[key("alpha", requests_per_day=100, tokens_per_day=5000)]
    )
    # the "gone" upstream refuses connections: after one request it is down
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, model="other"), headers=bearer())
    assert resp.status == 502
    # six minutes of trend points, as the once-a-second sampler leaves them (observe.ui_state)
    now = time.time()
    app.ui_trend.next_at = now + 3600  # the sampler adds no point of its own during the test
    for i in range(12):
        app.ui_trend.series.setdefault("llm", deque(maxlen=72)).append(
            (now - 330 + 30 * i, 10.0 + 5 * (i % 4), 100.0 + 20 * i)
        )
    page = await browser.page()
    await page.navigate(f"http://127.0.0.1:{app.port}/ui")
    assert await page.wait_for(f"{state_of('llm')} === 'ready' && {state_of('gone')}")
    assert await page.eval("document.getElementById('keyform').hidden") is True
    # the charts: one polyline point per sample, the last value in the label
    points = await page.eval(
        "document.querySelector('[data-upstream=\"llm\"] .tps polyline')"
        ".getAttribute('points').split(' ').length"
    )
    assert points == 12
    assert (
        await page.eval(
            "document.querySelector('[data-upstream=\"llm\"] .ttft .label').textContent"
        )
        == "TTFT (mean of the last minute), last 6 min320 ms · max 320"
    )
    assert await page.eval(state_of("gone")) == "down"
    assert await page.eval(
        "document.querySelector('[data-upstream=\"llm\"]').textContent.includes('0 / 4')"
    )  # slots in use / parallel
    # a request made now shows up in the table within 2 s
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(3), headers={**bearer(), "X-Request-Id": "ui-live-1"}
    )
    assert resp.status == 200 and resp.complete
    cells = await page.wait_for(row_cells("ui-live-1"), timeout=2.0)
    assert cells[1:5] == ["alpha", "tiny", "llm", "200"]
    assert cells[7] == "3" and cells[8] == "done"
    # budget use against limits: two requests, the served one's tokens (2 prompt + 3)
    budget = await page.wait_for(
        "[...document.querySelectorAll('#budgets tr[data-key=alpha]')]"
        ".map(r => [...r.cells].map(c => c.textContent))"
    )
    assert budget == [["alpha", "daily", "1 / 100", "5 / 5000"]]
    await page.screenshot(str(tmp_path / "ui.png"))
    assert page.errors() == []
    await page.close()


async def test_admin_key_prompt_in_chromium(make_relay, sim, browser, tmp_path):
    app = await make_relay(upstreams=upstreams(sim), keys=[key()], admin_key_sha256=sha(ADMIN))
    page = await browser.page()
    await page.navigate(f"http://127.0.0.1:{app.port}/ui")
    await page.wait_for("!document.getElementById('keyform').hidden")
    assert await page.eval("document.querySelectorAll('[data-upstream]').length") == 0
    assert page.errors() == []  # asking for the key costs no refused request

    async def submit(secret: str) -> None:
        await page.eval(
            f"document.getElementById('adminkey').value = {json.dumps(secret)};"
            " document.getElementById('keybutton').click(); true"
        )

    await submit(SECRET)  # an API key is not the admin key
    await page.wait_for("document.getElementById('keymsg').textContent === 'admin key refused'")
    assert await page.eval("document.querySelectorAll('[data-upstream]').length") == 0
    assert await page.eval("location.href") == f"http://127.0.0.1:{app.port}/ui"  # no key in it
    await submit(ADMIN)
    assert await page.wait_for(state_of("llm")) == "ready"
    assert await page.eval("document.getElementById('keyform').hidden") is True
    await page.screenshot(str(tmp_path / "ui-admin.png"))
    # the only errors: the refused wrong key's 401
    assert all("401" in e for e in page.errors()) and len(page.errors()) == 1
    await page.close()
