// cache._native: the native core's bindings (issue 47). `cache.native` configures it
// with the spec's tables at import and the Python core calls one kernel per
// operation's per-block loop; every kernel's Python twin stays the reference.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "attach.hpp"
#include "eviction.hpp"
#include "kv_pool.hpp"
#include "lookup.hpp"
#include "lru.hpp"
#include "node_table.hpp"
#include "spec_tables.hpp"
#include "trie_ops.hpp"

namespace nb = nanobind;
using namespace blocktrie;

NB_MODULE(_native, m) {
    m.doc() = "blocktrie's native core: the hot loops over the node table's columns";
    m.attr("ABI") = 1;  // what the Python side was written against (cache.native.ABI)

    m.def("configure", &configure, nb::arg("root_code"), nb::arg("evictable_code"), nb::arg("freed_from"),
          nb::arg("no_node"), nb::arg("no_child"), nb::arg("many"), nb::arg("no_block"),
          "Hand over the spec's tables (state codes, the NODE table's `free` row) and the "
          "node table's sentinels, as cache.native._configure does at import; every "
          "kernel refuses to run before this.");
    m.def("configured", []() { return tables().configured; },
          "Whether `configure` has run (cache.native._configure, at import; every kernel "
          "refuses to run before it).");
    m.def("tables", []() {
        const SpecTables& t = spec();
        nb::dict freed;
        for (size_t code = 0; code < t.freed_from.size(); ++code) {
            if (t.freed_from[code] >= 0) freed[nb::int_(code)] = t.freed_from[code];
        }
        return nb::make_tuple(t.root, t.evictable, freed);
    }, "What `configure` was given, as cache.native._configure derives it from "
       "spec.lifecycle.NODE: (root code, evictable code, the `free` row).");

    nb::class_<NodeLRU>(m, "NodeLRU",
                        "The eviction index of one trie's nodes by (tick, serial): "
                        "cache.lru.LRUIndex's API over node ids.")
        .def(nb::init<nb::object, nb::object>(), nb::arg("ticks"), nb::arg("serials"))
        .def("__len__", &NodeLRU::size)
        .def("__bool__", [](const NodeLRU& l) { return l.size() > 0; })
        .def("__contains__", [](const NodeLRU& l, nb::handle node) {
            return PyLong_Check(node.ptr()) && l.contains(nb::cast<int64_t>(node));
        })
        .def("__iter__", [](const NodeLRU& l) { return nb::iter(nb::cast(l.ordered())); })
        .def("unordered", [](const NodeLRU& l) { return nb::iter(nb::cast(l.unordered())); })
        .def("add", &NodeLRU::add, nb::arg("member"))
        .def("remove",
             [](NodeLRU& l, int32_t node) {
                 if (!l.discard(node)) throw nb::key_error(std::to_string(node).c_str());
             },
             nb::arg("member"))
        .def("oldest", [](const NodeLRU& l) { return l.top().node; });

    nb::class_<FastLookup>(m, "FastLookup",
                           "Lookup.match in one call for the usual request (else None).")
        .def(nb::init<nb::object, nb::object, nb::object, nb::object, nb::object, nb::object, size_t>(),
             nb::arg("table"), nb::arg("refs"), nb::arg("roots"), nb::arg("sequence_type"),
             nb::arg("array_type"), nb::arg("typecode"), nb::arg("block_size"))
        .def("match", &FastLookup::match, nb::arg("tokens").none(), nb::arg("namespace").none(), nb::arg("trie"),
             nb::arg("stats"), nb::arg("live"), nb::arg("evictor"), nb::arg("serial"));

    nb::class_<FastAttach>(m, "FastAttach",
                           "BlockTrie.commit in one call for the usual commit (else False).")
        .def(nb::init<nb::object, nb::object, nb::object, nb::object, nb::object, nb::object, size_t, int,
                      nb::object, uintptr_t>(),
             nb::arg("table"), nb::arg("refs"), nb::arg("free_list"), nb::arg("owner"),
             nb::arg("sequence_type"), nb::arg("typecode"), nb::arg("block_size"),
             nb::arg("cached_code"), nb::arg("events").none(), nb::arg("xxh3"))
        .def("commit", &FastAttach::commit, nb::arg("seq").none(), nb::arg("num_tokens").none(), nb::arg("trie"),
             nb::arg("live"), nb::arg("evictor"), nb::arg("attach"), nb::arg("block_pins"));

    nb::class_<FastTrie>(m, "FastTrie",
                         "BlockTrie.release and .allocate in one call each for the usual "
                         "request (else False).")
        .def(nb::init<nb::object, nb::object, nb::object, nb::object, nb::object, nb::object,
                      nb::object, size_t>(),
             nb::arg("table"), nb::arg("refs"), nb::arg("free_list"), nb::arg("sequence_type"),
             nb::arg("settled"), nb::arg("faults"), nb::arg("fault_point"), nb::arg("block_size"))
        .def("release", &FastTrie::release, nb::arg("seq").none(), nb::arg("trie"), nb::arg("live"),
             nb::arg("index"), nb::arg("evictor"))
        .def("allocate", &FastTrie::allocate, nb::arg("seq").none(), nb::arg("num_tokens").none(), nb::arg("live"));

    m.def("incref_all", &incref_all, nb::arg("refs"), nb::arg("blocks"),
          "KVBlockPool.incref_all's loop: one more reference on each block. Returns -1, or "
          "the index of the first block that is free or outside the pool (every count "
          "then as it was).");
    m.def("decref_all", &decref_all, nb::arg("refs"), nb::arg("free_list"), nb::arg("blocks"),
          "KVBlockPool.decref_all's loop: one reference less on each block, a block whose "
          "count reaches 0 appended to free_list. Returns -1, or the index of the first "
          "block already free or outside the pool (every count then as it was).");
    m.def("take", &take, nb::arg("refs"), nb::arg("free_list"), nb::arg("count"),
          "KVBlockPool.take's loop: the last count free blocks (the stack's top first), "
          "each with one reference; the caller checked that there are enough.");
    m.def("walk", &walk, nb::arg("keys"), nb::arg("start_node"), nb::arg("child"), nb::arg("tokens"),
          nb::arg("kids"), nb::arg("width"),
          "Lookup._walk for plain keys ([R12]): the nodes under start_node whose keys are "
          "the leading keys, while a child with the exact key exists.");
    m.def("hold_path", &hold_path, nb::arg("held"), nb::arg("block"), nb::arg("state"),
          nb::arg("refs"),
          "One more reference on each held node's block ([R6]); returns (their blocks, "
          "the held nodes that were evictable, for the caller to settle).");
    m.def("set_ticks", &set_ticks, nb::arg("ticks"), nb::arg("path"), nb::arg("tick"),
          "Every node of path at tick, one shared int object ([R8]).");
    m.def("attach_chain", &attach_chain, nb::arg("table"), nb::arg("parent"), nb::arg("keys"),
          nb::arg("start"), nb::arg("blocks"), nb::arg("serial"), nb::arg("tick"), nb::arg("code"),
          nb::arg("owner"), nb::arg("refs"),
          "NodeTable.new_chain and Attach._attach_chain for plain keys ([R19]): blocks "
          "as a chain of new nodes under parent; the rows, or None (nothing changed) "
          "when a key is not plain bytes of the table's width.");
    m.def("evict_inline", &evict_inline, nb::arg("n"), nb::arg("index"), nb::arg("evictor"),
          nb::arg("table"), nb::arg("kv"), nb::arg("removed").none(), nb::arg("settled"),
          "Evictor.evict's loop ([R10], [R23]): free the LRU evictable leaves until n "
          "blocks are freed or nothing is evictable; returns the blocks freed.");
}
