"""The documentation site builds with `mkdocs build --strict`: no broken link, no page left out
of the navigation, no missing anchor (the same command CI runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-5000:]  # mkdocs logs to stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](nowhere.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text("site_name: t\nstrict: true\ntheme:\n  name: material\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "nowhere.md" in done.stderr


def test_readme_stays_a_front_page() -> None:
    """The README is the front page (what, how, a few measured numbers, links): the guides and
    the dated benchmark history live in docs/. No development machine's paths anywhere."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 400
    pages = [readme, *(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md"))]
    for text in pages:
        for path in ("/work/", "/root/", "/home/", "site-packages/"):
            assert path not in text


def test_readme_links_reach_files() -> None:
    """mkdocs checks the links inside docs/; the README's own relative links are checked here."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert targets
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert missing == []
