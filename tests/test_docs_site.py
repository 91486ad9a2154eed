"""The documentation site builds under `--strict` and documents every public name.

Skips only when the `docs` extra (mkdocs, mkdocs-material, mkdocstrings[python]) is
missing; the README's test command installs it, so CI runs these.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cache

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# The spec modules whose public names the `spec` reference page must document.
SPEC_MODULES = ("spec.lifecycle", "spec.invariants", "spec.errors", "spec.model", "spec.snapshot")


def public_names(module: str) -> list[str]:
    """`__all__` when the module defines it, else its top-level public definitions.

    Read from the source, so imported names (which belong to another module) are not
    counted, and constants without a `__module__` are.
    """
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    names: list[str] = []
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                if target.id == "__all__" and isinstance(node, ast.Assign):
                    return list(ast.literal_eval(node.value))
                names.append(target.id)
    return [name for name in dict.fromkeys(names) if not name.startswith("_")]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built by `mkdocs build --strict` (any warning fails the build)."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(
        [*command, "--config-file", str(ROOT / "mkdocs.yml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    return out


def html_ids(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text()))


def test_strict_build_produces_every_page(site: Path) -> None:
    for page in DOCS.rglob("*.md"):
        relative = page.relative_to(DOCS).with_suffix("")
        built = site / "index.html" if relative.name == "index" else site / relative / "index.html"
        assert built.is_file(), f"{page.relative_to(ROOT)} was not built"


def test_cache_reference_documents_every_name_in_all(site: Path) -> None:
    ids = html_ids(site / "reference" / "cache" / "index.html")
    missing = [name for name in cache.__all__ if f"cache.{name}" not in ids]
    assert not missing, f"docs/reference/cache.md does not document {missing}"


@pytest.mark.parametrize("module", SPEC_MODULES)
def test_spec_reference_documents_every_public_name(site: Path, module: str) -> None:
    names = public_names(module)
    assert names
    ids = html_ids(site / "reference" / "spec" / "index.html")
    missing = [name for name in names if f"{module}.{name}" not in ids]
    assert not missing, f"docs/reference/spec.md does not document {module}: {missing}"


def test_public_names_reads_definitions_not_imports() -> None:
    assert "NodeState" in public_names("spec.lifecycle")
    assert "NODE_TRANSITIONS" in public_names("spec.lifecycle")
    assert "Snapshot" not in public_names("spec.invariants")  # imported there
    assert public_names("spec.model") == list(importlib.import_module("spec.model").__all__)


def test_diagrams_use_the_vendored_mermaid_and_no_cdn(site: Path) -> None:
    source = (DOCS / "lifecycle.md").read_text()
    page = (site / "lifecycle" / "index.html").read_text()
    fences = source.count("```mermaid")
    assert fences >= 2
    # Each fence reaches the browser as a Mermaid block (not highlighted code).
    assert page.count('<pre class="mermaid">') == fences
    assert re.search(r'<script src="[./]*assets/javascripts/mermaid\.min\.js"', page)
    vendored = site / "assets" / "javascripts" / "mermaid.min.js"
    assert vendored.stat().st_size > 1_000_000
    assert "mermaid" in vendored.read_text(errors="replace")[:2000]
    # Nothing the page loads comes from another host (fonts included).
    external = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', page)
    assert not external, f"the lifecycle page loads {external}"


def test_quick_start_shows_the_readme_commands_and_example() -> None:
    readme = (ROOT / "README.md").read_text()
    quickstart = (DOCS / "quickstart.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2
    for command in commands:
        assert command in quickstart, f"docs/quickstart.md lacks the README's {command!r}"
    (example,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert example in quickstart


def test_readme_and_pages_do_not_send_readers_outside_the_repository() -> None:
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        text = path.read_text()
        assert "DESIGN.md" not in text, f"{path.relative_to(ROOT)} points at DESIGN.md"
        # A path of one machine (the traces' folder is found relative to the checkout).
        assert "/work/" not in text, f"{path.relative_to(ROOT)} names a path of one machine"


def nav_pages() -> list[str]:
    """Every page in mkdocs.yml's `nav`, as a path relative to docs/."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config.split("\nnav:\n", 1)[1]
    nav = nav.split("\n\n", 1)[0]
    return re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)$", nav, re.M)


def test_the_index_lists_every_page_of_the_nav() -> None:
    """docs/index.md's "The pages" table links every page of the site's nav (the
    index itself aside), and the nav holds every page of docs/."""
    pages = nav_pages()
    assert "index.md" in pages and "host-tier.md" in pages
    table = (DOCS / "index.md").read_text().split("## The pages", 1)[1]
    linked = set(re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", table))
    missing = [page for page in pages if page != "index.md" and page not in linked]
    assert not missing, f"docs/index.md's page table leaves out {missing}"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk == set(pages), f"pages outside the nav: {on_disk - set(pages)}"
