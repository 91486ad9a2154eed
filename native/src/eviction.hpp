// `Evictor._evict`'s loop for a trie without a host tier, checkpoints or write-back
// (cache/eviction.py): LRU evictable leaves freed oldest first ([R10], [R23]), each
// parent that the step leaves evictable and that is older than every indexed leaf
// freed in the same pass. State changes follow the spec: `free` through the `NODE`
// table's row (`SpecTables::freed_from`), a parent's new state through the Python
// core's memo of the spec's routes (`settled`, filled by `Evictor._implied` on a miss).
#pragma once

#include "columns.hpp"
#include "lru.hpp"
#include "spec_tables.hpp"

#include <unordered_map>

namespace blocktrie {

// `cache.eviction._SETTLED`, the Python core's memo of where `Evictor.settle` moves a
// node ((state, leaf, refs, pins, on device) -> state code, derived from the spec's
// routes), read without building a key tuple for an attached device node with no
// pin: a native copy of the entries read so far, dropped whenever the dict's size
// changes (an entry added by `Evictor._implied`, or the memo cleared).
inline int settled_lookup(nb::handle settled, int state, bool leaf, int64_t refs) {
    static std::unordered_map<uint64_t, int> copy;
    static PyObject* dict = nullptr;
    static Py_ssize_t synced = -1;
    const Py_ssize_t size = PyDict_GET_SIZE(settled.ptr());
    if (settled.ptr() != dict || size != synced) {
        copy.clear();
        dict = settled.ptr();
        synced = size;
    }
    const bool packable = refs >= 0 && refs < (int64_t{1} << 40);
    const uint64_t key = (static_cast<uint64_t>(refs) << 9) | (static_cast<uint64_t>(leaf) << 8) |
                         static_cast<uint64_t>(state & 0xFF);
    if (packable) {
        auto it = copy.find(key);
        if (it != copy.end()) return it->second;
    }
    nb::object facts = nb::make_tuple(state, leaf, refs, 0, true);
    PyObject* hit = PyDict_GetItemWithError(settled.ptr(), facts.ptr());
    if (hit == nullptr) {
        if (PyErr_Occurred()) throw nb::python_error();
        return -1;
    }
    const int dest = static_cast<int>(PyLong_AsLong(hit));
    if (packable) copy.emplace(key, dest);
    return dest;
}

// `Evictor._enter`: `node` (in state `now`) moves to `dest`, a new state; the index
// holds exactly the evictable nodes (invariant 7).
inline void enter(NodeLRU& index, Column<uint8_t>& state, int32_t node, int now, int dest,
                  int64_t tick, int64_t serial) {
    const SpecTables& s = spec();
    if (now == s.evictable) index.discard(node);
    state[static_cast<size_t>(node)] = static_cast<uint8_t>(dest);
    if (dest == s.evictable) index.insert(NodeLRU::Entry{tick, serial, node});
}

// Free LRU leaves until `n` blocks are freed or nothing is evictable. `evictor` is
// the Python `Evictor` (its `_free`, `_implied`, `num_cached`), `table` its
// `NodeTable`, `kv` its `KVBlockPool`; `settled` is cache.eviction's `_SETTLED`, the
// memo of the spec's routes keyed (state, leaf, refs, pins, on device), which
// `Evictor._implied` fills on a miss (or raises IllegalTransition). With `removed` (three lists: hashes, blocks,
// namespaces), each freed node's `BlockRemoved` facts are appended, in order.
inline int64_t evict_inline(int64_t n, NodeLRU& index, nb::handle evictor, nb::handle table,
                            nb::handle kv, nb::handle removed, nb::handle settled) {
    if (!PyDict_Check(settled.ptr())) throw std::invalid_argument("evict: settled must be a dict");
    const SpecTables& s = spec();
    nb::object parents_obj = table.attr(BT_NAME("parent")), child_obj = table.attr(BT_NAME("child"));
    nb::object block_obj = table.attr(BT_NAME("block")), state_obj = table.attr(BT_NAME("state"));
    nb::object serial_obj = table.attr(BT_NAME("serial")), tick_obj = table.attr(BT_NAME("tick"));
    nb::object owner_obj = evictor.attr(BT_NAME("owner")), refs_obj = kv.attr(BT_NAME("refs"));
    nb::object free_rows_obj = table.attr(BT_NAME("free_rows")), kv_free_obj = kv.attr(BT_NAME("_free"));
    nb::object wide_obj = table.attr(BT_NAME("wide"));
    nb::object hash_obj, names_obj, space_obj;
    const bool events = !removed.is_none();
    nb::object removed_hashes, removed_blocks, removed_spaces;
    if (events) {
        removed_hashes = removed[0];
        removed_blocks = removed[1];
        removed_spaces = removed[2];
        if (!PyList_Check(removed_hashes.ptr()) || !PyList_Check(removed_blocks.ptr()) ||
            !PyList_Check(removed_spaces.ptr())) {
            throw std::invalid_argument("evict: removed must be three lists");
        }
        hash_obj = table.attr(BT_NAME("block_hash"));
        names_obj = table.attr(BT_NAME("names"));
        space_obj = table.attr(BT_NAME("namespace"));
    }
    Column<int32_t> parents(parents_obj, "parent");
    Column<int32_t> child(child_obj, "child");
    Column<int32_t> blocks(block_obj, "block");
    Column<uint8_t> state(state_obj, "state");
    Column<int64_t> serials(serial_obj, "serial");
    Column<int32_t> owner(owner_obj, "owner");
    IntList ticks(tick_obj, "tick");
    IntList refs(refs_obj, "refs");
    std::vector<int32_t> rows_freed, blocks_freed;
    int64_t nodes_freed = 0;
    auto flush = [&]() {  // what the Python loop would have applied by now
        extend_array(free_rows_obj, rows_freed);
        extend_array(kv_free_obj, blocks_freed);
        rows_freed.clear();
        blocks_freed.clear();
        if (nodes_freed) {
            evictor.attr(BT_NAME("num_cached")) = nb::int_(nb::cast<int64_t>(evictor.attr(BT_NAME("num_cached"))) - nodes_freed);
            nodes_freed = 0;
        }
    };
    auto wide_nonempty = [&]() { return PyDict_GET_SIZE(wide_obj.ptr()) > 0; };
    int64_t freed = 0;
    try {
        while (freed < n && index.size() > 0) {
            int32_t node = index.top().node;
            index.discard(node);
            bool have_oldest = false;  // [R10]: the index's oldest, read once when first needed
            bool none_indexed = false;
            NodeLRU::Entry oldest{};
            while (true) {
                const int32_t parent = parents[static_cast<size_t>(node)];
                if (events) {  // `BlockRemoved`'s facts, three list appends
                    nb::object h = nb::steal(PySequence_GetItem(hash_obj.ptr(), node));
                    nb::object space = nb::steal(PySequence_GetItem(space_obj.ptr(), node));
                    if (!h.is_valid() || !space.is_valid()) throw nb::python_error();
                    nb::object name = names_obj[space];
                    nb::object block = nb::int_(blocks[static_cast<size_t>(node)]);
                    if (PyList_Append(removed_hashes.ptr(), h.ptr()) != 0 ||
                        PyList_Append(removed_blocks.ptr(), block.ptr()) != 0 ||
                        PyList_Append(removed_spaces.ptr(), name.ptr()) != 0) {
                        throw nb::python_error();
                    }
                }
                const int freed_state = s.freed_from[state[static_cast<size_t>(node)]];
                if (freed_state < 0 || parent == s.no_node) {
                    flush();  // the Python core's `_free`: all of it, or its error
                    freed += nb::cast<int64_t>(evictor.attr(BT_NAME("_free"))(node));
                } else {
                    if (child[static_cast<size_t>(parent)] == node) {
                        child[static_cast<size_t>(parent)] = s.no_child;
                    } else {
                        table.attr(BT_NAME("detach_child"))(parent, node);
                    }
                    const int32_t block = blocks[static_cast<size_t>(node)];
                    owner[static_cast<size_t>(block)] = s.no_node;
                    ++nodes_freed;
                    state[static_cast<size_t>(node)] = static_cast<uint8_t>(freed_state);
                    parents[static_cast<size_t>(node)] = s.no_node;
                    if (wide_nonempty()) {
                        nb::object key = nb::int_(node);
                        if (PyDict_DelItem(wide_obj.ptr(), key.ptr()) != 0) {
                            if (!PyErr_ExceptionMatches(PyExc_KeyError)) throw nb::python_error();
                            PyErr_Clear();
                        }
                    }
                    rows_freed.push_back(node);
                    const int64_t count = refs.get(static_cast<size_t>(block));
                    if (count <= 0) {
                        flush();
                        kv.attr(BT_NAME("decref"))(block);  // raises the pool's double-free error
                        throw std::logic_error("evict: a double free went unrefused");
                    }
                    refs.set(static_cast<size_t>(block), count - 1);
                    if (count == 1) {
                        blocks_freed.push_back(block);
                        ++freed;
                    }
                }
                if (parent == s.no_node || state[static_cast<size_t>(parent)] == s.root) break;
                const int32_t pblock = blocks[static_cast<size_t>(parent)];
                const int pstate = state[static_cast<size_t>(parent)];
                int dest = -1;
                if (pblock != s.no_block) {  // `Evictor._implied`, inlined: no pin, on device
                    const bool leaf = child[static_cast<size_t>(parent)] == s.no_child;
                    dest = settled_lookup(settled, pstate, leaf, refs.get(static_cast<size_t>(pblock)));
                }
                if (dest < 0) {
                    flush();
                    dest = nb::cast<int>(evictor.attr(BT_NAME("_implied"))(parent));  // derives or refuses
                }
                if (dest == pstate) break;
                if (dest == s.evictable && freed < n && pstate != s.evictable) {
                    if (!have_oldest) {
                        have_oldest = true;
                        none_indexed = index.size() == 0;
                        if (!none_indexed) oldest = index.top();
                    }
                    const NodeLRU::Entry here{ticks.get(static_cast<size_t>(parent)),
                                              serials[static_cast<size_t>(parent)], parent};
                    if (none_indexed || NodeLRU::less(here, oldest)) {
                        state[static_cast<size_t>(parent)] = static_cast<uint8_t>(dest);
                        node = parent;
                        continue;
                    }
                }
                enter(index, state, parent, pstate, dest, ticks.get(static_cast<size_t>(parent)),
                      serials[static_cast<size_t>(parent)]);
                break;
            }
        }
    } catch (...) {
        flush();
        throw;
    }
    flush();
    return freed;
}

}  // namespace blocktrie
