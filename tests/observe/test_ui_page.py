"""The operator page (issue 13 item 4, issue 23 items 5-6) in a real headless Chromium, driven
over the DevTools protocol (tests/support/cdp.py): it loads without console errors, shows each
upstream's state, uPlot's charts of each upstream and model drawn from the state's series, a
request made meanwhile appears in its table within 2 s with its method, path and E2E, a request
that generates nothing is left out of the counts unless asked for (the toggle, `/ui?all=1`), and
the admin key prompt refuses a wrong key and shows the data with the right one. Screenshots go
under the test's temp dir."""

from __future__ import annotations

import json
import time

import pytest

from relay.config import UpstreamConfig
from relay.observe.record import Record
from relay.stream.itl import key_of
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


def history(app, now: float) -> None:
    """Six minutes of points as settled requests and the sampler leave them
    (observe.ui_state.Trend): two streams of 10 tokens per step, TTFT rising."""
    trend = app.ui_trend
    for i in range(12):
        at = now - 330 + 30 * i
        for j in range(2):
            trend.add(
                Record(
                    ts=at - 4,
                    request_id=f"old-{i}-{j}",
                    path=CHAT,
                    method="POST",
                    model="tiny",
                    upstream_served="llm",
                    status=200,
                    ok=True,
                    stream=True,
                    ttft_ms=100.0 + 20 * i + j,
                    tpot_ms=20.0,
                    e2e_ms=300.0 + 20 * i,
                    total_ms=300.0 + 20 * i,
                    completion_tokens=10,
                    tokens_source="exact",
                    itl_hist=f"o32 z0 {key_of(0.02)}:9",
                ),
                True,
            )
        trend.next_at = 0.0
        trend.sample(at, 0.0, None)
    trend.next_at = now + 3600  # the sampler adds no point of its own during the test


def drawn(chart: str, rgb: tuple[int, int, int]) -> str:
    """Pixels of the chart's canvas in a series' colour: its lines were drawn."""
    r, g, b = rgb
    return (
        f"(() => {{ const c = document.querySelector('[data-chart={chart}] canvas');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;"
        f" for (let i = 0; i < d.length; i += 4) if (Math.abs(d[i] - {r}) < 8 &&"
        f" Math.abs(d[i + 1] - {g}) < 8 && Math.abs(d[i + 2] - {b}) < 8 && d[i + 3] > 200) n++;"
        " return n; })()"
    )


CHARTS = ("ttft", "tpot", "e2e", "err", "rps", "tps")
SECOND_COLOUR = (0x8E, 0x44, 0xAD)  # app.js COLORS[1]: the second series, llm · tiny


