"""The dashboard in a real headless browser: its numbers follow the traffic, a new tab's charts
start from the server's history (``GET /stats/history``, a bounded ring buffer sampled every
second), the axes read round numbers (an idle one 0 ... 1), the cost says when no price is
set, and the key button stays hidden without ``--api-key``. With TOKENMILL_SCREENSHOT_DIR set
it saves the page's screenshot there (the docs' images)."""

from __future__ import annotations

import httpx
from page_helpers import open_dashboard, screenshot, severe_logs, wait
from selenium.webdriver.common.by import By
from server_harness import Server, wait_for

from tokenmill.server.webui_routes import CHART_FIELDS, StatsHistory

# The pixels of a canvas drawn in the first series' colour (#2f6fed).
COUNT_LINE_PIXELS = """
const c = document.getElementById(arguments[0]);
const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) {
  if (Math.abs(d[i] - 47) < 30 && Math.abs(d[i + 1] - 111) < 30 && Math.abs(d[i + 2] - 237) < 30
      && d[i + 3] > 128) n++;
}
return n;"""


def traffic(server: Server, requests: int) -> None:
    for _ in range(requests):
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": server.model, "prompt": "Once upon a time", "max_tokens": 16,
            "ignore_eos": True})
        assert r.status_code == 200


def history(server: Server) -> list[dict]:
    body = httpx.get(f"{server.url}/stats/history", timeout=10).json()
    return body["models"].get(server.model, [])


def test_dashboard_follows_the_traffic(browser, server: Server) -> None:
    open_dashboard(browser, server)
    assert severe_logs(browser) == []
    before = int(browser.find_element(By.ID, "d-finished").text)
    traffic(server, 6)  # a few seconds of traffic, for the charts
    wait(browser).until(lambda b: int(b.find_element(By.ID, "d-finished").text) >= before + 3)
    assert float(browser.find_element(By.ID, "d-output-tps").text) > 0
    assert browser.find_element(By.ID, "d-ttft").text != "-"
    assert browser.find_element(By.ID, "d-energy").text.endswith("J (est.)")
    # No --cost-per-hour: the cost says so instead of "$0.000000".
    assert browser.find_element(By.ID, "d-cost").text == "no price set"
    assert not browser.find_element(By.ID, "key-button").is_displayed()  # no --api-key
    assert "script" in browser.find_element(By.ID, "d-drift").text  # the drift signals
    assert severe_logs(browser) == []


def test_the_server_keeps_the_charts_history(server: Server) -> None:
    traffic(server, 2)
    assert wait_for(lambda: any(s["output_tokens_per_s"] > 0 for s in history(server)), 30)
    samples = history(server)
    assert set(samples[-1]) == {"time", *CHART_FIELDS}
    times = [s["time"] for s in samples]
    assert times == sorted(times) and len(times) >= 2
    assert httpx.get(f"{server.url}/stats", timeout=10).json()["api_key_required"] is False
    # The next request is answered as before.
    traffic(server, 1)


def test_a_new_tab_starts_with_the_recent_charts(browser, server: Server) -> None:
    traffic(server, 2)
    assert wait_for(lambda: len(history(server)) >= 10
                    and any(s["output_tokens_per_s"] > 0 for s in history(server)[-8:]), 30)
    open_dashboard(browser, server)
    # The first poll has just drawn: the charts already hold the server's samples.
    plotted = browser.execute_script(
        "return chartHistory[arguments[0]].map((e) => e.output_tokens_per_s);", server.model)
    assert len(plotted) >= 10 and max(plotted) > 0
    assert browser.execute_script(COUNT_LINE_PIXELS, "c-throughput") > 50
    screenshot(browser, "webui-dashboard.png")
    assert severe_logs(browser) == []


def test_chart_axes_read_round_numbers(browser, server: Server) -> None:
    open_dashboard(browser, server)

    def ticks(values: list) -> list[str]:
        return browser.execute_script("return axisTicks(arguments[0]).labels;", values)

    assert ticks([]) == ["0", "0.25", "0.5", "0.75", "1"]  # idle: not 1.10e-9 ... 2.75e-10
    assert ticks([0, None, 0]) == ["0", "0.25", "0.5", "0.75", "1"]
    assert ticks([37, 12]) == ["0", "20", "40", "60", "80"]
    assert ticks([1]) == ["0", "0.5", "1", "1.5", "2"]
    assert ticks([0.0123]) == ["0", "0.005", "0.01", "0.015", "0.02"]
    assert ticks([900]) == ["0", "250", "500", "750", "1000"]
    assert ticks([950]) == ["0", "500", "1000", "1500", "2000"]  # 10% headroom
    money = "return money(arguments[0]);"
    assert browser.execute_script(money, None) == "no price set"
    assert browser.execute_script(money, 0.0000123) == "$0.000012"
    assert browser.execute_script(money, 0.25) == "$0.25"
    assert browser.execute_script(money, 12.5) == "$12.50"


def test_stats_history_is_a_bounded_ring_buffer() -> None:
    h = StatsHistory(max_samples=3)
    entry = dict.fromkeys(CHART_FIELDS, 0)
    for t in range(5):
        h.add(float(t), {"a": {**entry, "running": t, "task": "generate"}})
    h.add(5.0, {"a": {**entry, "running": 5}, "b": entry})  # b is loaded later
    body = h.as_json()
    assert body["interval_s"] == 1.0
    assert [s["running"] for s in body["models"]["a"]] == [3, 4, 5]
    assert [s["time"] for s in body["models"]["a"]] == [3.0, 4.0, 5.0]
    assert "task" not in body["models"]["a"][0]  # only what the charts plot
    assert [s["time"] for s in body["models"]["b"]] == [5.0]
