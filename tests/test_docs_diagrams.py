"""The lifecycle diagrams of docs/lifecycle.md draw every state, at a readable size.

The static tests read what `spec.docgen` generates. The browser test renders the
committed page's diagrams with the vendored Mermaid in headless Chromium, in a
column as wide as the site's content at a 1280 px window, and reads the drawn
states and the scale back from the SVG; it skips where no Chromium is installed.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from spec import docgen
from spec.lifecycle import LIFECYCLES, Lifecycle

ROOT = Path(__file__).resolve().parent.parent
MERMAID = ROOT / "docs" / "assets" / "javascripts" / "mermaid.min.js"

COLUMN_PX = 688
"""Width of the site's content column (mkdocs-material) in a 1280 px window."""

_DECLARED = re.compile(r'^\s*state "([^"]*)" as (\S+)$', re.M)
_EDGE = re.compile(r"^\s*(\S+) --> (\S+)(?::.*)?$", re.M)
_NOTE = re.compile(r"^\s*note (?:left|right) of (\S+)$", re.M)


def _declared(diagram: str) -> dict[str, str]:
    """State name (the box's label) -> its Mermaid id."""
    return {label: state_id for label, state_id in _DECLARED.findall(diagram)}


@pytest.mark.parametrize("life", LIFECYCLES, ids=lambda life: life.name)
def test_every_state_is_declared_under_an_id_mermaid_does_not_keep(life: Lifecycle) -> None:
    # Mermaid's state diagrams use "root" as their top-level document's id: a
    # state declared under that id is never drawn (the node lifecycle's was not).
    declared = _declared(docgen._diagram(life))
    assert sorted(declared) == sorted(life.states)
    for state, state_id in declared.items():
        assert state_id == docgen.STATE_ID_PREFIX + state
    assert len(set(declared.values())) == len(declared)


@pytest.mark.parametrize("life", LIFECYCLES, ids=lambda life: life.name)
def test_every_state_is_on_an_edge_or_has_a_note(life: Lifecycle) -> None:
    diagram = docgen._diagram(life)
    ids = set(_declared(diagram).values())
    on_edges = {end for edge in _EDGE.findall(diagram) for end in edge} - {"[*]"}
    noted = set(_NOTE.findall(diagram))
    assert on_edges <= ids, f"an edge names an undeclared state: {on_edges - ids}"
    assert noted <= ids
    assert ids == on_edges | noted
    touched = {s for _, sources, dest in life.transitions for s in (*sources, dest)}
    isolated = {docgen.STATE_ID_PREFIX + s for s in life.states if s not in touched}
    assert noted == isolated
    assert diagram.count(docgen.ISOLATED_NOTE) == len(isolated)
    assert f"direction {docgen.DIRECTION}" in diagram


def test_the_node_lifecycle_draws_root_with_its_note() -> None:
    (node,) = (life for life in LIFECYCLES if life.name == "node")
    diagram = docgen._diagram(node)
    assert 'state "root" as s_root' in diagram
    assert f"note right of s_root\n    {docgen.ISOLATED_NOTE}\n  end note" in diagram


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_rendered_diagrams_draw_every_state_unscaled(tmp_path: Path) -> None:
    """Each diagram of the committed page, rendered by the vendored Mermaid in a
    688 px column: every state of its lifecycle is drawn, and the SVG fits the
    column at its natural size (Mermaid shrinks a wider one, labels included)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no headless Chromium installed (apt-get install chromium)")
    blocks = re.findall(r"```mermaid\n(.*?)```", (ROOT / "docs" / "lifecycle.md").read_text(), re.S)
    assert len(blocks) == len(LIFECYCLES)
    shutil.copy(MERMAID, tmp_path / "mermaid.min.js")
    diagrams = "\n".join(
        f'<div style="width:{COLUMN_PX}px"><pre class="mermaid">{html.escape(b)}</pre></div>'
        for b in blocks
    )
    page = tmp_path / "diagrams.html"
    page.write_text(
        f"""<html><body>{diagrams}
<script src="mermaid.min.js"></script>
<script>
mermaid.run().then(() => {{
  const drawn = [...document.querySelectorAll("pre.mermaid svg")].map(svg => ({{
    states: [...svg.querySelectorAll("g.statediagram-state .nodeLabel")].map(n => n.textContent),
    natural: svg.viewBox.baseVal.width,
    shown: svg.getBoundingClientRect().width,
  }}));
  document.body.setAttribute("data-drawn", JSON.stringify(drawn));
}}, err => document.body.setAttribute("data-drawn", JSON.stringify(String(err))));
</script></body></html>"""
    )
    result = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1280,4000",
            "--virtual-time-budget=20000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'data-drawn="([^"]*)"', result.stdout)
    assert found, f"Mermaid did not finish rendering:\n{result.stderr[-2000:]}"
    drawn = json.loads(html.unescape(found[1]))
    assert isinstance(drawn, list), f"Mermaid failed: {drawn}"
    assert len(drawn) == len(LIFECYCLES)
    for life, diagram in zip(LIFECYCLES, drawn, strict=True):
        assert sorted(diagram["states"]) == sorted(life.states), life.name
        scale = diagram["shown"] / diagram["natural"]
        assert scale > 0.99, (
            f"the {life.name} diagram is {diagram['natural']:.0f} px wide: shown at {scale:.2f}x"
        )
