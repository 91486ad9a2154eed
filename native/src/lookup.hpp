// `Lookup.match`'s whole operation in one native call, for the usual request
// (cache/lookup.py): token ids in a `list` of plain ints below 2**32, an ASCII
// namespace, no extra identity, salt, hit bounds, host tier or SSM. Anything else
// returns None before anything changed, and the Python core runs the request
// (`Lookup.match`, the reference this mirrors step by step).
#pragma once

#include "columns.hpp"
#include "node_table.hpp"
#include "spec_tables.hpp"

namespace blocktrie {

// Token ids as a uint32 `array` ([R5]: stored by value); None (no change made) when an
// item is not an exact `int` in [0, 2**32): the Python core validates those.
inline nb::object u32_array(nb::handle tokens, nb::handle array_type, nb::handle typecode) {
    PyObject* list = tokens.ptr();
    const Py_ssize_t n = PyList_GET_SIZE(list);
    nb::object raw = nb::steal(PyBytes_FromStringAndSize(nullptr, n * 4));
    if (!raw.is_valid()) throw nb::python_error();
    auto* out = reinterpret_cast<uint32_t*>(PyBytes_AS_STRING(raw.ptr()));
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(item) || !small_uint(item, out[i])) return nb::none();
    }
    return array_type(typecode, raw);
}

// The per-trie handles the fast path reads: the node table's columns and the
// containers that hold no reference back to the trie (so no cycle through this
// object). The trie, its stats, its live registry and its evictor come with each call.
class FastLookup {
public:
    FastLookup(nb::object table, nb::object refs, nb::object roots, nb::object sequence_type,
               nb::object array_type, nb::object typecode, size_t block_size)
        : child_(table.attr(BT_NAME("child"))), tokens_(table.attr(BT_NAME("tokens"))), block_(table.attr(BT_NAME("block"))),
          state_(table.attr(BT_NAME("state"))), kids_(table.attr(BT_NAME("kids"))), wide_(table.attr(BT_NAME("wide"))),
          refs_(std::move(refs)), roots_(std::move(roots)), sequence_type_(std::move(sequence_type)),
          array_type_(std::move(array_type)), typecode_(std::move(typecode)),
          width_(nb::cast<size_t>(table.attr(BT_NAME("width")))), block_size_(block_size) {}

    // `BlockTrie.match(tokens, namespace)` past its gate, as `Lookup.match` does it;
    // `serial` is the new sequence's. Returns the live `Sequence`, or None (nothing
    // changed) when the request needs the Python core.
    nb::object match(nb::handle tokens, nb::handle namespace_, nb::handle trie, nb::handle stats,
                     nb::handle live, nb::handle evictor, int64_t serial) {
        spec();  // configured (the kernels below read its codes)
        if (!PyList_CheckExact(tokens.ptr()) || !PyUnicode_CheckExact(namespace_.ptr()) ||
            !PyUnicode_IS_ASCII(namespace_.ptr()) || PyDict_GET_SIZE(wide_.ptr()) > 0) {
            return nb::none();
        }
        const Py_ssize_t n = PyList_GET_SIZE(tokens.ptr());
        if (n == 0) return nb::none();  // refused by the Python core ([R1])
        nb::object toks = u32_array(tokens, array_type_, typecode_);
        if (toks.is_none()) return toks;
        const size_t size = block_size_;
        const size_t nblocks = static_cast<size_t>(n) / size;
        // Block keys: each block's uint32 ids, as bytes (`cache.keys.request_keys`).
        Column<uint32_t> ids(toks, "tokens");
        const char* raw = reinterpret_cast<const char*>(ids.data());
        nb::object keys = nb::steal(PyList_New(static_cast<Py_ssize_t>(nblocks)));
        if (!keys.is_valid()) throw nb::python_error();
        for (size_t j = 0; j < nblocks; ++j) {
            PyObject* key = PyBytes_FromStringAndSize(raw + j * width_, static_cast<Py_ssize_t>(width_));
            if (key == nullptr) throw nb::python_error();
            PyList_SET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(j), key);
        }
        // [R12]: walk while a child with the exact key exists
        PyObject* root = PyDict_GetItemWithError(roots_.ptr(), namespace_.ptr());
        if (root == nullptr && PyErr_Occurred()) throw nb::python_error();
        std::vector<int32_t> path;
        if (root != nullptr) {
            path.reserve(nblocks);
            walk_into(path, keys, static_cast<int32_t>(PyLong_AsLong(root)), child_, tokens_, kids_, width_);
        }
        const size_t usable = std::min(path.size(), (static_cast<size_t>(n) - 1) / size);
        const int64_t hit = static_cast<int64_t>(usable * size);
        // [R6]: the references, after every check
        std::vector<int32_t> blocks;
        std::vector<int32_t> idle;
        hold(path, usable, block_, state_, refs_, blocks, idle);
        for (int32_t node : idle) evictor.attr(BT_NAME("settle"))(node);
        const size_t walked = path.size();
        path.resize(usable);
        nb::object seq = sequence_type_(trie, serial, toks, namespace_, nb::none());
        seq.attr(BT_NAME("keys")) = keys;
        seq.attr(BT_NAME("branch_step")) = nb::int_(static_cast<int64_t>(walked * size));
        seq.attr(BT_NAME("path")) = to_list(path);
        seq.attr(BT_NAME("blocks")) = to_list(blocks);
        nb::int_ hit_obj(hit);
        seq.attr(BT_NAME("num_cached_tokens")) = hit_obj;
        seq.attr(BT_NAME("num_committed_tokens")) = hit_obj;
        nb::int_ queried(static_cast<int64_t>(n));
        seq.attr(BT_NAME("query_tokens")) = queried;
        // [R14], [R69]
        stats.attr(BT_NAME("queries")) = stats.attr(BT_NAME("queries")) + nb::int_(1);
        stats.attr(BT_NAME("query_tokens")) = stats.attr(BT_NAME("query_tokens")) + queried;
        stats.attr(BT_NAME("hit_tokens")) = stats.attr(BT_NAME("hit_tokens")) + hit_obj;
        nb::object serial_obj = nb::int_(serial);
        stats.attr(BT_NAME("recent")).attr(BT_NAME("append"))(nb::make_tuple(serial_obj, queried, hit_obj));
        if (PyDict_SetItem(live.ptr(), serial_obj.ptr(), seq.ptr()) != 0) throw nb::python_error();
        return seq;
    }

private:
    nb::object child_, tokens_, block_, state_, kids_, wide_, refs_, roots_;
    nb::object sequence_type_, array_type_, typecode_;
    size_t width_, block_size_;
};

}  // namespace blocktrie
