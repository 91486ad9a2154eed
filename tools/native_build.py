"""What the native core's assurance tools share: a private copy of the checkout, a
CMake build of it, and a pytest run that imports that build's ``cache._native``.

Used by `tools.native_coverage`, `tools.native_sanitize` and
`tools.native_mutation` (docs/testing.md, "The native core's assurance").

**Why a copy.** ``cache._native`` is looked up inside the ``cache`` package, so the
module a test imports is the ``_native*.so`` in the ``cache/`` folder of the tree
the tests run in; no ``PYTHONPATH`` order can put a second ``cache/_native`` under
the checkout's ``cache``. Copying an instrumented module into the checkout's own
``cache/`` would replace the developer's module, and leave the instrumented one
there when a run is killed. So each tool keeps its own copy of the checkout (the
*tree*: the files git lists, tracked and untracked-but-not-ignored, as they are in
the working tree) in its build folder, builds the module from the tree, installs
it into the tree's ``cache/``, and runs pytest from the tree with
``PYTHONPATH=<tree>`` (so that subprocesses the tests start import it too). Before
any test runs, `imported_module` checks in a fresh interpreter with the run's
environment that ``cache._native`` resolves to the installed file. The checkout is
only ever read. `sync_tree` rewrites only the files whose bytes differ (keeping
their modification times), so ninja rebuilds only what changed.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SOURCE_DIR = "native/src"
SOURCE_PATTERNS = ("*.cpp", "*.cc", "*.hpp", "*.h")
"""The native core's sources: every file of these kinds directly in `SOURCE_DIR`."""

DEFAULT_TESTS = ("tests/test_native*.py", "tests/test_differential.py")
"""The tests that exercise the native core, fastest first (`selected_tests` expands them)."""

MANIFEST = ".synced-files"
"""The tree's list of the files `sync_tree` copied into it (to remove the ones the
checkout no longer has)."""


class NativeToolError(Exception):
    """A step of a tool could not be done (no compiler, a failed configure or build,
    the wrong module imported): the message says which, with the output's tail."""


@dataclass(frozen=True)
class Ran:
    """One command's outcome: its exit status (None when it ran past its time limit
    and was killed), its output (stdout and stderr), and its wall time."""

    returncode: int | None
    output: str
    seconds: float

    @property
    def ok(self) -> bool:
        """Exited 0 within its time limit."""
        return self.returncode == 0


def run(
    command: Sequence[str],
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    echo: bool = False,
) -> Ran:
    """Run `command` in its own process group, its stdout and stderr captured
    together (and, with `echo`, also written to this process's stdout as they come);
    past `timeout` seconds the whole group is killed (a test that forks, a hung
    build) and the result's returncode is None."""
    start = time.monotonic()
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=dict(env) if env is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    code: int | None
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = None
    except BaseException:  # KeyboardInterrupt: leave nothing running
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    reader.join(timeout=10)  # a process that escaped the group may hold the pipe
    return Ran(code, "".join(lines), time.monotonic() - start)


def tail(text: str, lines: int = 40) -> str:
    """The last `lines` lines of `text`."""
    return "\n".join(text.splitlines()[-lines:])


def native_sources(root: Path = ROOT) -> list[str]:
    """The native core's source files (`SOURCE_PATTERNS` in `SOURCE_DIR`), as sorted
    paths relative to `root`."""
    found = {
        path.relative_to(root).as_posix()
        for pattern in SOURCE_PATTERNS
        for path in (root / SOURCE_DIR).glob(pattern)
        if path.is_file()
    }
    return sorted(found)


