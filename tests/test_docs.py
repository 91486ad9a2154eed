"""The docs stay true: invariants listed with real tests, README and CI agree."""

from __future__ import annotations

import re
from pathlib import Path

from spec import invariants

ROOT = Path(__file__).resolve().parent.parent


def test_every_invariant_is_documented_with_existing_tests() -> None:
    text = (ROOT / "docs" / "invariants.md").read_text()
    for name, _ in invariants.INVARIANTS:
        assert f"`{name}`" in text, f"invariant {name} is not in docs/invariants.md"
    assert "`rollback`" in text
    references = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text)
    assert references
    for path, name in references:
        source = (ROOT / path).read_text()
        if name:
            assert re.search(rf"^(def|class) {name}\b|^{name} = ", source, re.M), (
                f"docs/invariants.md names {path}::{name}, which does not exist"
            )


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_commands = [b for b in blocks if "pytest" in b]
    assert len(test_commands) == 1
    command = test_commands[0].strip()
    ci_command = next(line for line in ci.splitlines() if "pytest" in line).strip()
    assert ci_command == command
    assert any("blocktrie replay" in b for b in blocks)


def test_readme_usage_example_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    namespace: dict[str, object] = {}
    exec(compile(code.replace("...", "pass"), "README.md", "exec"), namespace)
    trie = namespace["trie"]
    trie.check()  # type: ignore[attr-defined]
    assert trie.num_cached_blocks == 6  # type: ignore[attr-defined]
