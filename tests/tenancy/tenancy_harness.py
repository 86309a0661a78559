"""Servers with projects: `tokenmill serve --admin-key` on 127.0.0.1, over a temporary data
folder; admin routes driven over plain HTTP, inference through the official openai client."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from server_harness import Server, start_server  # noqa: E402, F401

ADMIN_KEY = "admin-secret"
SERVER_KEY = "server-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def start(data_dir: Path, *extra: str) -> Server:
    """A server with an admin key and a server-wide API key over ``data_dir``."""
    return start_server("--admin-key", ADMIN_KEY, "--api-key", SERVER_KEY,
                        "--data-dir", str(data_dir), *extra,
                        headers={"Authorization": f"Bearer {SERVER_KEY}"})


def admin(server: Server, method: str, path: str, **kw: Any) -> httpx.Response:
    """One admin request (the admin key in its header)."""
    return httpx.request(method, f"{server.url}/v1/organization{path}", headers=ADMIN,
                         timeout=30, **kw)


def new_project(server: Server, **body: Any) -> str:
    r = admin(server, "POST", "/projects", json={"name": "team", **body})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def new_key(server: Server, project_id: str) -> dict[str, Any]:
    r = admin(server, "POST", f"/projects/{project_id}/api_keys", json={"name": "k"})
    assert r.status_code == 200, r.text
    return r.json()
