"""The operator page (issue 13 item 4, issue 23 items 5-6) in a real headless Chromium, driven
over the DevTools protocol (tests/support/cdp.py): it loads without console errors, shows each
upstream's state, uPlot's charts of each upstream and model drawn from the state's series, a
request made meanwhile appears in its table within 2 s with its method, path and E2E, a request
that generates nothing is left out of the counts unless asked for (the toggle, `/ui?all=1`), and
the admin key prompt refuses a wrong key and shows the data with the right one. The charts
(issue 34 item 10), at 1400 and 900 px, loaded and resized: each fits its card, a point with no
neighbour is drawn, idle steps are left blank, legends show values or nothing. Screenshots go
under the test's temp dir."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from relay.config import UpstreamConfig
from relay.observe.record import Record
from relay.stream.itl import key_of
from tests.support import httpc
from tests.support.cdp import Browser, chromium_path
from tests.support.helpers import closed_port, wait_for
from tests.support.keys import ADMIN, OTHER_SECRET, SECRET, bearer, key, sha
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
    # (nothing in flight or queued now)
    assert [b[:5] for b in budget] == [["alpha", "0", "0", "daily", "2 / 100"]]
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


def key_row(key_id: str) -> str:
    return (
        f"[...document.querySelectorAll('#budgets tr[data-key={key_id}]')]"
        ".map(r => [...r.cells].map(c => c.textContent))"
    )


async def shows(page, key_id: str, in_flight: int, queued: int, timeout: float = 10.0) -> None:
    """The key's row shows these figures in its two columns (within `timeout`: the page polls
    once a second)."""
    cells = await page.wait_for(
        f"(r => r.length && r[0][1] === '{in_flight}' && r[0][2] === '{queued}' && r)"
        f"({key_row(key_id)})",
        timeout=timeout,
    )
    assert cells[0][:3] == [key_id, str(in_flight), str(queued)]


async def test_key_table_shows_requests_in_flight_and_queued_in_chromium(
    make_relay, sim, browser, tmp_path
):
    """The key table's two columns are the board's figures: each key's requests holding a slot
    and waiting for one, as the test makes them (one slot; streams that hold it until the test
    hangs up)."""
    keys = [key("alpha", requests_per_day=100), key("beta", OTHER_SECRET)]
    app = await make_relay(keys=keys, parallel=1, pool_timeout_s=60)
    page = await browser.page()
    await page.navigate(f"http://127.0.0.1:{app.port}/ui")
    assert await page.wait_for(f"{key_row('alpha')}.length === 1") is True
    assert await page.eval(key_row("alpha")) == [
        ["alpha", "0", "0", "daily", "0 / 100", "0 (no limit)"]
    ]
    assert await page.eval(key_row("beta")) == [["beta", "0", "0", "no limits"]]
    writers = []
    endless = {**httpc.chat(4000), "sim": {"tokens": 4000, "interval_ms": 50}}
    try:
        # alpha: one holding the slot, two waiting; beta: one waiting.
        for secret, rid, holding, waiting in (
            (SECRET, "a-held", {"alpha": 1}, {}),
            (SECRET, "a-q1", {"alpha": 1}, {"alpha": 1}),
            (SECRET, "a-q2", {"alpha": 1}, {"alpha": 2}),
            (OTHER_SECRET, "b-q1", {"alpha": 1}, {"alpha": 2, "beta": 1}),
        ):
            _r, w = await asyncio.open_connection("127.0.0.1", app.port)
            w.write(
                httpc.build_request("POST", CHAT, endless, {**bearer(secret), "X-Request-Id": rid})
            )
            writers.append(w)
            await wait_for(
                lambda h=holding, q=waiting: (
                    {k: n for k, n in app.board.held_by_key.items() if n} == h
                    and app.board.waiting_by_key() == q
                ),
                timeout=30,
            )
        await shows(page, "alpha", 1, 2)
        await shows(page, "beta", 0, 1)
        await page.screenshot(str(tmp_path / "ui-keys.png"))
        # The one holding the slot hangs up: the slot is beta's turn (alpha had the last one).
        writers.pop(0).close()
        await wait_for(lambda: app.board.waiting_by_key() == {"alpha": 2}, timeout=30)
        await shows(page, "alpha", 0, 2)
        await shows(page, "beta", 1, 0)
    finally:
        for w in writers:
            w.close()
    await shows(page, "alpha", 0, 0, timeout=30)
    await shows(page, "beta", 0, 0, timeout=30)
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


# ---- the charts' drawing (issue 34 item 10) -----------------------------------------------
# app.js COLORS by the series' order (upstream, model): gone · other, llm · solo, llm · tiny.
BLUE, PURPLE, GREEN = (0x2F, 0x6F, 0xDF), (0x8E, 0x44, 0xAD), (0x1A, 0x7F, 0x4B)
TINY = (range(12), range(60, 72))  # the steps with requests: a minute, 4 idle, a minute
SOLO, GONE = 30, 40  # the one step of each


def settled(at: float, rid: str, model: str, ttft: float) -> Record:
    return Record(
        ts=at - 2,
        request_id=rid,
        path=CHAT,
        method="POST",
        model=model,
        upstream_served="llm",
        status=200,
        ok=True,
        stream=True,
        ttft_ms=ttft,
        tpot_ms=20.0,
        e2e_ms=ttft + 200,
        total_ms=ttft + 200,
        completion_tokens=10,
        tokens_source="exact",
        itl_hist=f"o32 z0 {key_of(0.02)}:9",
    )


def window_of_steps(app, now: float) -> list[float]:
    """A whole window of steps (72 of 5 s) as the sampler closes them: `llm · tiny`, two
    streams a step for a minute, nothing for 4 minutes, then a minute more, TTFT rising
    (100 + 10 ms a step); `llm · solo`, 10 streams in one step; `gone · other`, one failed
    request in one step. The times of the steps."""
    trend = app.ui_trend
    times = []
    for i in range(72):
        at = now - 5 * (71 - i)
        if i in TINY[0] or i in TINY[1]:
            for j in range(2):
                trend.add(settled(at, f"tiny-{i}-{j}", "tiny", 100.0 + 10 * i + j), True)
        if i == SOLO:
            for j in range(10):
                trend.add(settled(at, f"solo-{j}", "solo", 400.0 + j), True)
        if i == GONE:
            trend.add(
                Record(
                    ts=at - 2,
                    request_id="gone-1",
                    path=CHAT,
                    method="POST",
                    model="other",
                    upstream_requested="gone",
                    status=502,
                    stream=True,
                ),
                True,
            )
        trend.next_at = 0.0
        trend.sample(at, 0.0, None)
        times.append(round(at, 3))
    trend.next_at = now + 3600  # the sampler adds no point of its own during the test
    return times


# Each chart's card (its content box: inside border and padding) against uPlot's root and its
# canvas: the CSS boxes, in px, and whether both lie inside the card, 90 % of its width at least
# (the page draws them 651 px wide in cards of 652 at 1400 px, 827 in 827 at 900; before issue
# 34 some were 429 in 652 and some 840 in 827).
FITS = """[...document.querySelectorAll('#charts [data-chart]')].map((box) => {
  const b = box.getBoundingClientRect(), s = getComputedStyle(box);
  const left = b.left + box.clientLeft + parseFloat(s.paddingLeft);
  const right = b.left + box.clientLeft + box.clientWidth - parseFloat(s.paddingRight);
  const inside = (el) => { const r = el && el.getBoundingClientRect();
    return r && r.left >= left - 0.5 && r.right <= right + 0.5 && r.width >= 0.9 * (right - left); };
  const canvas = box.querySelector('canvas');
  return {chart: box.dataset.chart, card: right - left, canvas: canvas && canvas.getBoundingClientRect().width,
          ok: !!(inside(canvas) && inside(box.querySelector('.uplot')))};
})"""


async def fitted(page) -> list[dict]:
    try:
        await page.wait_for(f"{FITS}.every((f) => f.ok)", timeout=5.0)
    except AssertionError:
        pytest.fail(f"a chart not within its card: {await page.eval(FITS)}")
    return await page.eval(FITS)


# The charts' uPlot objects are read as app.js keeps them: `charts`, a binding of the page's
# script (`charts.get(id).u`).
def colour_near(chart: str, t: float, v: float, rgb: tuple[int, int, int]) -> str:
    """Pixels of a colour within 3 px of the chart's point (t, v) (uPlot's own scales place
    it on the canvas)."""
    return (
        f"(() => {{ const u = charts.get('{chart}').u, [r, g, b] = {list(rgb)};"
        f" const x = Math.round(u.valToPos({t}, 'x', true)), y = Math.round(u.valToPos({v}, 'y', true));"
        " const d = u.ctx.getImageData(x - 3, y - 3, 7, 7).data; let n = 0;"
        " for (let i = 0; i < d.length; i += 4) if (Math.abs(d[i] - r) < 8 && Math.abs(d[i + 1] - g) < 8"
        " && Math.abs(d[i + 2] - b) < 8 && d[i + 3] > 200) n++; return n; })()"
    )


def coloured_across(chart: str, t: float) -> str:
    """Pixels with a colour (not the transparent background, not the grey grid) in the 3 px
    wide column of the chart's plot at time t."""
    return (
        f"(() => {{ const u = charts.get('{chart}').u;"
        f" const x = Math.round(u.valToPos({t}, 'x', true));"
        " const d = u.ctx.getImageData(x - 1, u.bbox.top, 3, u.bbox.height).data; let n = 0;"
        " for (let i = 0; i < d.length; i += 4) { const c = [d[i], d[i + 1], d[i + 2]];"
        " if (d[i + 3] > 0 && Math.max(...c) - Math.min(...c) > 24) n++; } return n; })()"
    )


