"""Packaging: what an installed package does and ships (license, docgen outside a checkout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spec import docgen

ROOT = Path(__file__).resolve().parent.parent


def test_docgen_refuses_to_write_outside_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Installed (no pyproject.toml beside spec/): no default path, so nothing in site-packages."""
    assert docgen.in_checkout()
    assert not docgen.in_checkout(tmp_path)
    monkeypatch.setattr(docgen, "in_checkout", lambda root=tmp_path: False)
    before = docgen.DEFAULT_PATH.read_text()
    with pytest.raises(SystemExit) as info:
        docgen.main([])
    assert info.value.code == 2
    assert "--path" in capsys.readouterr().err
    assert docgen.DEFAULT_PATH.read_text() == before
    out = tmp_path / "lifecycle.md"
    assert docgen.main(["--path", str(out)]) == 0 and out.read_text() == docgen.render()


def test_license_file_and_spdx_expression() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # SPDX string form (PEP 639), not a table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
