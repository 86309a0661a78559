"""Usage, costs and the audit log per project, in OpenAI's Administration API shapes, with
the CSV and JSONL exports; bad queries are 400s."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tenancy_harness import ADMIN, Server, admin, new_key, new_project, start

EMBED = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start(Path(tmp_path_factory.mktemp("data")), "--cost-per-hour", "3600")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def traffic(server: Server) -> dict[str, Any]:
    """Project a: two chat completions; project b: one completion and one embedding."""
    t0 = int(time.time())
    a, b = new_project(server), new_project(server)
    ka, kb = new_key(server, a), new_key(server, b)
    usage: dict[str, list] = {a: [], b: []}
    ca = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ka["value"], max_retries=0)
    cb = openai.OpenAI(base_url=f"{server.url}/v1", api_key=kb["value"], max_retries=0)
    for _ in range(2):
        r = ca.chat.completions.create(model=server.model, max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}])
        usage[a].append(r.usage)
    r2 = cb.completions.create(model=server.model, prompt="one two", max_tokens=3)
    usage[b].append(r2.usage)
    emb = cb.embeddings.create(model=EMBED, input="some words")
    return {"t0": t0, "a": a, "b": b, "ka": ka["id"], "kb": kb["id"], "usage": usage,
            "emb_tokens": emb.usage.prompt_tokens}


def results(page: dict[str, Any]) -> list[dict[str, Any]]:
    assert page["object"] == "page"
    return [r for bucket in page["data"] for r in bucket["results"]]


def test_completions_usage_by_project_and_key(server: Server, traffic: dict) -> None:
    r = admin(server, "GET", "/usage/completions", params={
        "start_time": traffic["t0"] - 60, "bucket_width": "1h",
        "group_by[]": ["project_id", "api_key_id", "model"]})
    assert r.status_code == 200, r.text
    by_project = {x["project_id"]: x for x in results(r.json())}
    a, b = by_project[traffic["a"]], by_project[traffic["b"]]
    assert a["object"] == "organization.usage.completions.result"
    assert a["num_model_requests"] == 2 and a["api_key_id"] == traffic["ka"]
    assert a["input_tokens"] == sum(u.prompt_tokens for u in traffic["usage"][traffic["a"]])
    assert a["output_tokens"] == sum(u.completion_tokens for u in traffic["usage"][traffic["a"]])
    assert b["num_model_requests"] == 1 and b["model"] == server.model
    # A project filter keeps the other out.
    r = admin(server, "GET", "/usage/completions", params={
        "start_time": traffic["t0"] - 60, "project_ids[]": traffic["b"],
        "group_by": "project_id"})
    assert {x["project_id"] for x in results(r.json())} == {traffic["b"]}


def test_embeddings_usage(server: Server, traffic: dict) -> None:
    r = admin(server, "GET", "/usage/embeddings", params={
        "start_time": traffic["t0"] - 60, "group_by": "project_id,model"})
    (only,) = results(r.json())
    assert only["project_id"] == traffic["b"] and only["model"] == EMBED
    assert only["input_tokens"] == traffic["emb_tokens"]


def test_costs_by_project(server: Server, traffic: dict) -> None:
    r = admin(server, "GET", "/costs", params={"start_time": traffic["t0"] - 60,
                                               "group_by[]": "project_id"})
    costs = {x["project_id"]: x["amount"] for x in results(r.json())}
    assert costs[traffic["a"]]["value"] > 0 and costs[traffic["a"]]["currency"] == "usd"
    assert set(costs) == {traffic["a"], traffic["b"]}


def test_minute_buckets_page(server: Server, traffic: dict) -> None:
    start = traffic["t0"] - 600
    r = admin(server, "GET", "/usage/completions", params={
        "start_time": start, "bucket_width": "1m", "limit": 3}).json()
    assert [b["start_time"] for b in r["data"]] == [start, start + 60, start + 120]
    assert r["has_more"] and r["next_page"] == str(start + 180)


def test_csv_and_jsonl_exports(server: Server, traffic: dict) -> None:
    r = admin(server, "GET", "/usage/export", params={"start_time": traffic["t0"] - 60})
    assert r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == 4 and {row["project_id"] for row in rows} == {traffic["a"], traffic["b"]}
    lines = admin(server, "GET", "/usage/export", params={
        "start_time": traffic["t0"] - 60, "format": "jsonl",
        "project_ids": traffic["a"]}).text.splitlines()
    assert [json.loads(x)["finish_reason"] for x in lines] == ["length", "length"]


def test_audit_log(server: Server, traffic: dict) -> None:
    r = admin(server, "GET", "/audit_logs", params={
        "project_ids[]": traffic["a"], "event_types[]": "api_key.created"}).json()
    (event,) = r["data"]
    assert event["object"] == "organization.audit_log" and event["type"] == "api_key.created"
    assert event["api_key.created"]["id"] == traffic["ka"]
    assert event["project"]["id"] == traffic["a"]
    admin(server, "POST", f"/projects/{traffic['a']}", json={"max_requests_per_1_minute": 99})
    newest = admin(server, "GET", "/audit_logs", params={"limit": 1}).json()
    assert newest["data"][0]["type"] == "project.limits_updated" and newest["has_more"]
    older = admin(server, "GET", "/audit_logs", params={
        "limit": 1, "after": newest["last_id"]}).json()
    assert older["data"][0]["id"] != newest["data"][0]["id"]
    exported = admin(server, "GET", "/audit_logs/export").text.splitlines()
    assert json.loads(exported[-1])["type"] == "project.limits_updated"


@pytest.mark.parametrize("params", [
    {}, {"start_time": "yesterday"}, {"start_time": 10, "bucket_width": "1w"},
    {"start_time": 10, "group_by": "user_id"}, {"start_time": 10, "limit": 0},
    {"start_time": 100, "end_time": 50}])
def test_bad_usage_queries_are_400(server: Server, params: dict) -> None:
    r = admin(server, "GET", "/usage/completions", params=params)
    assert r.status_code == 400, r.text


def test_one_audit_record_per_request_without_text(server: Server, traffic: dict) -> None:
    events = admin(server, "GET", "/audit_logs", params={
        "project_ids[]": traffic["a"], "event_types[]": "request.completed"}).json()["data"]
    assert len(events) == 2
    data = events[0]["request.completed"]["data"]
    assert data["key_id"] == traffic["ka"] and data["model"] == server.model
    assert data["finish_reason"] == "length" and data["latency"] > 0 and data["cost"] > 0
    assert events[0]["actor"]["api_key"] == {"id": traffic["ka"], "type": "service_account"}
    assert "prompts" not in data and "answers" not in data
    assert len(data["model_version"]) == 16  # the weights' fingerprint


def test_audit_log_content_keeps_the_text(tmp_path: Path) -> None:
    s = start(tmp_path, "--audit-log-content")
    try:
        key = new_key(s, new_project(s))["value"]
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0)
        answer = c.completions.create(model=s.model, prompt="count: one two", max_tokens=3,
                                      temperature=0).choices[0].text
        (event,) = admin(s, "GET", "/audit_logs", params={
            "event_types[]": "request.completed"}).json()["data"]
        data = event["request.completed"]["data"]
        assert data["prompts"] == ["count: one two"] and data["answers"] == [answer]
    finally:
        s.stop()


def test_prometheus_counters_per_project(server: Server, traffic: dict) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for x in family.samples:
            if x.labels.get("project") == traffic["a"]:
                samples[x.name] = samples.get(x.name, 0.0) + x.value
    a_usage = traffic["usage"][traffic["a"]]
    assert samples["tokenmill:project_requests_total"] == 2
    assert samples["tokenmill:project_prompt_tokens_total"] == sum(
        u.prompt_tokens for u in a_usage)
    assert samples["tokenmill:project_generation_tokens_total"] == sum(
        u.completion_tokens for u in a_usage)
    assert samples["tokenmill:project_cost_total"] > 0


def test_model_actions_are_audited(server: Server) -> None:
    # Runs last: it unloads the embedding model.
    url = f"{server.url}/admin/models"
    failed = httpx.post(url, headers=ADMIN, json={"name": "nope", "path": "/no/such/model"},
                        timeout=60)
    assert failed.status_code >= 400
    r = httpx.delete(f"{url}/{EMBED}", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    events = admin(server, "GET", "/audit_logs", params={
        "event_types[]": ["model.loaded", "model.unloaded"]}).json()["data"]
    assert [(e["type"], e["model.unloaded"]["data"]["name"]) for e in events] == [
        ("model.unloaded", EMBED)]
