// Access to the node table's columns, which stay Python containers (cache/node.py):
// `array`s and `bytearray`s through the buffer protocol, `list`s through the C API.
// The native core keeps no copy of them: a kernel borrows each column for one call,
// so the Python core (the reference and fallback) and the kernels share one state.
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

// An attribute name as an interned `str`, made once per place it is used: nanobind's
// `attr("name")` would build a new `str` (and hash it) on every call.
#define BT_NAME(text)                                                           \
    ([]() -> nanobind::handle {                                                 \
        static PyObject* const interned = PyUnicode_InternFromString(text);     \
        return interned;                                                        \
    }())

namespace blocktrie {

namespace nb = nanobind;

// A column exported as a buffer of `T` for the duration of one kernel call. Holding
// the export keeps the column from being resized (Python raises BufferError), so a
// kernel appends to growing columns only after it has let go of them.
template <typename T>
class Column {
public:
    Column(nb::handle obj, const char* name) {
        if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_WRITABLE | PyBUF_ND) != 0) {
            throw nb::python_error();
        }
        if (view_.itemsize != static_cast<Py_ssize_t>(sizeof(T)) || view_.ndim != 1) {
            PyBuffer_Release(&view_);
            throw std::invalid_argument(std::string("column ") + name + ": items of " +
                                        std::to_string(sizeof(T)) + " bytes expected");
        }
        data_ = static_cast<T*>(view_.buf);
        size_ = static_cast<size_t>(view_.shape[0]);
    }
    Column(const Column&) = delete;
    Column& operator=(const Column&) = delete;
    ~Column() { PyBuffer_Release(&view_); }

    T& operator[](size_t i) { return data_[i]; }
    size_t size() const { return size_; }
    T* data() { return data_; }

private:
    Py_buffer view_{};
    T* data_ = nullptr;
    size_t size_ = 0;
};

// A `list` of Python ints (the tick column, the KV pool's reference counts).
class IntList {
public:
    IntList(nb::handle obj, const char* name) : list_(obj.ptr()) {
        if (!PyList_Check(list_)) {
            throw std::invalid_argument(std::string("column ") + name + " must be a list");
        }
    }
    size_t size() const { return static_cast<size_t>(PyList_GET_SIZE(list_)); }
    int64_t get(size_t i) const {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(list_, static_cast<Py_ssize_t>(i)));
        if (v == -1 && PyErr_Occurred()) throw nb::python_error();
        return v;
    }
    // Store `value` (a borrowed int object, shared by every row set to it).
    // An index outside the list raises (Python's IndexError), changing nothing.
    void set_object(size_t i, PyObject* value) {
        Py_INCREF(value);
        // steals `value` (also when it fails) and drops the old item
        if (PyList_SetItem(list_, static_cast<Py_ssize_t>(i), value) != 0) throw nb::python_error();
    }
    void set(size_t i, int64_t v) {
        PyObject* obj = PyLong_FromLongLong(v);
        if (obj == nullptr) throw nb::python_error();
        if (PyList_SetItem(list_, static_cast<Py_ssize_t>(i), obj) != 0) throw nb::python_error();
    }

private:
    PyObject* list_;
};

// The value of `item`, an exact `int` (no subclass: nothing of the caller's runs),
// when it is in [0, 2**32); false otherwise (a
// negative or larger id: the caller's slow path decides). Small ints are read from
// their single digit where the interpreter exposes it (a token id is almost always
// below 2**30), the C API otherwise.
inline bool small_uint(PyObject* item, uint32_t& out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(item))) {
        Py_ssize_t v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(item));
        if (v < 0 || v > 0xFFFFFFFFLL) return false;
        out = static_cast<uint32_t>(v);
        return true;
    }
#else
    const Py_ssize_t digits = Py_SIZE(item);
    if (digits == 0) {
        out = 0;
        return true;
    }
    if (digits == 1) {
        out = static_cast<uint32_t>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]);
        return true;
    }
#endif
    // An exact `int` (the caller checked) converts without raising: only the range
    // can refuse it.
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || v < 0 || v > 0xFFFFFFFFLL) return false;
    out = static_cast<uint32_t>(v);
    return true;
}

// Ints as a new Python list.
inline nb::list to_list(const std::vector<int32_t>& values) {
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(values.size()));
    if (out == nullptr) throw nb::python_error();
    for (size_t i = 0; i < values.size(); ++i) {
        PyObject* v = PyLong_FromLong(values[i]);
        if (v == nullptr) {
            Py_DECREF(out);
            throw nb::python_error();
        }
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
    }
    return nb::steal<nb::list>(out);
}

// The ints of a Python list (a path, a block table), checked.
inline std::vector<int32_t> from_list(nb::handle obj, const char* name) {
    if (!PyList_Check(obj.ptr())) {
        throw std::invalid_argument(std::string(name) + " must be a list");
    }
    Py_ssize_t n = PyList_GET_SIZE(obj.ptr());
    std::vector<int32_t> out(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        long v = PyLong_AsLong(PyList_GET_ITEM(obj.ptr(), i));
        if (v == -1 && PyErr_Occurred()) throw nb::python_error();
        out[static_cast<size_t>(i)] = static_cast<int32_t>(v);
    }
    return out;
}

// Append `values` to an `array('i')`: `append` for a few, one `frombytes` for more.
inline void extend_array(nb::handle arr, const std::vector<int32_t>& values) {
    if (values.size() <= 4) {
        for (int32_t v : values) {
            nb::object item = nb::int_(v);
            PyObject* r = PyObject_CallMethodOneArg(arr.ptr(), BT_NAME("append").ptr(), item.ptr());
            if (r == nullptr) throw nb::python_error();
            Py_DECREF(r);
        }
        return;
    }
    nb::bytes raw(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int32_t));
    arr.attr(BT_NAME("frombytes"))(raw);
}

}  // namespace blocktrie
