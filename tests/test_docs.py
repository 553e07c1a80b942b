"""The docs: the site builds with `mkdocs build --strict` (a broken link or anchor, or a page left out of the
nav, fails it), the README stays short with the two set-up commands, its links resolve, the benchmark
plots are shown and the architecture page lists the packages in the order the code-shape test holds."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.test_code_shape import OURS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SETUP_COMMANDS = ["bash scripts/demo.sh", "bash scripts/test.sh"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_site_builds_with_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}{built.stderr}"
    assert (site / "index.html").is_file() and (site / "benchmarks" / "index.html").is_file()
    assert (site / "results" / "sweep.png").is_file()


def setup_block(text: str) -> list[str]:
    """The commands of the first bash block after the `Set-up` heading, comments dropped."""
    after = text[text.index("## Set-up"):]
    block = after[after.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_readme_is_short_and_shows_the_two_setup_commands() -> None:
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines < 200, f"README.md has {lines} lines; what is not for a newcomer's first read goes in docs/"
    assert setup_block(text) == SETUP_COMMANDS
    assert setup_block((DOCS / "getting-started.md").read_text()) == SETUP_COMMANDS
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(), "CI runs the README's test command"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_outside_the_site_resolve() -> None:
    """README.md and proxy/README.md are read on GitHub, outside the site: their relative links and anchors."""
    broken = []
    for page in (README, ROOT / "proxy" / "README.md"):
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in {github_anchor(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_every_benchmark_plot_is_shown() -> None:
    shown = {name for page in DOCS.glob("*.md")
             for name in re.findall(r"!\[[^\]]*\]\(results/([^)]+\.png)\)", page.read_text())}
    plots = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.png")}
    assert plots <= shown, f"plots in benchmarks/results/ that no page of docs/ shows: {sorted(plots - shown)}"


def test_architecture_page_lists_the_packages_in_the_code_shape_order() -> None:
    text = (DOCS / "architecture.md").read_text()
    table = text[text.index("| package | job |"):].split("\n\n")[0].splitlines()[2:]
    listed = [re.sub(r"(/|\.py)$", "", name) for row in table for name in re.findall(r"`([^`]+)`", row.split("|")[1])]
    assert listed == [p for p in OURS if p != "tests"], "docs/architecture.md's table and tests/test_code_shape.py disagree"
