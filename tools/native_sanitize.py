"""The native core under AddressSanitizer and UndefinedBehaviorSanitizer:
``python -m tools.native_sanitize``.

Builds ``cache._native`` with ``BLOCKTRIE_SANITIZE=ON`` (``-fsanitize=address,undefined
-fno-sanitize-recover=undefined``) in ``build/native-sanitize/`` from a copy of the
checkout (`tools.native_build`), ``Debug`` by default (``-O0``: nothing optimized
away, ``assert`` on), and runs the tests that exercise the native core (default
``tests/test_native*.py tests/test_differential.py``, ``BLOCKTRIE_BACKEND=native``,
``CI=true``) with:

- ``LD_PRELOAD=<the compiler's libasan.so> <its libstdc++.so>``: the interpreter
  is not instrumented, and ASan's runtime must be loaded before anything else;
  the C++ runtime with it, because ASan finds the functions it intercepts when it
  starts, and the interpreter does not load libstdc++ (without it, the first C++
  exception thrown ends the process in ASan's ``__cxa_throw`` interceptor);
- ``ASAN_OPTIONS=detect_leaks=0``: CPython keeps objects alive until exit by
  design, and LeakSanitizer would report them; the module's own leaks are
  nanobind's checker's (``tests/test_native_leaks.py``);
- ``UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1``: undefined behaviour stops
  the run, with its stack;
- ``PYTHONMALLOC=malloc``: Python objects come from ``malloc``, so ASan also sees
  the buffers of the Python objects the bindings read and write (pymalloc's arenas
  would hide an overflow inside them).

A sanitizer ends the process at its first error, and pytest's captured output of
that process would be lost: so ASan writes its reports to files (``log_path``)
under the build folder, and pytest runs with ``--capture=sys`` (the tests' Python
output is captured as usual, what C code writes to the process's stderr is not)
for UBSan's, which go to stderr whatever ``log_path`` says when ASan shares the
process (GCC 12): the tool reads them from the run's output. Clean means the tests
passed and no sanitizer reported anything: exit 0. Otherwise the reports are
printed and it exits 1 (2 when it could not run: no compiler, a failed build, the
sanitizer runtimes not loaded). ``ASAN_OPTIONS``/``UBSAN_OPTIONS`` already set are
appended (they win).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tools import native_build
from tools.native_build import ROOT, NativeToolError

WORK = ROOT / "build" / "native-sanitize"

ASAN_OPTIONS = ("detect_leaks=0", "abort_on_error=0")
UBSAN_OPTIONS = ("halt_on_error=1", "print_stacktrace=1")
RUNTIMES = ("libasan", "libubsan")
"""The sanitizer runtimes a process that loaded the module must have mapped."""


def compiler(build_dir: Path) -> str:
    """The C++ compiler CMake chose for `build_dir` (from its cache)."""
    for line in (build_dir / "CMakeCache.txt").read_text().splitlines():
        if line.startswith("CMAKE_CXX_COMPILER:"):
            return line.partition("=")[2]
    raise NativeToolError(f"no C++ compiler in {build_dir / 'CMakeCache.txt'}")


PRELOADED = ("libasan.so", "libstdc++.so")
"""The libraries loaded before the interpreter: ASan's runtime, then the C++ runtime
(see the module's doc)."""


def library(cxx: str, name: str) -> str:
    """The real file of `cxx`'s library `name` (``-print-file-name``, links followed)."""
    done = native_build.run([cxx, f"-print-file-name={name}"], cwd=Path.cwd())
    path = done.output.strip()
    if not done.ok or not os.path.isabs(path) or not os.path.exists(path):
        raise NativeToolError(f"{cxx} has no {name}: {path!r}")
    return str(Path(path).resolve())


def sanitizer_env(
    preload: Sequence[str], logs: Path, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables that run Python with the sanitized module (see the module's
    doc): `preload` first in ``LD_PRELOAD``; ASan's reports go to
    ``logs/asan.<pid>``. Options already in `environ` (default: this process's)
    come after the tool's, so they win."""
    environ = os.environ if environ is None else environ

    def options(name: str, ours: Sequence[str]) -> str:
        given = [environ[name]] if environ.get(name) else []
        return ":".join([*ours, *given])

    return {
        "LD_PRELOAD": " ".join([*preload, *filter(None, [environ.get("LD_PRELOAD")])]),
        "ASAN_OPTIONS": options("ASAN_OPTIONS", (*ASAN_OPTIONS, f"log_path={logs / 'asan'}")),
        "UBSAN_OPTIONS": options("UBSAN_OPTIONS", UBSAN_OPTIONS),
        "PYTHONMALLOC": "malloc",
    }


UBSAN_REPORT = re.compile(r"^\S+:\d+:\d+: runtime error: ")
"""The first line of an UndefinedBehaviorSanitizer report (``file:line:col: runtime
error: ...``); its stack follows, one ``#N`` frame a line."""


def ubsan_reports(output: str) -> list[str]:
    """Each UBSan report in a run's output: its first line and its stack."""
    found: list[list[str]] = []
    for line in output.splitlines():
        if UBSAN_REPORT.match(line):
            found.append([line])
        elif found and line.lstrip().startswith("#") and len(found[-1]) < 40:
            found[-1].append(line)
    return ["\n".join(report) for report in found]


def asan_reports(logs: Path) -> list[str]:
    """The reports ASan wrote under `logs` (one file a process), in file order."""
    files = sorted(p for p in logs.glob("asan.*") if p.is_file()) if logs.is_dir() else []
    return [f"{p}:\n{p.read_text().rstrip()}" for p in files]


def check(
    root: Path,
    work: Path,
    tests: Sequence[str],
    pytest_args: Sequence[str] = (),
    build_type: str = "Debug",
    echo: bool = True,
) -> tuple[bool, list[str]]:
    """Build, run the tests under the sanitizers; returns whether the tests passed
    and the sanitizers' reports. Raises `NativeToolError` when a step fails."""
    options = {"BLOCKTRIE_SANITIZE": "ON", "BLOCKTRIE_COVERAGE": "OFF"}
    tree, module = native_build.build_module(root, work, build_type, options)
    logs = work / "reports"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    cxx = compiler(work / "build")
    preload = [library(cxx, name) for name in PRELOADED]
    env = native_build.run_env(tree, sanitizer_env(preload, logs))
    try:
        mapped = native_build.imported_module(tree, env, module)
    except NativeToolError as exc:  # importing the module may itself be what goes wrong
        found = asan_reports(logs) + ubsan_reports(str(exc))
        if found:
            return False, found
        raise
    missing = [lib for lib in RUNTIMES if not any(Path(m).name.startswith(lib) for m in mapped)]
    if missing:
        raise NativeToolError(f"the module loaded without {missing}: is it the sanitized build?")
    selected = native_build.selected_tests(tree, tests)
    print(f"native_sanitize: running {' '.join(selected)} under ASan + UBSan", flush=True)
    command = native_build.pytest_command(selected, ["--capture=sys", *pytest_args])
    ran = native_build.run(command, tree, env, echo=echo)
    return ran.ok, asan_reports(logs) + ubsan_reports(ran.output)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the native core's tests under ASan + UBSan; exit 0 when clean."""
    parser = argparse.ArgumentParser(prog="python -m tools.native_sanitize", description=__doc__)
    native_build.add_run_arguments(parser, WORK)
    parser.add_argument("--build-type", default="Debug", help="CMAKE_BUILD_TYPE (default Debug)")
    args = parser.parse_args(argv)
    try:
        passed, found = check(ROOT, args.work_dir, args.tests, args.pytest_arg, args.build_type)
    except NativeToolError as exc:
        print(f"native_sanitize: {exc}", file=sys.stderr)
        return 2
    for report in found:
        print(f"--- sanitizer report\n{report}")
    clean = passed and not found
    verdict = "clean" if clean else f"NOT clean ({len(found)} report(s), tests passed: {passed})"
    print(f"native_sanitize: {verdict}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
