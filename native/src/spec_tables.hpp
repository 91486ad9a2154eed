// What the spec decides, handed over by `cache.native` at import: the node lifecycle
// states' one-byte codes, the `NODE` table's `free` row, and the node table's layout
// sentinels. No state or trigger literal appears in the C++ (tests/test_docs.py checks
// every native source); a kernel used before `configure` refuses to run.
#pragma once

#include <nanobind/nanobind.h>

#include <array>
#include <cstdint>
#include <stdexcept>

namespace blocktrie {

namespace nb = nanobind;

struct SpecTables {
    bool configured = false;
    int root = -1;       // `NodeState.ROOT`'s code: roots are never settled or freed
    int evictable = -1;  // `NodeState.EVICTABLE`'s code: exactly the indexed nodes (invariant 7)
    // The `NODE` table's `free` row as codes: state -> state after `free`, -1 where the
    // spec has no such transition (only `evictable` has one).
    std::array<int, 256> freed_from{};
    // cache.node's layout sentinels.
    int32_t no_node = 0, no_child = 0, many = 0, no_block = 0;
};

inline SpecTables& tables() {
    static SpecTables t;
    return t;
}

inline const SpecTables& spec() {
    const SpecTables& t = tables();
    if (!t.configured) throw std::logic_error("cache._native: configure() was not called");
    return t;
}

inline void configure(int root, int evictable, const nb::dict& freed_from, int32_t no_node,
                      int32_t no_child, int32_t many, int32_t no_block) {
    SpecTables t;
    t.root = root;
    t.evictable = evictable;
    t.freed_from.fill(-1);
    for (auto item : freed_from) {
        int from = nb::cast<int>(item.first);
        int to = nb::cast<int>(item.second);
        if (from < 0 || from > 255 || to < 0 || to > 255) {
            throw std::invalid_argument("configure: state codes are bytes");
        }
        t.freed_from[static_cast<size_t>(from)] = to;
    }
    t.no_node = no_node;
    t.no_child = no_child;
    t.many = many;
    t.no_block = no_block;
    t.configured = true;
    tables() = t;
}

}  // namespace blocktrie
