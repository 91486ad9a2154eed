"""Packaging: what an installed package does and ships (license, docgen outside a
checkout), and how it builds (issue 47): the sdist carries the native core's sources,
a wheel carries the native core where a C++ toolchain is, and without one (or with
`BLOCKTRIE_NATIVE=OFF`) the build still succeeds, with the Python backend only.

The tests that build wheels are marked `slow` (tens of seconds on 2 cores); CI runs
them once, in the README's test command."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from spec import docgen

ROOT = Path(__file__).resolve().parent.parent

CMAKE_FALSE = {"", "0", "OFF", "NO", "FALSE", "N", "IGNORE", "NOTFOUND"}
"""The values CMake reads as false (an opt-out given as `BLOCKTRIE_NATIVE=<value>`)."""

DEV_BUILD = (
    "cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build/dev"
    " && cmake --install build/dev --prefix ."
)
"""Builds a checkout's own native core into its `cache/` (docs/testing.md)."""


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


def _run(
    command: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`command` in `cwd`, with this environment less any `BLOCKTRIE_NATIVE` opt-out, plus `env`."""
    environ = {k: v for k, v in os.environ.items() if k != "BLOCKTRIE_NATIVE"}
    environ.update(env or {})
    return subprocess.run(
        command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600, check=False
    )


def _compiler() -> str | None:
    """The C++ compiler CMake would try first (`$CXX`, else `c++`), if it is on this machine."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _needs_cmake() -> None:
    if shutil.which("cmake") is None:
        pytest.skip("no cmake on this machine (pip's isolated build brings its own)")


def _needs_build_backend() -> None:
    """The build backend and its requirements, importable here (the `test` extra)."""
    for module in ("scikit_build_core", "nanobind", "setuptools"):
        pytest.importorskip(module, reason=f"{module} (the `test` extra) builds the wheels")
    _needs_cmake()


def _without_a_native_core(output: str) -> str | None:
    """Why CMakeLists.txt built no native core, from its warning in `output`, or None."""
    flat = " ".join(output.split())
    start = flat.find("no native core built (")
    if start < 0:
        return None
    return flat[start + len("no native core built (") :].split("); ", 1)[0]


def _package_files(root: Path) -> set[str]:
    """The files the wheel's packages ship: every module of `cache` and `spec`, and py.typed."""
    return {
        path.relative_to(root).as_posix()
        for package in ("cache", "spec")
        for path in (root / package).rglob("*")
        if path.is_file()
        and (path.suffix == ".py" or path.name == "py.typed")
        and "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout's files as git sees them (tracked, or new and not ignored):
    a fresh clone's, so that nothing built here (a `cache/_native*.so`, `build/`) leaks in."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT)
    assert listed.returncode == 0, listed.stderr
    copy = tmp_path_factory.mktemp("checkout")
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is listed too
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


@pytest.fixture(scope="module")
def sdist(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, built by the backend pyproject.toml names (as `python -m build --sdist`
    would, without fetching anything)."""
    _needs_build_backend()
    tomllib = pytest.importorskip("tomllib")
    backend = tomllib.loads((checkout / "pyproject.toml").read_text())["build-system"]
    out = tmp_path_factory.mktemp("sdist")
    code = "import importlib, sys\nbackend = importlib.import_module(sys.argv[1])\n"
    code += "print(backend.build_sdist(sys.argv[2]))"
    proc = _run([sys.executable, "-c", code, backend["build-backend"], str(out)], checkout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / proc.stdout.split()[-1]


def _pip_wheel(source: Path, out: Path, env: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """`pip wheel source` (a directory or an sdist): the wheel and pip's verbose output."""
    out.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps"]
    command += ["--no-build-isolation", "--no-cache-dir", "-v", "-w", str(out)]
    proc = _run(command, out, env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = out.glob("blocktrie-*.whl")
    return wheel, proc.stdout + proc.stderr


def test_the_sdist_carries_the_packages_and_the_native_sources(sdist: Path, checkout: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    native = {p.relative_to(checkout).as_posix() for p in (checkout / "native").rglob("*")}
    needed = {"pyproject.toml", "README.md", "LICENSE", "CMakeLists.txt", "PKG-INFO"}
    needed |= _package_files(checkout) | {n for n in native if (checkout / n).is_file()}
    assert "native/src/module.cpp" in needed
    assert needed <= names, f"the sdist lacks {sorted(needed - names)}"
    built = [n for n in names if n.endswith((".so", ".pyc", ".o")) or n.startswith("build/")]
    assert not built, f"the sdist carries build outputs {built}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"CXX": "/bin/false"}, "no working C++ compiler found"),
        ({"BLOCKTRIE_NATIVE": "OFF"}, "BLOCKTRIE_NATIVE=OFF"),
    ],
    ids=["no-compiler", "opted-out"],
)
def test_pip_wheel_without_a_toolchain_ships_the_python_packages_alone(
    checkout: Path, tmp_path: Path, env: dict[str, str], why: str
) -> None:
    """`pip wheel .` where CMake finds no working C++ compiler (`CXX=/bin/false` fails
    CMake's `check_language`, as a missing one does), or with the opt-out: the build
    succeeds, says why in its warning, and the wheel holds the same files as a
    setuptools wheel did before the native core."""
    _needs_build_backend()
    wheel, output = _pip_wheel(checkout, tmp_path, env)
    assert _without_a_native_core(output) == why
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {n for n in names if not n.startswith("blocktrie-0.1.0.dist-info/")}
    assert packages == _package_files(checkout)
    assert "blocktrie-0.1.0.dist-info/licenses/LICENSE" in names


@pytest.mark.slow
def test_the_wheel_built_from_the_sdist_carries_a_native_core_that_imports(
    sdist: Path, tmp_path: Path
) -> None:
    if _compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    wheel, output = _pip_wheel(sdist, tmp_path / "wheel")
    assert _without_a_native_core(output) is None
    names = set(zipfile.ZipFile(wheel).namelist())
    (native,) = [n for n in names if n.startswith("cache/_native")]
    assert native.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    assert {n for n in names if not n.startswith("blocktrie")} - {native} == _package_files(
        unpacked
    )
    code = "import cache._native as n; print(n.__file__)"
    proc = _run([sys.executable, "-c", code], unpacked)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == unpacked / native


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ("CXX=/bin/false", "no working C++ compiler found"),
        ("-DBLOCKTRIE_NATIVE=OFF", "BLOCKTRIE_NATIVE=OFF"),
        ("-DPython_INCLUDE_DIR={empty}", "no Python development headers found (python3-dev)"),
    ],
    ids=["no-compiler", "opted-out", "no-python-headers"],
)
def test_cmake_without_a_toolchain_builds_nothing_and_says_why(
    tmp_path: Path, option: str, why: str
) -> None:
    """CMakeLists.txt's configure step: without a working compiler, without Python's C
    headers (pip's build names an include directory that then lacks Python.h), or opted
    out, it succeeds, warns with the reason, and the build makes no `_native`."""
    _needs_cmake()
    if "Python_INCLUDE_DIR" in option and _compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    (tmp_path / "empty").mkdir()
    option = option.format(empty=tmp_path / "empty")
    env = dict([option.split("=", 1)]) if not option.startswith("-D") else {}
    command = ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build")]
    command += [f"-DPython_EXECUTABLE={sys.executable}"] + ([option] if not env else [])
    configured = _run(command, tmp_path, env)
    assert configured.returncode == 0, configured.stdout + configured.stderr
    assert _without_a_native_core(configured.stdout + configured.stderr) == why
    built = _run(["cmake", "--build", str(tmp_path / "build")], tmp_path, env)
    assert built.returncode == 0, built.stdout + built.stderr
    assert not list((tmp_path / "build").rglob("_native*"))


def _editable_checkout() -> Path | None:
    """The checkout `pip install -e` installed the `blocktrie` distribution from (PEP
    610's `direct_url.json` of the installed one: the `blocktrie.egg-info` that the
    build leaves in the checkout has none), or None for any other install."""
    for distribution in metadata.distributions(name="blocktrie"):
        info = json.loads(distribution.read_text("direct_url.json") or "{}")
        if info.get("dir_info", {}).get("editable"):
            return Path(unquote(urlparse(info["url"]).path)).resolve()
    return None


def test_the_installed_checkout_has_its_native_core() -> None:
    """Where this checkout is the one `pip install -e` installed (a fresh clone after the
    README's commands: CI) and a C++ compiler is present, the install built
    `cache/_native*.so` beside the sources and it imports. Other checkouts (a git
    worktree testing its own `cache`) build theirs with DEV_BUILD."""
    if os.environ.get("BLOCKTRIE_NATIVE", "ON").upper() in CMAKE_FALSE:
        pytest.skip("BLOCKTRIE_NATIVE opts out of the native core")
    if _compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    if _editable_checkout() != ROOT:
        pytest.skip(f"this checkout is not pip's editable install; `{DEV_BUILD}` builds its own")
    native = importlib.import_module("cache._native")
    assert Path(native.__file__).parent == ROOT / "cache"