def legend_values(chart: str) -> str:
    return (
        f"[...document.querySelectorAll('[data-chart={chart}] .u-legend .u-value')]"
        ".map(v => v.textContent)"
    )


async def check_drawing(page, times: list[float]) -> None:
    """The lone points drawn, the idle minutes left blank, the legends without placeholders."""
    # 10 streams in one step: a TTFT, TPOT and E2E point with no neighbour, each a dot
    for chart, value in (("ttft", 404.5), ("tpot", 20.0), ("e2e", 604.5)):
        assert await page.eval(colour_near(chart, times[SOLO], value, PURPLE)) > 0, chart
    # one request, failed: a 100 % error step, and the 0 % of the 10 streams' step
    assert await page.eval(colour_near("err", times[GONE], 100.0, BLUE)) > 0
    assert await page.eval(colour_near("err", times[SOLO], 0.0, PURPLE)) > 0
    # 4 idle minutes: nothing drawn across them, the line drawn up to them and after
    first, last = TINY[0][-1], TINY[1][0]
    for chart, base, rise in (("ttft", 100.5, 10), ("tpot", 20.0, 0), ("e2e", 300.5, 10)):
        assert await page.eval(coloured_across(chart, (times[first] + times[last]) / 2)) == 0
        for i in (first, last):
            assert await page.eval(colour_near(chart, times[i], base + rise * i, GREEN)) > 0
    # the requests/s of the idle minutes: 0, a value drawn across them
    assert await page.eval(colour_near("rps", (times[first] + times[last]) / 2, 0.0, GREEN)) > 0
    for chart in CHARTS:
        values = await page.eval(legend_values(chart))
        assert values and values == [""] * len(values), chart  # no cursor: nothing, not `--`
    legends = await page.eval(
        "[...document.querySelectorAll('#charts .u-legend')].map(l => l.textContent)"
    )
    assert len(legends) == 6 and not any("--" in text for text in legends)