async def test_page_live_in_chromium(make_relay, sim, browser, tmp_path):
    app = await make_relay(
        upstreams=upstreams(sim), keys=[key("alpha", requests_per_day=100, tokens_per_day=5000)]
    )
    # the "gone" upstream refuses connections: after one request it is down
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, model="other"), headers=bearer())
    assert resp.status == 502
    history(app, time.time())
    doc = (await httpc.fetch(app.port, "GET", "/api/ui/state", headers=bearer())).json()
    gone, series = doc["trend"]["series"]  # (series in the order of upstream and model)
    assert (gone["upstream"], gone["model"], gone["err_pct"][0]) == ("gone", "other", 100.0)
    assert (series["upstream"], series["model"], series["generating"]) == ("llm", "tiny", True)
    assert len(doc["trend"]["times"]) == 12
    for figure in ("req_s", "err_pct", "ttft_p50", "ttft_p99", "tpot", "itl_p99", "tok_s"):
        assert all(v is not None for v in series[figure]), figure
    page = await browser.page()
    await page.navigate(f"http://127.0.0.1:{app.port}/ui")
    # (llm: no probe and no request yet)
    assert await page.wait_for(f"{state_of('llm')} === 'unknown' && {state_of('gone')}")
    assert await page.eval("document.getElementById('keyform').hidden") is True
    # the charts: uPlot's, one per figure, each with the window named, a time axis and data
    assert await page.wait_for("document.querySelectorAll('#charts .uplot canvas').length === 6")
    assert await page.eval(
        "[...document.querySelectorAll('#charts [data-chart]')].map(c => c.dataset.chart)"
    ) == list(CHARTS)
    titles = await page.eval(
        "[...document.querySelectorAll('#charts .u-title')].map(t => t.textContent)"
    )
    assert titles[0] == "TTFT p50 / p99 (ms), last 6 min"
    assert all(t.endswith("last 6 min") for t in titles) and "(tok/s)" in titles[-1]
    for chart in CHARTS:
        points = await page.eval(f"+document.querySelector('[data-chart={chart}]').dataset.points")
        assert points >= 12, chart
        assert await page.eval(drawn(chart, SECOND_COLOUR)) > 20, chart
    legend = await page.eval(legend_of("ttft"))
    assert legend[1:] == [
        "gone · other p50",
        "gone · other p99",
        "llm · tiny p50",
        "llm · tiny p99",
    ]
    assert await page.eval("document.getElementById('window').textContent") == (
        "(last 6 min, a point per 5 s)"
    )
    x_labels = await page.eval("[...document.querySelectorAll('[data-chart=ttft] .u-axis')].length")
    assert x_labels == 2  # a time axis and a value axis with its unit
    assert await page.eval(state_of("gone")) == "down"
    assert await page.eval(
        "document.querySelector('[data-upstream=\"llm\"]').textContent.includes('0 / 4')"
    )  # slots in use / parallel
    # a request made now shows up in the table within 2 s: its method and path, its E2E
    resp = await httpc.fetch(
        app.port, "POST", CHAT, httpc.chat(3), headers={**bearer(), "X-Request-Id": "ui-live-1"}
    )
    assert resp.status == 200 and resp.complete
    cells = await page.wait_for(row_cells("ui-live-1"), timeout=2.0)
    assert cells[1:6] == ["alpha", "tiny", "llm", f"POST {CHAT}", "200"]
    assert float(cells[6]) >= 0 and float(cells[7]) >= float(cells[6])  # TTFT, E2E
    assert cells[9] == "3" and cells[10] == "done"
    resp = await httpc.fetch(
        app.port,
        "POST",
        CHAT,
        httpc.chat(4, stream=False),
        headers={**bearer(), "X-Request-Id": "ui-plain-1"},
    )
    assert resp.status == 200
    cells = await page.wait_for(row_cells("ui-plain-1"), timeout=2.0)
    assert cells[6] == "–" and float(cells[7]) > 0  # not streamed: no TTFT, its E2E
    assert cells[9] == "4"
    # budget use against limits: the two served requests (the 502 reached no upstream)
    budget = await page.wait_for(
        "[...document.querySelectorAll('#budgets tr[data-key=alpha]')]"
        ".map(r => [...r.cells].map(c => c.textContent))"
    )
    assert [b[:3] for b in budget] == [["alpha", "daily", "2 / 100"]]
    # a request that generates nothing: not in the counts unless asked for
    resp = await httpc.fetch(
        app.port, "GET", "/props", headers={**bearer(), "X-Request-Id": "ui-props-1"}
    )
    assert resp.status == 200
    await page.wait_for(
        "document.getElementById('hidden').textContent.includes('not counted: 1 request that generates nothing')"
    )
    assert await page.eval(row_cells("ui-props-1")) is None
    assert await page.eval(requests_of("llm")) == "2"
    await page.screenshot(str(tmp_path / "ui.png"))
    await page.eval("document.getElementById('showall').click(); true")
    cells = await page.wait_for(row_cells("ui-props-1"), timeout=2.0)
    assert cells[4:6] == ["GET /props", "200"]
    assert await page.eval(requests_of("llm")) == "3"
    assert await page.eval("location.search") == "?all=1"
    assert await page.eval("document.getElementById('hidden').textContent") == ""
    await page.wait_for(legend_of("rps") + ".includes('llm · – (generates nothing)')")
    assert "generates nothing" not in " ".join(await page.eval(legend_of("ttft")))  # streams only
    await page.screenshot(str(tmp_path / "ui-all.png"))
    assert page.errors() == []
    await page.close()
    # /ui?all=1 opens with them shown
    page = await browser.page()
    await page.navigate(f"http://127.0.0.1:{app.port}/ui?all=1")
    assert await page.wait_for(row_cells("ui-props-1"), timeout=3.0)
    assert await page.eval("document.getElementById('showall').checked") is True
    assert page.errors() == []
    await page.close()


def legend_of(chart: str) -> str:
    return (
        f"[...document.querySelectorAll('[data-chart={chart}] .u-legend .u-label')]"
        ".map(l => l.textContent)"
    )


def requests_of(name: str) -> str:
    return (
        f"document.querySelector('[data-upstream=\"{name}\"] [data-role=requests] b')?.textContent"
    )


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
    assert await page.wait_for(state_of("llm")) == "unknown"  # no probe, no request yet
    assert await page.eval("document.getElementById('keyform').hidden") is True
    await page.screenshot(str(tmp_path / "ui-admin.png"))
    # the only errors: the refused wrong key's 401
    assert all("401" in e for e in page.errors()) and len(page.errors()) == 1
    await page.close()