def checkout_files(root: Path = ROOT) -> list[str]:
    """The files of the checkout as git sees them: tracked and untracked-but-not-
    ignored, those that exist in the working tree (sorted, relative to `root`)."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root)
    if not listed.ok:
        raise NativeToolError(f"git ls-files failed in {root}:\n{tail(listed.output)}")
    names = {name for name in listed.output.split("\0") if name}
    return sorted(name for name in names if (root / name).is_file())


def sync_tree(root: Path, tree: Path) -> list[str]:
    """Make `tree` a copy of `root`'s `checkout_files`: copy each file whose bytes
    differ, stamped now (not with the checkout's modification time: a file put back
    after a killed mutation run must look newer than the mutant's build outputs, or
    ninja keeps the mutant's module), and remove the files a previous sync copied
    that the checkout no longer has. Files the tree made itself (the installed
    module, caches) are left alone. Returns the files copied."""
    files = checkout_files(root)
    tree.mkdir(parents=True, exist_ok=True)
    manifest = tree / MANIFEST
    before = set(manifest.read_text().splitlines()) if manifest.exists() else set()
    copied = []
    for name in files:
        source, target = root / name, tree / name
        if target.is_file() and target.read_bytes() == source.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        shutil.copymode(source, target)
        copied.append(name)
    for name in sorted(before - set(files)):
        (tree / name).unlink(missing_ok=True)
    manifest.write_text("".join(f"{name}\n" for name in files))
    return copied


def cxx_compiler_found() -> bool:
    """Whether cmake, ninja and a C++ compiler are on PATH (the tools need all three)."""
    compiler = os.environ.get("CXX") or "c++"
    return all(shutil.which(tool) for tool in ("cmake", "ninja", compiler))


def configure(
    tree: Path,
    build_dir: Path,
    build_type: str,
    options: Mapping[str, str],
) -> None:
    """``cmake -S tree -B build_dir -G Ninja`` with `build_type` and the ``-D``
    `options` (re-running it on an existing build folder only applies changes)."""
    command = ["cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja"]
    command.append(f"-DCMAKE_BUILD_TYPE={build_type}")
    command += [f"-D{name}={value}" for name, value in sorted(options.items())]
    done = run(command, cwd=tree)
    if not done.ok:
        raise NativeToolError(f"cmake configure failed:\n{tail(done.output)}")


def build(build_dir: Path, timeout: float | None = None) -> Ran:
    """``cmake --build build_dir`` (ninja, incremental), its output captured."""
    return run(["cmake", "--build", str(build_dir)], cwd=build_dir, timeout=timeout)


def built_module(build_dir: Path) -> Path:
    """The ``_native*.so`` the build made (exactly one is expected)."""
    found = sorted(build_dir.glob("_native*.so")) + sorted(build_dir.glob("_native*.pyd"))
    if len(found) != 1:
        raise NativeToolError(f"expected one _native module in {build_dir}, found {found}")
    return found[0]


def build_module(
    root: Path,
    work: Path,
    build_type: str,
    options: Mapping[str, str],
) -> tuple[Path, Path]:
    """Sync the tree (``work/tree``) from `root`, configure and build it in
    ``work/build`` (`build_type`, the ``-D`` `options`), install the module into the
    tree's ``cache/``; returns the tree and the installed module. Raises
    `NativeToolError` when a step fails."""
    if not cxx_compiler_found():
        raise NativeToolError("cmake, ninja and a C++ compiler are needed (none found on PATH)")
    tree, build_dir = work / "tree", work / "build"
    sync_tree(root, tree)
    configure(tree, build_dir, build_type, options)
    done = build(build_dir)
    if not done.ok:
        raise NativeToolError(f"the build failed:\n{tail(done.output)}")
    return tree, install_module(built_module(build_dir), tree)


def install_module(module: Path, tree: Path) -> Path:
    """Copy `module` into the tree's ``cache/`` in place of any other ``_native``."""
    package = tree / "cache"
    for old in [*package.glob("_native*.so"), *package.glob("_native*.pyd")]:
        old.unlink()
    target = package / module.name
    shutil.copy2(module, target)
    return target


def traces_dir() -> str:
    """Where the tests read the public traces (the checkout's setting, `bench`'s rule):
    the tree lives elsewhere, so it is passed on explicitly."""
    from bench import default_traces_dir

    return str(default_traces_dir())


def run_env(tree: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the tools run tests in: this one, with the tree first on
    ``PYTHONPATH`` (subprocesses import the tree's packages too), ``CI=true`` (the
    derandomized Hypothesis profile), ``BLOCKTRIE_BACKEND=native``, the checkout's
    traces folder, and `extra` over all of it."""
    env = dict(os.environ)
    path = [str(tree), *filter(None, [env.get("PYTHONPATH")])]
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        CI="true",
        BLOCKTRIE_BACKEND="native",
        BLOCKTRIE_TRACES_DIR=env.get("BLOCKTRIE_TRACES_DIR") or traces_dir(),
    )
    env.update(extra or {})
    return env


_WHICH = """
import cache._native
print("module:", cache._native.__file__)
try:
    with open("/proc/self/maps") as maps:
        print("mapped:", *sorted({line.split()[-1] for line in maps if ".so" in line}))
except OSError:  # not Linux
    print("mapped:")
"""


def imported_module(tree: Path, env: Mapping[str, str], expected: Path) -> list[str]:
    """Check, in a fresh interpreter started like the tests (`env`, from `tree`),
    that ``cache._native`` is `expected`; returns the shared libraries that process
    has mapped (to check that a sanitizer runtime is loaded). Raises
    `NativeToolError` when the import fails or finds another file."""
    done = run([sys.executable, "-c", _WHICH], cwd=tree, env=env, timeout=300)
    said = dict(line.partition(": ")[::2] for line in done.output.splitlines() if ": " in line)
    if not done.ok or "module" not in said:
        raise NativeToolError(f"cache._native does not import from {tree}:\n{tail(done.output)}")
    found = Path(said["module"])
    if found.resolve() != expected.resolve():
        raise NativeToolError(f"the tests would import {found}, not the build's {expected}")
    return said.get("mapped", "").split()


def selected_tests(tree: Path, patterns: Sequence[str]) -> list[str]:
    """`patterns` (globs relative to `tree`) expanded, each one's matches sorted, in
    the patterns' order, without repeats."""
    found: list[str] = []
    for pattern in patterns:
        for match in sorted(glob.glob(pattern, root_dir=tree)):
            if match not in found:
                found.append(match)
    if not found:
        raise NativeToolError(f"no test file matches {list(patterns)} in {tree}")
    return found


def pytest_command(tests: Sequence[str], args: Sequence[str] = ()) -> list[str]:
    """The pytest command line the tools run (no cache folder, quiet)."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *tests]


def add_run_arguments(parser: argparse.ArgumentParser, work: Path) -> None:
    """The options every tool takes: ``--tests`` (default `DEFAULT_TESTS`),
    ``--pytest-arg`` (repeatable) and ``--work-dir`` (default `work`)."""
    parser.add_argument(
        "--tests",
        nargs="+",
        default=list(DEFAULT_TESTS),
        help="test files or globs, relative to the checkout, run in this order",
    )
    parser.add_argument(
        "--pytest-arg", action="append", default=[], help="one more pytest argument (repeatable)"
    )
    parser.add_argument("--work-dir", type=Path, default=work, help="build folder and tree")
