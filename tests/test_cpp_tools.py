"""The native core's coverage and sanitizer tools (`tools.native_build`,
`tools.native_coverage`, `tools.native_sanitize`): their logic without a compiler,
and one end-to-end run of each over a tiny checkout (tests/cpp_project.py), skipped
where cmake, ninja or a C++ compiler is missing.

(Named ``test_cpp_*``, not ``test_native_*``: the tools run ``tests/test_native*.py``
themselves, and must not run their own tests.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cpp_project
from tools import native_build, native_coverage, native_sanitize
from tools.native_build import NativeToolError


def _git_checkout(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_native_sources_are_the_cpp_files_directly_in_native_src(tmp_path: Path) -> None:
    for name in ("a.cpp", "b.hpp", "c.h", "d.cc", "notes.md", "sub/e.cpp"):
        (tmp_path / "native/src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "native/src" / name).write_text("")
    assert native_build.native_sources(tmp_path) == [
        "native/src/a.cpp",
        "native/src/b.hpp",
        "native/src/c.h",
        "native/src/d.cc",
    ]
    assert native_build.native_sources(tmp_path / "none") == []
    assert "native/src/module.cpp" in native_build.native_sources()


def test_the_tree_is_the_checkouts_files_as_git_lists_them(tmp_path: Path) -> None:
    """Tracked and untracked files are copied, ignored ones are not; an unchanged
    file is not rewritten (ninja sees no change), a changed one is stamped now even
    when the checkout's copy is older (ninja rebuilds); a file the checkout lost
    goes; files the tree made itself stay."""
    root = _git_checkout(
        tmp_path / "root",
        {".gitignore": "build/\n*.so\n", "a.py": "a", "src/b.cpp": "b", "x.so": "binary"},
    )
    tree = tmp_path / "tree"
    assert native_build.sync_tree(root, tree) == [".gitignore", "a.py", "src/b.cpp"]
    assert not (tree / "x.so").exists()
    old = time.time() - 1000
    os.utime(tree / "a.py", (old, old))
    (tree / "made.so").write_text("the tree's own")
    (root / "src/b.cpp").write_text("b2")
    (root / "c.hpp").write_text("c")
    os.utime(root / "src/b.cpp", (old - 1000, old - 1000))  # older than the tree's copy
    assert native_build.sync_tree(root, tree) == ["c.hpp", "src/b.cpp"]
    assert (tree / "a.py").stat().st_mtime == old and (tree / "src/b.cpp").read_text() == "b2"
    assert (tree / "src/b.cpp").stat().st_mtime > old, "a file put back looks new to ninja"
    (root / "a.py").unlink()
    assert native_build.sync_tree(root, tree) == []
    assert not (tree / "a.py").exists() and (tree / "made.so").exists()


def test_selected_tests_expand_in_order_without_repeats(tmp_path: Path) -> None:
    for name in ("test_native_b.py", "test_native_a.py", "test_differential.py", "x.py"):
        (tmp_path / "tests").mkdir(exist_ok=True)
        (tmp_path / "tests" / name).write_text("")
    patterns = ["tests/test_native*.py", "tests/test_differential.py", "tests/test_native_a.py"]
    assert native_build.selected_tests(tmp_path, patterns) == [
        "tests/test_native_a.py",
        "tests/test_native_b.py",
        "tests/test_differential.py",
    ]
    with pytest.raises(NativeToolError, match="no test file matches"):
        native_build.selected_tests(tmp_path, ["tests/test_none*.py"])


def test_the_run_environment_imports_the_tree_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("BLOCKTRIE_TRACES_DIR", raising=False)
    env = native_build.run_env(tmp_path, {"CI": "false", "X": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/elsewhere"])
    assert env["BLOCKTRIE_BACKEND"] == "native" and env["CI"] == "false" and env["X"] == "1"
    assert env["BLOCKTRIE_TRACES_DIR"] == native_build.traces_dir()
    monkeypatch.setenv("BLOCKTRIE_TRACES_DIR", "/traces")
    assert native_build.run_env(tmp_path)["BLOCKTRIE_TRACES_DIR"] == "/traces"
    assert native_build.run_env(tmp_path)["CI"] == "true"


def test_run_captures_output_and_kills_a_command_past_its_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = native_build.run([sys.executable, "-c", "print('out'); exit(3)"], tmp_path)
    assert done.returncode == 3 and done.output == "out\n" and not done.ok
    shown = native_build.run([sys.executable, "-c", "print('shown')"], tmp_path, echo=True)
    assert shown.ok and capsys.readouterr().out == "shown\n"
    # The command's child (same process group) is killed too: the pipe closes.
    sleeper = "import subprocess, sys, time\n"
    sleeper += "subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    start = time.monotonic()
    late = native_build.run([sys.executable, "-c", sleeper], tmp_path, timeout=1)
    assert late.returncode is None and not late.ok and time.monotonic() - start < 30


def test_imported_module_names_the_file_the_tests_would_import(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache/__init__.py").write_text("")
    module = tmp_path / "cache/_native.py"
    module.write_text("")
    env = native_build.run_env(tmp_path)
    mapped = native_build.imported_module(tmp_path, env, module)
    assert isinstance(mapped, list)
    with pytest.raises(NativeToolError, match="not the build's"):
        native_build.imported_module(tmp_path, env, tmp_path / "cache/_native.cpython.so")
    module.write_text("raise ImportError('broken')")
    with pytest.raises(NativeToolError, match="does not import"):
        native_build.imported_module(tmp_path, env, module)


def test_install_replaces_any_other_module(tmp_path: Path) -> None:
    (tmp_path / "tree/cache").mkdir(parents=True)
    (tmp_path / "tree/cache/_native.cpython-310-x86_64-linux-gnu.so").write_text("old")
    built = tmp_path / "_native.cpython-311-x86_64-linux-gnu.so"
    built.write_text("new")
    installed = native_build.install_module(built, tmp_path / "tree")
    assert [p.name for p in (tmp_path / "tree/cache").iterdir()] == [built.name]
    assert installed.read_text() == "new"


# -- coverage ---------------------------------------------------------------------------


def test_coverage_reads_gcovrs_summary_for_the_native_sources_only() -> None:
    summary = {
        "files": [
            {"filename": "native/src/a.cpp", "line_covered": 9, "line_total": 10},
            {"filename": "native/src/b.hpp", "line_covered": 10, "line_total": 10},
        ]
    }
    sources = ["native/src/a.cpp", "native/src/b.hpp", "native/src/c.hpp"]
    got = native_coverage.read_summary(summary, sources)
    assert [(f.path, f.covered, f.total) for f in got.files] == [
        ("native/src/a.cpp", 9, 10),
        ("native/src/b.hpp", 10, 10),
    ]
    assert got.without_data == ["native/src/c.hpp"]
    assert got.percent == 95.0 and got.covered == 19 and got.total == 20
    assert native_coverage.Coverage().percent == 0.0  # nothing measured is not 100 %


def test_the_coverage_gate(capsys: pytest.CaptureFixture[str]) -> None:
    half = native_coverage.Coverage([native_coverage.FileCoverage("native/src/a.cpp", 19, 20)])
    assert native_coverage.report(half, 95.0, tests_passed=True)
    assert "19 / 20 = 95.0% (minimum 95%): ok" in capsys.readouterr().out
    assert not native_coverage.report(half, 95.1, tests_passed=True)
    assert not native_coverage.report(half, 50.0, tests_passed=False)
    assert "a test failed" in capsys.readouterr().out
    assert not native_coverage.report(native_coverage.Coverage(), 0.0, tests_passed=True)


def test_coverage_counters_are_cleared_and_gcovr_kept_to_native_src(tmp_path: Path) -> None:
    (tmp_path / "CMakeFiles/x.dir").mkdir(parents=True)
    (tmp_path / "CMakeFiles/x.dir/a.cpp.gcda").write_text("")
    (tmp_path / "CMakeFiles/x.dir/a.cpp.gcno").write_text("")
    assert native_coverage.zero_counters(tmp_path) == 1
    assert [p.name for p in (tmp_path / "CMakeFiles/x.dir").iterdir()] == ["a.cpp.gcno"]
    command = native_coverage.gcovr_command(tmp_path / "build", tmp_path, html=False)
    assert command[command.index("--filter") + 1] == "native/src/"
    assert command[command.index("--root") + 1] == "." and command[-1] == str(tmp_path / "build")
    assert "--merge-lines" in command  # a template's line counts once


def test_coverage_main_exits_0_1_or_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "coverage.txt").write_text("gcovr's report\n")
    result = native_coverage.Coverage([native_coverage.FileCoverage("native/src/a.cpp", 96, 100)])
    outcome: list[object] = [(result, True)]

    def measure(*args: object) -> object:
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    monkeypatch.setattr(native_coverage, "measure", measure)
    argv = ["--work-dir", str(tmp_path)]
    assert native_coverage.main(argv) == 0
    assert "gcovr's report" in capsys.readouterr().out
    assert native_coverage.main([*argv, "--min", "97"]) == 1
    outcome[0] = (result, False)
    assert native_coverage.main(argv) == 1
    outcome[0] = NativeToolError("no compiler")
    assert native_coverage.main(argv) == 2
    assert "native_coverage: no compiler" in capsys.readouterr().err


# -- sanitizers -------------------------------------------------------------------------


def test_the_sanitizer_environment_preloads_asan_and_lets_given_options_win(
    tmp_path: Path,
) -> None:
    given = {"ASAN_OPTIONS": "detect_leaks=1", "LD_PRELOAD": "/lib/other.so"}
    env = native_sanitize.sanitizer_env(["/lib/libasan.so", "/lib/libstdc++.so"], tmp_path, given)
    assert env["LD_PRELOAD"] == "/lib/libasan.so /lib/libstdc++.so /lib/other.so"
    asan = env["ASAN_OPTIONS"].split(":")
    assert asan[0] == "detect_leaks=0" and asan[-1] == "detect_leaks=1"
    assert f"log_path={tmp_path / 'asan'}" in asan
    assert env["UBSAN_OPTIONS"] == "halt_on_error=1:print_stacktrace=1"
    assert env["PYTHONMALLOC"] == "malloc"


def test_sanitizer_reports_are_read_from_files_and_output(tmp_path: Path) -> None:
    output = (
        "tests/test_x.py .\n"
        "/src/a.hpp:12:5: runtime error: signed integer overflow: 1 + 2147483647\n"
        "    #0 0x7f in add /src/a.hpp:12\n"
        "    #1 0x7f in main\n"
        "E   RuntimeError: runtime error: not a sanitizer's\n"
    )
    (report,) = native_sanitize.ubsan_reports(output)
    assert report.splitlines()[0].endswith("signed integer overflow: 1 + 2147483647")
    assert len(report.splitlines()) == 3
    assert native_sanitize.ubsan_reports("all passed\n") == []
    assert native_sanitize.asan_reports(tmp_path / "none") == []
    (tmp_path / "asan.123").write_text("==123==ERROR: AddressSanitizer: heap-buffer-overflow\n")
    (found,) = native_sanitize.asan_reports(tmp_path)
    assert "heap-buffer-overflow" in found and "asan.123" in found


def test_the_compiler_is_read_from_cmakes_cache(tmp_path: Path) -> None:
    (tmp_path / "CMakeCache.txt").write_text(
        "X:BOOL=ON\nCMAKE_CXX_COMPILER:FILEPATH=/usr/bin/g++\n"
    )
    assert native_sanitize.compiler(tmp_path) == "/usr/bin/g++"
    (tmp_path / "CMakeCache.txt").write_text("X:BOOL=ON\n")
    with pytest.raises(NativeToolError, match="no C\\+\\+ compiler"):
        native_sanitize.compiler(tmp_path)


def test_sanitize_main_is_clean_only_with_passing_tests_and_no_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome: list[object] = [(True, [])]

    def check(*args: object) -> object:
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    monkeypatch.setattr(native_sanitize, "check", check)
    assert native_sanitize.main([]) == 0
    assert capsys.readouterr().out.endswith("native_sanitize: clean\n")
    outcome[0] = (True, ["==1==ERROR: AddressSanitizer: heap-use-after-free"])
    assert native_sanitize.main([]) == 1
    assert "heap-use-after-free" in capsys.readouterr().out
    outcome[0] = (False, [])
    assert native_sanitize.main([]) == 1
    outcome[0] = NativeToolError("the build failed")
    assert native_sanitize.main([]) == 2


# -- end to end -------------------------------------------------------------------------

needs_compiler = pytest.mark.skipif(
    cpp_project.tools_found() is not None, reason=f"{cpp_project.tools_found()}"
)


@needs_compiler
def test_coverage_end_to_end(tmp_path: Path) -> None:
    """The instrumented module is the one the tests import; `twice` is never called,
    so its header is not fully covered; the checkout is not written."""
    root = cpp_project.make_project(tmp_path / "root")
    before = cpp_project.snapshot(root)
    coverage, passed = native_coverage.measure(
        root, tmp_path / "work", ["tests/test_native*.py"], echo=False
    )
    assert passed
    by_path = {f.path: f for f in coverage.files}
    assert set(by_path) == {"native/src/arith.hpp", "native/src/module.cpp"}
    arith = by_path["native/src/arith.hpp"]
    assert arith.total == 2 and arith.covered == 1  # sub ran, twice did not
    assert 50.0 < coverage.percent < 100.0
    assert json.loads((tmp_path / "work/coverage.json").read_text())["files"]
    assert cpp_project.snapshot(root) == before


@needs_compiler
def test_sanitize_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clean when the code is; a heap read past the end is reported, and fails."""
    root = cpp_project.make_project(tmp_path / "root")
    work, tests = tmp_path / "work", ["tests/test_native*.py"]
    try:
        passed, found = native_sanitize.check(root, work, tests, echo=False)
    except NativeToolError as exc:
        if "has no libasan.so" in str(exc):
            pytest.skip(str(exc))
        raise
    assert passed and found == []
    monkeypatch.setenv("READ_AT", "4")
    passed, found = native_sanitize.check(root, work, tests, echo=False)
    assert not passed
    assert any("AddressSanitizer: heap-buffer-overflow" in report for report in found)
