"""The docs stay true: invariants listed with real tests, README and CI agree."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from spec import invariants
from tests.helpers import python_without

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
    for page in ("quickstart.md", "testing.md"):
        text = (ROOT / "docs" / page).read_text()
        shown = [b.strip() for b in re.findall(r"```bash\n(.*?)\n```", text, re.S) if "pytest" in b]
        assert shown == [command], f"docs/{page} shows {shown}, not the README's test command"


def test_readme_usage_example_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    namespace: dict[str, object] = {}
    exec(compile(code.replace("...", "pass"), "README.md", "exec"), namespace)
    trie = namespace["trie"]
    trie.check()  # type: ignore[attr-defined]
    assert trie.num_cached_blocks == 6  # type: ignore[attr-defined]


def _readme_setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, re.S)


def _readme_usage() -> str:
    readme = (ROOT / "README.md").read_text()
    usage = readme.split("## Usage", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", usage, re.S)
    return str(code)


def _distributions(project: str, extras: Iterable[str]) -> set[str]:
    """The installed distributions `pip install 'project[extras]'` brings in: `project`'s
    requirements for those extras, and theirs, transitively (canonical names)."""
    found: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(project, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # an optional dependency that is not installed here
        for line in requirements:
            requirement = Requirement(line)
            if requirement.marker is not None and not any(
                requirement.marker.evaluate({"extra": extra}) for extra in (*wanted, "")
            ):
                continue
            dependency = canonicalize_name(requirement.name)
            if dependency != canonicalize_name(project):  # `dev` requires `blocktrie[test]`
                found.add(dependency)
            todo.append((dependency, frozenset(requirement.extras)))
    return found


def test_readme_usage_runs_after_the_first_command_alone() -> None:
    """A newcomer's path: the README's first command, then its Usage snippet. The
    snippet runs in a fresh interpreter where every package that only the other
    extras bring in cannot be imported."""
    first = _readme_setup_commands()[0]
    assert "blocktrie replay" in first
    (extras,) = re.findall(r"-e '\.\[([\w,]*)\]'", first)
    installed = _distributions("blocktrie", extras.split(","))
    every_extra = metadata.metadata("blocktrie").get_all("Provides-Extra") or []
    others = _distributions("blocktrie", every_extra) - installed
    assert {"pyzmq", "msgspec", "xxhash"} <= others  # the events extra's, for one
    modules = metadata.packages_distributions()
    blocked = sorted(  # (a backport that names a standard module is not what provides it)
        module
        for module, dists in modules.items()
        if module.isidentifier()
        and module not in sys.stdlib_module_names
        and all(canonicalize_name(d) in others for d in dists)
    )
    assert "zmq" in blocked and "msgspec" in blocked
    code = _readme_usage() + "\ntrie.check()\nprint(trie.num_cached_blocks)\n"
    proc = python_without(blocked, code)
    assert proc.returncode == 0, f"the README's Usage fails after its first command:\n{proc.stderr}"
    assert proc.stdout.split() == ["6"]


def test_the_usage_comments_name_the_snippets_variables() -> None:
    """A comment that names a variable (`prompt[...]`, `seq.block_ids`) names one the
    snippet defines."""
    code = _readme_usage()
    defined = set(re.findall(r"^(\w+) = ", code, re.M)) | {"torch", "BlockTrie", "CacheConfig"}
    comments = re.findall(r"#(.*)$", code, re.M)
    # `name[` or `name.attribute`, two characters or more (not "e.g.")
    subscripted = r"\b([A-Za-z_]\w+)(?:\[|\.[A-Za-z_]\w)"
    named = {m for c in comments for m in re.findall(subscripted, c)}
    assert named, "no comment names a variable"
    assert named <= defined, f"comments name {named - defined}, which the snippet does not define"


_RULE_DEFINED = re.compile(r"^\*\*\[R(\d+)\]\*\*", re.M)
_RULE_CITED = re.compile(r"\[R(\d+)\]")


def _cited_rules(*roots: Path) -> dict[int, list[str]]:
    cited: dict[int, list[str]] = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in files:
            for number in _RULE_CITED.findall(path.read_text()):
                cited.setdefault(int(number), []).append(str(path.relative_to(ROOT)))
    return cited


def _defined_rules() -> list[int]:
    return [int(n) for n in _RULE_DEFINED.findall((ROOT / "docs" / "semantics.md").read_text())]


def test_operation_rules_are_numbered_once_and_every_one_is_cited() -> None:
    """docs/semantics.md numbers each rule once; code cites `[R<n>]`: no citation
    may name a rule that does not exist, and no rule may go uncited."""
    text = (ROOT / "docs" / "semantics.md").read_text()
    defined = _defined_rules()
    assert defined, "docs/semantics.md defines no numbered rule"
    assert len(defined) == len(set(defined)), "a rule number is defined twice"
    assert defined == list(range(1, len(defined) + 1)), "rule numbers must run 1..n in order"
    in_docs = {int(n) for n in _RULE_CITED.findall(text)}
    assert in_docs <= set(defined), (
        f"semantics.md refers to undefined rules {in_docs - set(defined)}"
    )
    cited = _cited_rules(ROOT / "cache", ROOT / "spec")
    unknown = {n: where for n, where in cited.items() if n not in defined}
    assert not unknown, f"code cites rules that docs/semantics.md does not define: {unknown}"
    uncited = [n for n in defined if n not in cited]
    assert not uncited, f"rules no code cites: {uncited}"


def test_both_implementations_cite_the_shared_rules() -> None:
    """The reference model and the cache each cite every rule they both implement."""
    cache_rules = set(_cited_rules(ROOT / "cache"))
    model_rules = set(_cited_rules(ROOT / "spec" / "model.py"))
    # Rules only the cache has: the model has no clear(), no copy that fails
    # when queued, no threads (45, 58), no device streams (59), no tensors (60) and
    # no block hashes (61).
    cache_only = {22, 38, 45, 58, 59, 60, 61}
    defined = set(_defined_rules())
    assert cache_only <= defined
    missing_in_model = sorted(defined - model_rules - cache_only)
    assert not missing_in_model, f"spec/model.py cites none of rules {missing_in_model}"
    missing_in_cache = sorted(defined - cache_rules)
    assert not missing_in_cache, f"cache/ cites none of rules {missing_in_cache}"


def test_core_has_no_lifecycle_literals() -> None:
    """Lifecycle states and triggers are named through the spec's enums in cache/:
    a quoted state or trigger name would be a rule restated outside the spec.
    (Attribute names listed in `__slots__` are names, not literals.)"""
    import ast

    from spec.lifecycle import LIFECYCLES

    names = {s for life in LIFECYCLES for s in (*life.states, *life.triggers)}
    offenders = []
    for path in sorted((ROOT / "cache").glob("*.py")):
        tree = ast.parse(path.read_text())
        slots: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                slots.update(id(c) for c in ast.walk(node.value))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in names
                and id(node) not in slots
            ):
                offenders.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not offenders, "lifecycle literals in cache/:\n" + "\n".join(offenders)


def test_every_core_module_is_in_the_ownership_map() -> None:
    """docs/architecture.md's ownership map names every module of the core."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Ownership map", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+\.py)`", table))
    modules = {p.name for p in (ROOT / "cache").glob("*.py")} - {"__init__.py"}
    assert modules - named == set(), "not in the ownership map"
    assert named - modules == set(), "in the ownership map, but no such module"


