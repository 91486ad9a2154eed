// The node table's per-block loops (cache/node.py `NodeTable`, cache/lookup.py,
// cache/attach.py): the prefix walk of `match`, the chain of new nodes `commit`
// attaches, the ticks `release` sets. The columns are the table's own (`columns.hpp`);
// a node's children are `child[node]` (one) or the dict `kids[node]` (`many`).
#pragma once

#include "columns.hpp"
#include "spec_tables.hpp"

namespace blocktrie {

// Whether `key` (bytes) equals the plain key stored in `tokens` row `node`.
inline bool holds(Column<uint8_t>& tokens, int32_t node, PyObject* key, size_t width) {
    if (!PyBytes_CheckExact(key) || static_cast<size_t>(PyBytes_GET_SIZE(key)) != width) return false;
    return std::memcmp(&tokens[static_cast<size_t>(node) * width], PyBytes_AS_STRING(key), width) == 0;
}

// [R12] `Lookup._walk`, plain case (every key bytes, no node with a wide key): the
// nodes under `root` whose keys are the leading `keys`, while a child with the exact
// key exists, appended to `path`.
inline void walk_into(std::vector<int32_t>& path, nb::handle keys_obj, int32_t root,
                      nb::handle child_obj, nb::handle tokens_obj, nb::handle kids_obj, size_t width) {
    const SpecTables& s = spec();
    if (!PyList_Check(keys_obj.ptr()) || !PyDict_Check(kids_obj.ptr())) {
        throw std::invalid_argument("walk: keys must be a list and kids a dict");
    }
    Column<int32_t> child(child_obj, "child");
    Column<uint8_t> tokens(tokens_obj, "tokens");
    int32_t node = root;
    const Py_ssize_t n = PyList_GET_SIZE(keys_obj.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* key = PyList_GET_ITEM(keys_obj.ptr(), i);
        int32_t next = child[static_cast<size_t>(node)];
        if (next >= 0) {
            if (!holds(tokens, next, key, width)) break;
        } else if (next == s.many) {
            nb::object index = nb::int_(node);
            PyObject* kids = PyDict_GetItemWithError(kids_obj.ptr(), index.ptr());
            if (kids == nullptr) {
                if (PyErr_Occurred()) throw nb::python_error();
                throw std::logic_error("walk: a node with many children has no kids dict");
            }
            PyObject* found = PyDict_GetItemWithError(kids, key);
            if (found == nullptr) {
                if (PyErr_Occurred()) throw nb::python_error();
                break;
            }
            long v = PyLong_AsLong(found);
            if (v == -1 && PyErr_Occurred()) throw nb::python_error();
            next = static_cast<int32_t>(v);
        } else {
            break;
        }
        path.push_back(next);
        node = next;
    }
}

// `walk_into` as a list (the Python core's `Lookup._walk` calls it).
inline nb::list walk(nb::handle keys_obj, int32_t root, nb::handle child_obj, nb::handle tokens_obj,
                     nb::handle kids_obj, size_t width) {
    std::vector<int32_t> path;
    walk_into(path, keys_obj, root, child_obj, tokens_obj, kids_obj, width);
    return to_list(path);
}

// `Lookup.match`'s taking of the hit: the device blocks of `held[0..count)` (a path)
// into `blocks`, each given one more reference ([R6]: after every check), and the
// nodes among them that were `evictable` into `idle` (the caller settles them out of
// the index). Raises ValueError before changing anything when a block is free
// (cannot happen on a consistent trie).
inline void hold(const std::vector<int32_t>& held, size_t count, nb::handle block_obj,
                 nb::handle state_obj, nb::handle refs_obj, std::vector<int32_t>& blocks,
                 std::vector<int32_t>& idle) {
    const SpecTables& s = spec();
    blocks.reserve(count);
    {
        Column<int32_t> block(block_obj, "block");
        Column<uint8_t> state(state_obj, "state");
        for (size_t i = 0; i < count; ++i) {
            const size_t node = static_cast<size_t>(held[i]);
            blocks.push_back(block[node]);
            if (state[node] == s.evictable) idle.push_back(held[i]);
        }
    }
    IntList refs(refs_obj, "refs");
    for (int32_t b : blocks) {
        if (b < 0 || static_cast<size_t>(b) >= refs.size() || refs.get(static_cast<size_t>(b)) <= 0) {
            throw std::invalid_argument("hold_path: a held node's block is free");
        }
    }
    for (int32_t b : blocks) refs.set(static_cast<size_t>(b), refs.get(static_cast<size_t>(b)) + 1);
}

// `hold` over a whole list: (blocks, evictable nodes), for the Python core's `match`.
inline nb::tuple hold_path(nb::handle held_obj, nb::handle block_obj, nb::handle state_obj,
                           nb::handle refs_obj) {
    std::vector<int32_t> held = from_list(held_obj, "held");
    std::vector<int32_t> blocks;
    std::vector<int32_t> idle;
    hold(held, held.size(), block_obj, state_obj, refs_obj, blocks, idle);
    return nb::make_tuple(to_list(blocks), to_list(idle));
}

// [R8] `release`: every node of `path` at `tick` (one shared int object).
inline void set_ticks(nb::handle ticks_obj, nb::handle path_obj, nb::handle tick) {
    IntList ticks(ticks_obj, "tick");
    std::vector<int32_t> path = from_list(path_obj, "path");
    for (int32_t node : path) {
        if (node < 0 || static_cast<size_t>(node) >= ticks.size()) throw std::out_of_range("set_ticks: no such node");
    }
    for (int32_t node : path) ticks.set_object(static_cast<size_t>(node), tick.ptr());
}

// [R19] `NodeTable.new_chain` for plain keys, with `Attach._attach_chain`'s reference
// and owner updates: rows from `table._take` become a chain under `parent`, node j
// with key `keys[start + j]`, block `blocks[j]`, serial `serial + j`, state `code`, at
// `tick`, in `parent`'s namespace; each the only child of the one before (the caller
// links the first under `parent`). Each block gains the trie's reference and its
// owner. Returns the rows, or None, changing nothing, when a key is not plain bytes
// of the table's width (the Python path handles those).
inline nb::object attach_chain(nb::handle table, int32_t parent, nb::handle keys_obj, size_t start,
                               nb::handle blocks_obj, int64_t serial, nb::handle tick, int code,
                               nb::handle owner_col, nb::handle refs_obj) {
    spec();
    const size_t width = nb::cast<size_t>(table.attr(BT_NAME("width")));
    std::vector<int32_t> blocks = from_list(blocks_obj, "blocks");
    if (!PyList_Check(keys_obj.ptr()) ||
        static_cast<size_t>(PyList_GET_SIZE(keys_obj.ptr())) < start + blocks.size()) {
        throw std::invalid_argument("attach_chain: keys must be a list covering the chain");
    }
    for (size_t j = 0; j < blocks.size(); ++j) {
        PyObject* key = PyList_GET_ITEM(keys_obj.ptr(), static_cast<Py_ssize_t>(start + j));
        if (!PyBytes_CheckExact(key) || static_cast<size_t>(PyBytes_GET_SIZE(key)) != width) {
            return nb::none();
        }
    }
    IntList refs(refs_obj, "refs");
    for (int32_t b : blocks) {  // held by the committing request: cannot be free
        if (b < 0 || static_cast<size_t>(b) >= refs.size() || refs.get(static_cast<size_t>(b)) <= 0) {
            throw std::invalid_argument("attach_chain: a committed block is free");
        }
    }
    nb::object rows_obj = table.attr(BT_NAME("_take"))(blocks.size());  // may grow the columns
    std::vector<int32_t> rows = from_list(rows_obj, "rows");
    nb::object parent_col = table.attr(BT_NAME("parent")), child_col = table.attr(BT_NAME("child"));
    nb::object block_col = table.attr(BT_NAME("block")), tick_col = table.attr(BT_NAME("tick"));
    nb::object serial_col = table.attr(BT_NAME("serial")), state_col = table.attr(BT_NAME("state"));
    nb::object namespace_col = table.attr(BT_NAME("namespace")), tokens_col = table.attr(BT_NAME("tokens"));
    Column<int32_t> parents(parent_col, "parent");
    Column<int32_t> child(child_col, "child");
    Column<int32_t> block(block_col, "block");
    IntList ticks(tick_col, "tick");
    Column<int64_t> serials(serial_col, "serial");
    Column<uint8_t> state(state_col, "state");
    Column<int32_t> ns(namespace_col, "namespace");
    Column<uint8_t> tokens(tokens_col, "tokens");
    Column<int32_t> owner(owner_col, "owner");
    for (size_t j = 0; j < rows.size(); ++j) {
        if (rows[j] < 0 || static_cast<size_t>(rows[j]) >= parents.size() ||
            static_cast<size_t>(blocks[j]) >= owner.size() ||
            (static_cast<size_t>(rows[j]) + 1) * width > tokens.size()) {
            throw std::out_of_range("attach_chain: a row or block outside the table");
        }
    }
    const int32_t space = ns[static_cast<size_t>(parent)];
    int32_t prev = parent;
    for (size_t j = 0; j < rows.size(); ++j) {
        const size_t node = static_cast<size_t>(rows[j]);
        parents[node] = prev;
        block[node] = blocks[j];
        ticks.set_object(node, tick.ptr());
        serials[node] = serial + static_cast<int64_t>(j);
        state[node] = static_cast<uint8_t>(code);
        ns[node] = space;
        PyObject* key = PyList_GET_ITEM(keys_obj.ptr(), static_cast<Py_ssize_t>(start + j));
        std::memcpy(&tokens[node * width], PyBytes_AS_STRING(key), width);
        if (j) child[static_cast<size_t>(prev)] = rows[j];
        prev = rows[j];
        owner[static_cast<size_t>(blocks[j])] = rows[j];
        refs.set(static_cast<size_t>(blocks[j]), refs.get(static_cast<size_t>(blocks[j])) + 1);
    }
    return rows_obj;
}

}  // namespace blocktrie
