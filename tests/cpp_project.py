"""A tiny checkout with a native ``cache._native`` module, for the end-to-end tests
of the native core's assurance tools (tests/test_cpp_*.py).

It has what the tools need of a checkout and nothing else: a CMake project building
``_native`` with the Python C API (no nanobind: it builds in about a second), with
the ``BLOCKTRIE_COVERAGE`` / ``BLOCKTRIE_SANITIZE`` blocks of the project's own
CMakeLists.txt (so the tools are tried on the project's flags), its
sources in ``native/src/``, a ``cache`` package, one test file, and a git
repository (the tools copy what git lists). Its module:

- ``sub(a, b)``: checked by the test (every mutant of it that builds is killed);
- ``twice(a)``: never called (its lines are uncovered, its mutants survive);
- ``read(i)``: element ``i`` of a 4-element heap array (``READ_AT=4`` in the
  environment makes the test read past its end); a negative ``i`` throws a C++
  exception, caught and raised as ``IndexError``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CMAKE = """\
cmake_minimum_required(VERSION 3.18)
project(fake_native LANGUAGES CXX)
option(BLOCKTRIE_COVERAGE "" OFF)
option(BLOCKTRIE_SANITIZE "" OFF)
find_package(Python 3.10 REQUIRED COMPONENTS Interpreter Development.Module)
Python_add_library(_native MODULE WITH_SOABI native/src/module.cpp)
target_include_directories(_native PRIVATE native/src)
"""


def option_blocks(cmake: str) -> str:
    """The ``if(BLOCKTRIE_COVERAGE)`` and ``if(BLOCKTRIE_SANITIZE)`` blocks of a
    CMakeLists.txt, each to its ``endif()``, unindented."""
    pattern = r"^[ \t]*if\(BLOCKTRIE_(?:COVERAGE|SANITIZE)\)$.*?^[ \t]*endif\(\)$"
    blocks = re.findall(pattern, cmake, re.MULTILINE | re.DOTALL)
    if len(blocks) != 2:
        raise ValueError(f"expected the coverage and sanitizer blocks, found {len(blocks)}")
    return "".join(textwrap.dedent(block) + "\n" for block in blocks)


ARITH = """\
#pragma once
inline long sub(long a, long b) { return a - b; }
inline long twice(long a) { return a * 2; }
"""

MODULE = """\
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdexcept>
#include "arith.hpp"

static PyObject* py_sub(PyObject*, PyObject* args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return nullptr;
    return PyLong_FromLong(sub(a, b));
}

static PyObject* py_twice(PyObject*, PyObject* args) {
    long a;
    if (!PyArg_ParseTuple(args, "l", &a)) return nullptr;
    return PyLong_FromLong(twice(a));
}

static PyObject* py_read(PyObject*, PyObject* args) {
    long i;
    if (!PyArg_ParseTuple(args, "l", &i)) return nullptr;
    try {
        if (i < 0) throw std::out_of_range("negative index");
    } catch (const std::out_of_range& e) {
        PyErr_SetString(PyExc_IndexError, e.what());
        return nullptr;
    }
    int* values = new int[4]{1, 2, 3, 4};
    long value = values[i];
    delete[] values;
    return PyLong_FromLong(value);
}

static PyMethodDef methods[] = {
    {"sub", py_sub, METH_VARARGS, nullptr},
    {"twice", py_twice, METH_VARARGS, nullptr},
    {"read", py_read, METH_VARARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", nullptr, -1, methods};

PyMODINIT_FUNC PyInit__native() { return PyModule_Create(&module); }
"""

TEST = """\
import os

import pytest

from cache import _native


def test_sub() -> None:
    assert _native.sub(9, 2) == 7
    assert _native.sub(-7, 4) == -11


def test_read() -> None:
    assert _native.read(int(os.environ.get("READ_AT", "3"))) == 4
    with pytest.raises(IndexError, match="negative index"):  # a C++ exception, caught
        _native.read(-1)
"""


def tools_found() -> str | None:
    """Why the end-to-end tests cannot build here (None when they can)."""
    for tool in ("cmake", "ninja", "c++", "git"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        return "no Python.h (the Python headers) to build an extension against"
    return None


def make_project(root: Path) -> Path:
    """Write the tiny checkout into `root` (a git repository, nothing committed)."""
    files = {
        "CMakeLists.txt": CMAKE + option_blocks((ROOT / "CMakeLists.txt").read_text()),
        "native/src/arith.hpp": ARITH,
        "native/src/module.cpp": MODULE,
        "cache/__init__.py": "",
        "tests/test_native_arith.py": TEST,
        ".gitignore": "build/\n__pycache__/\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the checkout outside ``build/`` and ``.git/``, by path: to check
    that a tool wrote nothing there."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] not in ("build", ".git")
    }