async def test_charts_fit_and_draw_in_chromium(make_relay, sim, browser, tmp_path):
    app = await make_relay(upstreams=upstreams(sim))
    times = window_of_steps(app, time.time())
    trend = (await httpc.fetch(app.port, "GET", "/api/ui/state")).json()["trend"]
    assert trend["times"] == times
    gone, solo, tiny = trend["series"]
    assert [(s["upstream"], s["model"]) for s in trend["series"]] == [
        ("gone", "other"),
        ("llm", "solo"),
        ("llm", "tiny"),
    ]
    # an idle step has no latency and no error rate (a gap), but 0 requests/s (a value)
    assert [i for i, v in enumerate(tiny["ttft_p50"]) if v is not None] == [*TINY[0], *TINY[1]]
    assert tiny["ttft_p50"][:2] == [100.5, 110.5] and tiny["req_s"][30] == 0.0
    assert [i for i, v in enumerate(solo["ttft_p50"]) if v is not None] == [SOLO]
    assert [(i, v) for i, v in enumerate(gone["err_pct"]) if v is not None] == [(GONE, 100.0)]
    for width, then in ((1400, 900), (900, 1400)):
        page = await browser.page()
        await page.viewport(width, 1000)
        await page.navigate(f"http://127.0.0.1:{app.port}/ui")
        await page.wait_for("document.querySelectorAll('#charts .uplot canvas').length === 6")
        loaded = await fitted(page)
        await check_drawing(page, times)
        # the cursor on a point of llm · tiny: its values, nothing for the series without one
        at, p50 = times[65], 100.0 + 10 * 65 + 0.5
        xy = await page.eval(
            "(() => { document.querySelector('[data-chart=ttft]').scrollIntoView(); const u = charts.get('ttft').u;"
            " const o = u.over.getBoundingClientRect();"
            f" return [o.left + u.valToPos({at}, 'x'), o.top + u.valToPos({p50}, 'y')]; }})()"
        )
        await page.mouse_move(*xy)
        shown = await page.wait_for(f"(v => v[0] && v)({legend_values('ttft')})")
        # p50 and p99 of 750 and 751 ms, the state's figures to 0.1 ms
        assert shown[1:] == ["", "", "", "", "750.5 ms", "751 ms"]
        assert shown[0][-5:] == time.strftime("%M:%S", time.localtime(at)), shown
        await page.mouse_move(1, 1)
        await page.wait_for(f"{legend_values('ttft')}.every(v => v === '')")
        await page.screenshot(str(tmp_path / f"charts-{width}.png"))
        # the window resized: every chart fits its card again
        await page.viewport(then, 1000)
        await page.wait_for(f"innerWidth === {then}")
        resized = await fitted(page)
        assert [f["card"] for f in resized] != [f["card"] for f in loaded]
        await check_drawing(page, times)
        await page.screenshot(str(tmp_path / f"charts-{width}-to-{then}.png"))
        assert page.errors() == []
        await page.close()


