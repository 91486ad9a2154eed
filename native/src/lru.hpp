// `NodeLRU`: the eviction index of one trie's nodes, ordered by `(tick, serial)`
// ([R10]), oldest first; the native twin of `cache.lru.LRUIndex` over node ids, with
// its Python API (`add`, `remove`, `oldest`, `in`, `len`, ordered and unordered
// iteration), so the Python core's modules use either.
//
// Layout: an indexed binary min-heap of (tick, serial, node) and each member's
// position in it, in a hash map: memory for the members only (the evictable nodes,
// mostly leaves, far fewer than the table's rows), none per row of the table. `serial` is unique per node, so the order is total
// and equals `LRUIndex`'s: equal ticks go oldest-created first. A node's tick is read
// from the node table when it is added and must not change while it is indexed (the
// rule `LRUIndex` states).
#pragma once

#include "columns.hpp"

#include <algorithm>
#include <tuple>
#include <unordered_map>

namespace blocktrie {

class NodeLRU {
public:
    struct Entry {
        int64_t tick;
        int64_t serial;
        int32_t node;
    };

    NodeLRU(nb::object ticks, nb::object serials) : ticks_(std::move(ticks)), serials_(std::move(serials)) {
        IntList check(ticks_, "tick");
        (void)check;
    }

    size_t size() const { return heap_.size(); }

    bool contains(int64_t node) const {
        return node >= 0 && node <= INT32_MAX && pos_.count(static_cast<int32_t>(node)) > 0;
    }

    // Insert `node` (must not be present: `ValueError`), at the tick and serial its
    // row holds now.
    void add(int32_t node) {
        if (node < 0) throw std::invalid_argument("NodeLRU.add: a node id is >= 0");
        if (contains(node)) throw std::invalid_argument("NodeLRU.add: node already indexed");
        IntList ticks(ticks_, "tick");
        Column<int64_t> serials(serials_, "serial");
        if (static_cast<size_t>(node) >= ticks.size() || static_cast<size_t>(node) >= serials.size()) {
            throw std::out_of_range("NodeLRU.add: no such node row");
        }
        insert(Entry{ticks.get(static_cast<size_t>(node)), serials[static_cast<size_t>(node)], node});
    }

    // Insert with the tick and serial known (a kernel that just read them).
    void insert(const Entry& e) {
        heap_.push_back(e);
        pos_[e.node] = static_cast<int32_t>(heap_.size() - 1);
        up(heap_.size() - 1);
    }

    // Remove `node`; `false` when it is not indexed.
    bool discard(int32_t node) {
        auto it = pos_.find(node);
        if (it == pos_.end()) return false;
        const size_t i = static_cast<size_t>(it->second);
        pos_.erase(it);
        Entry last = heap_.back();
        heap_.pop_back();
        if (i < heap_.size()) {
            heap_[i] = last;
            pos_[last.node] = static_cast<int32_t>(i);
            if (!up(i)) down(i);
        }
        return true;
    }

    const Entry& top() const {
        if (heap_.empty()) throw std::out_of_range("NodeLRU.oldest: the index is empty");
        return heap_.front();
    }

    // Members, oldest first (sorts a copy: for inspection).
    std::vector<int32_t> ordered() const {
        std::vector<Entry> all(heap_);
        std::sort(all.begin(), all.end(), less);
        std::vector<int32_t> out;
        out.reserve(all.size());
        for (const Entry& e : all) out.push_back(e.node);
        return out;
    }

    std::vector<int32_t> unordered() const {
        std::vector<int32_t> out;
        out.reserve(heap_.size());
        for (const Entry& e : heap_) out.push_back(e.node);
        return out;
    }

    static bool less(const Entry& a, const Entry& b) {
        return std::tie(a.tick, a.serial) < std::tie(b.tick, b.serial);
    }

private:
    bool up(size_t i) {
        bool moved = false;
        while (i > 0) {
            size_t parent = (i - 1) / 2;
            if (!less(heap_[i], heap_[parent])) break;
            swap(i, parent);
            i = parent;
            moved = true;
        }
        return moved;
    }

    void down(size_t i) {
        const size_t n = heap_.size();
        while (true) {
            size_t l = 2 * i + 1, r = l + 1, m = i;
            if (l < n && less(heap_[l], heap_[m])) m = l;
            if (r < n && less(heap_[r], heap_[m])) m = r;
            if (m == i) return;
            swap(i, m);
            i = m;
        }
    }

    void swap(size_t i, size_t j) {
        std::swap(heap_[i], heap_[j]);
        pos_[heap_[i].node] = static_cast<int32_t>(i);
        pos_[heap_[j].node] = static_cast<int32_t>(j);
    }

    nb::object ticks_;    // the node table's `tick` list
    nb::object serials_;  // the node table's `serial` array('q')
    std::vector<Entry> heap_;
    std::unordered_map<int32_t, int32_t> pos_;  // member -> its position in `heap_`
};

}  // namespace blocktrie