def line_counts(path: Path) -> dict[str, int]:
    """`path`'s lines: all, code, docstrings (every string statement) and the rest."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    lines = source.splitlines()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docstrings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    comments = {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip().startswith("#")
    }
    blank = {i for i, line in enumerate(lines, 1) if not line.strip()}
    rest = len(docstrings | comments | blank)
    return {
        "lines": len(lines),
        "code": len(lines) - rest,
        "docstrings": len(docstrings),
        "blank or comments": len(comments | blank),
    }


def test_trie_module_states_its_true_size() -> None:
    """cache/trie.py's docstring gives its size ("about N lines: C of code, D of
    docstrings, E blank or comments"); each figure within 10% of the count."""
    import cache.trie

    stated = re.search(
        r"about (\d+)\s+lines: (\d+) of code, (\d+) of docstrings, (\d+) blank or comments",
        " ".join((cache.trie.__doc__ or "").split()),
    )
    assert stated, "cache/trie.py's docstring no longer states its size"
    counted = line_counts(ROOT / "cache" / "trie.py")
    names = ["lines", "code", "docstrings", "blank or comments"]
    claims = dict(zip(names, stated.groups(), strict=True))
    for what, figure in claims.items():
        assert abs(int(figure) - counted[what]) <= counted[what] // 10, (
            f"cache/trie.py's docstring says about {figure} {what}; it has {counted[what]}"
        )
