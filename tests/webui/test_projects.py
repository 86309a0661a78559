"""The dashboard's projects panel on a server with ``--admin-key``: hidden until the admin key
is typed in and projects exist, then a project selector, a per-project usage table (requests,
tokens, cost) that the selector filters, and a CSV download of the usage rows."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import httpx
import pytest
from page_helpers import open_dashboard, screenshot, set_field, severe_logs, wait
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select
from server_harness import Server, start_server

ADMIN_KEY = "page-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

# Keep the blobs the page saves, to read the downloaded file back.
KEEP_BLOBS = ("window.savedBlobs = []; const make = URL.createObjectURL;"
              " URL.createObjectURL = (b) => { window.savedBlobs.push(b); return make(b); };")
READ_BLOB = ("const done = arguments[arguments.length - 1];"
             " window.savedBlobs[0].text().then(done);")


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server("--admin-key", ADMIN_KEY,
                     "--data-dir", str(tmp_path_factory.mktemp("tenancy")))
    yield s
    assert s.stop() == 0, s.log()


def admin(server: Server, method: str, path: str, **kw) -> httpx.Response:
    r = httpx.request(method, f"{server.url}/v1/organization{path}", headers=ADMIN,
                      timeout=30, **kw)
    assert r.status_code == 200, r.text
    return r


def ask(server: Server, key: str) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": server.model, "max_tokens": 8,
                         "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def use_admin_key(browser, key: str) -> None:
    set_field(browser, "admin-key", key)
    browser.find_element(By.ID, "admin-key-save").click()


def usage_rows(browser) -> dict[str, list[str]]:
    rows = browser.find_elements(By.CSS_SELECTOR, "#p-usage tr[data-project]")
    return {r.get_attribute("data-project"): [c.text for c in r.find_elements(By.TAG_NAME, "td")]
            for r in rows}


def test_projects_panel_lists_filters_and_exports(browser, tenant_server: Server) -> None:
    open_dashboard(browser, tenant_server)
    panel = browser.find_element(By.ID, "p-panel")
    assert not panel.is_displayed()  # no admin key typed in
    use_admin_key(browser, ADMIN_KEY)
    wait(browser).until(lambda b: b.find_element(By.ID, "p-error").text == "no projects yet")
    assert not panel.is_displayed()
    # A project with a request made with its key, and one without usage.
    team = admin(tenant_server, "POST", "/projects", json={"name": "team"}).json()["id"]
    idle = admin(tenant_server, "POST", "/projects", json={"name": "idle"}).json()["id"]
    key = admin(tenant_server, "POST", f"/projects/{team}/api_keys",
                json={"name": "k"}).json()["value"]
    usage = ask(tenant_server, key)
    use_admin_key(browser, ADMIN_KEY)
    wait(browser).until(lambda b: len(usage_rows(b)) == 2)
    assert panel.is_displayed()
    # The key stays in this tab only.
    assert browser.execute_script("return sessionStorage.getItem('tokenmill.adminKey');") \
        == ADMIN_KEY
    assert browser.execute_script("return localStorage.getItem('tokenmill.adminKey');") is None
    select = Select(browser.find_element(By.ID, "p-project"))
    assert [o.text for o in select.options] == [
        "all projects", f"team ({team})", f"idle ({idle})"]
    rows = usage_rows(browser)
    assert rows[team][:4] == ["team", "1", str(usage["prompt_tokens"]),
                              str(usage["completion_tokens"])]
    assert rows[team][4].startswith("$")  # the cost (0 here: no --cost-per-hour)
    assert rows[idle] == ["idle", "0", "0", "0", "$0"]
    select.select_by_value(team)
    assert list(usage_rows(browser)) == [team]
    screenshot(browser, "webui-projects.png")
    # The CSV download: the file the page saves holds the chosen project's usage row.
    browser.execute_script(KEEP_BLOBS)
    browser.find_element(By.ID, "p-download").click()
    wait(browser).until(lambda b: b.execute_script("return window.savedBlobs.length;") == 1)
    text = browser.execute_async_script(READ_BLOB)
    lines = list(csv.DictReader(io.StringIO(text)))
    assert [(r["project_id"], r["input_tokens"], r["output_tokens"]) for r in lines] == [
        (team, str(usage["prompt_tokens"]), str(usage["completion_tokens"]))]
    assert browser.find_element(By.ID, "p-error").text == ""
    assert severe_logs(browser) == []
    browser.execute_script("sessionStorage.clear();")
    # The next request is answered as before.
    assert ask(tenant_server, key)["completion_tokens"] > 0


def test_a_refused_admin_key_is_said_and_shows_nothing(browser, tenant_server: Server) -> None:
    open_dashboard(browser, tenant_server)
    use_admin_key(browser, "wrong-key")
    wait(browser).until(lambda b: "refused" in b.find_element(By.ID, "p-error").text)
    assert not browser.find_element(By.ID, "p-panel").is_displayed()
    browser.execute_script("sessionStorage.clear();")
    browser.get_log("browser")  # the 401 in the console is the point of this test