def pool_row(name: str) -> str:
    return (
        f"[...document.querySelectorAll('#pools tr[data-pool=\"{name}\"] td')]"
        ".map(td => td.textContent)"
    )


async def test_pools_table_shows_the_hit_ratio_in_chromium(make_relay, sim, sim_b, browser):
    """The pools table: a pool's members, its queue and its prompt-cache hit ratio, the
    figures the test reads off the rows (each simulator keeps a prompt cache per slot)."""
    ups = [
        UpstreamConfig(name="a", url=sim.url, models=["tiny"], parallel=2),
        UpstreamConfig(name="b", url=sim_b.url, models=["tiny"], parallel=2),
    ]
    app = await make_relay(upstreams=ups)
    page = await browser.page()
    await page.navigate(f"http://127.0.0.1:{app.port}/ui")
    assert await page.wait_for(f"{pool_row('tiny')}.length === 6") is True
    assert await page.eval(pool_row("tiny")) == ["tiny", "a, b", "0", "0", "0", ""]
    system = {"role": "system", "content": "You answer in one line. " * 20}
    turn = [system, {"role": "user", "content": "What is a relay?"}]
    first = await httpc.fetch(
        app.port, "POST", CHAT, {**httpc.chat(3, stream=False), "messages": turn}
    )
    turn += [first.json()["choices"][0]["message"], {"role": "user", "content": "And a pool?"}]
    second = await httpc.fetch(
        app.port, "POST", CHAT, {**httpc.chat(3, stream=False), "messages": turn}
    )
    assert first.status == second.status == 200
    app.store.flush()
    rows = app.store.query("SELECT pool, prompt_tokens, cached_tokens FROM request")
    assert [r["pool"] for r in rows] == ["tiny", "tiny"] and rows[1]["cached_tokens"] > 0
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] or 0 for r in rows)
    expect = ["tiny", "a, b", "0", str(prompt), str(cached), f"{100 * cached / prompt:.1f} %"]
    assert (
        await page.wait_for(
            f"JSON.stringify({pool_row('tiny')}) === {json.dumps(json.dumps(expect, separators=(',', ':')))}",
            timeout=15,
        )
        is True
    )
    assert page.errors() == []
    await page.close()
