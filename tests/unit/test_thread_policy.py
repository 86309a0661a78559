"""OpenMP's wait policy: the `tokenmill` command lets idle threads sleep unless the user chose
a policy, and only when it starts before torch is loaded (libgomp reads the variable when it is
loaded). Importing tokenmill sets nothing (tests/unit/test_envs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.bench.contention import parse_policy, policy_env

# The `tokenmill` command's start (`tokenmill --help`, which exits after printing), then what
# the environment says.
PROBE = """import os, sys{first}
from tokenmill import cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
{after}
print("policy", os.environ.get("OMP_WAIT_POLICY"))"""


def probe(first: str = "", after: str = "", **env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first, after=after)],
                         env={**base, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1].removeprefix("policy ")


def test_idle_threads_sleep_by_default() -> None:
    assert probe() == "PASSIVE"
    # The torch that the command's modules load see it: libgomp then sleeps at once.
    assert probe(after="import torch") == "PASSIVE"


def test_the_users_choice_is_kept() -> None:
    assert probe(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert probe(GOMP_SPINCOUNT="300000") == "None"


def test_nothing_changes_once_torch_is_loaded() -> None:
    assert probe(first=", torch") == "None"


def test_contention_policies_parse() -> None:
    assert parse_policy("tokenmill=") == ("tokenmill", {})
    assert parse_policy("spin=GOMP_SPINCOUNT=300000,OMP_WAIT_POLICY=ACTIVE") == (
        "spin", {"GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": "ACTIVE"})
    for bad in ("noequals", "=X=1", "name=VAR"):
        with pytest.raises(ValueError, match="--policy"):
            parse_policy(bad)
    env = policy_env({"GOMP_SPINCOUNT": "1"})
    assert env["GOMP_SPINCOUNT"] == "1" and "OMP_WAIT_POLICY" not in env


def test_contention_policies_drop_inherited_pool_settings(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_SPIN_US", "0")
    monkeypatch.setenv("TOKENMILL_THREAD_POOL", "0")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = policy_env({})
    assert not {"TOKENMILL_SPIN_US", "TOKENMILL_THREAD_POOL", "OMP_WAIT_POLICY"} & set(env)
    assert policy_env({"TOKENMILL_SPIN_US": "50"})["TOKENMILL_SPIN_US"] == "50"
