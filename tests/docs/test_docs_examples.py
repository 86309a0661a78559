"""Run the marked examples of README.md and docs/ (see docs_examples.py): each must exit 0.
`offline` blocks run as they are, `server` blocks against one `tokenmill serve` of the embedded
models on a free port of 127.0.0.1, each in a temporary folder of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from docs_examples import KINDS, ROOT, Example, all_examples, for_server, markdown_files
from server_harness import Server, start_server

EXAMPLES = all_examples()
RUNNABLE = [e for e in EXAMPLES if e.kind in ("offline", "server")]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("docs-server-data")
    srv = start_server("--data-dir", str(data))
    yield srv
    srv.stop()


def _run(example: Example, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = cwd / ("example.py" if example.lang == "python" else "example.sh")
    script.write_text(code, encoding="utf-8")
    if example.lang == "python":
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", str(script)]
    # The interpreter's own bin first, so `tokenmill` is this checkout's.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("example", RUNNABLE, ids=[e.name for e in RUNNABLE])
def test_example_runs(example: Example, request: pytest.FixtureRequest,
                      tmp_path: Path) -> None:
    code = example.code
    if example.kind == "server":
        code = for_server(code, request.getfixturevalue("server").url)
        # curl's exit status then says whether the server answered 2xx.
        code = code.replace("curl ", "curl --fail-with-body ")
    done = _run(example, code, tmp_path)
    assert done.returncode == 0, (f"{example.name} exited {done.returncode}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


def test_markers_are_known_and_on_runnable_blocks() -> None:
    for e in EXAMPLES:
        if e.kind is None:
            continue
        assert e.kind in KINDS, f"{e.name}: unknown docs-test kind {e.kind!r}"
        if e.kind == "skip":
            assert e.reason, f"{e.name}: a skipped example says why"
        else:
            assert e.lang in ("python", "bash"), f"{e.name}: only python and bash blocks run"


def test_every_readme_block_runs_or_says_why_not() -> None:
    """The front page's promise: each command and snippet in it runs."""
    unmarked = [e.name for e in EXAMPLES if e.path.name == "README.md" and e.path.parent == ROOT
                and e.kind is None and e.lang in ("python", "bash")]
    assert unmarked == []


def test_the_runner_fails_a_failing_example(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: offline -->\n```bash\nfalse\n```\n", encoding="utf-8")
    from docs_examples import examples

    (example,) = examples(page)
    assert example.kind == "offline" and example.code == "false\n"
    assert _run(example, example.code, tmp_path).returncode != 0


def test_examples_are_found() -> None:
    assert ROOT / "README.md" in markdown_files()
    assert len(RUNNABLE) >= 8
    assert shutil.which("bash")
