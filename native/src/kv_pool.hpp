// The KV pool's per-block loops (cache/kv_pool.py `KVBlockPool`): reference counts
// are the pool's `refs` list, the free list its `array('i')` stack. Each kernel is
// all or nothing: it checks every block before it changes a count ([R6]), and
// returns the index of the first refused block (-1: done) so the Python pool raises
// its own `CacheError`, naming the block.
#pragma once

#include "columns.hpp"

namespace blocktrie {

// A block id as an index into `refs`, or -1 (refused) for any id outside the pool:
// a negative one (NO_BLOCK included: no negative id counts against a block from the
// pool's end) or one past its last entry.
inline int64_t slot(int32_t block, size_t n) {
    return (block < 0 || static_cast<size_t>(block) >= n) ? -1 : block;
}

// `KVBlockPool.incref_all`: one more reference on each block; every block must be
// in use (count > 0). On a refusal the references already added are taken back.
inline int64_t incref_all(nb::handle refs_obj, nb::handle blocks_obj) {
    IntList refs(refs_obj, "refs");
    std::vector<int32_t> blocks = from_list(blocks_obj, "blocks");
    const size_t n = refs.size();
    for (size_t i = 0; i < blocks.size(); ++i) {
        int64_t b = slot(blocks[i], n);
        int64_t count = b < 0 ? 0 : refs.get(static_cast<size_t>(b));
        if (count <= 0) {
            for (size_t j = 0; j < i; ++j) {
                size_t d = static_cast<size_t>(slot(blocks[j], n));
                refs.set(d, refs.get(d) - 1);
            }
            return static_cast<int64_t>(i);
        }
        refs.set(static_cast<size_t>(b), count + 1);
    }
    return -1;
}

// `KVBlockPool.decref_all`: one reference less on each block; a block whose count
// reaches 0 goes on the free list, in order. A count that would go below zero (a
// double free) refuses the call, after the references already dropped are restored.
inline int64_t decref_all(nb::handle refs_obj, nb::handle free_obj, nb::handle blocks_obj) {
    IntList refs(refs_obj, "refs");
    std::vector<int32_t> blocks = from_list(blocks_obj, "blocks");
    const size_t n = refs.size();
    std::vector<int32_t> freed;
    for (size_t i = 0; i < blocks.size(); ++i) {
        int64_t b = slot(blocks[i], n);
        int64_t count = b < 0 ? 0 : refs.get(static_cast<size_t>(b));
        if (count <= 0) {
            for (size_t j = 0; j < i; ++j) {
                size_t d = static_cast<size_t>(slot(blocks[j], n));
                refs.set(d, refs.get(d) + 1);
            }
            return static_cast<int64_t>(i);
        }
        refs.set(static_cast<size_t>(b), count - 1);
        if (count == 1) freed.push_back(blocks[i]);
    }
    extend_array(free_obj, freed);
    return -1;
}

// `KVBlockPool.take`'s loop: the last `count` free blocks (the stack's top first),
// each with reference count 1. The caller checked that there are enough; a free
// block outside the pool is refused before anything changes.
inline nb::list take(nb::handle refs_obj, nb::handle free_obj, size_t count) {
    std::vector<int32_t> taken;
    IntList refs(refs_obj, "refs");
    {
        Column<int32_t> free_list(free_obj, "free_list");
        if (count > free_list.size()) throw std::invalid_argument("take: not enough free blocks");
        taken.reserve(count);
        for (size_t i = 0; i < count; ++i) taken.push_back(free_list[free_list.size() - 1 - i]);
    }
    for (int32_t b : taken) {
        if (b < 0 || static_cast<size_t>(b) >= refs.size()) throw std::out_of_range("take: a free block outside the pool");
    }
    Py_ssize_t len = PySequence_Size(free_obj.ptr());
    if (PySequence_DelSlice(free_obj.ptr(), len - static_cast<Py_ssize_t>(count), len) != 0) {
        throw nb::python_error();
    }
    PyObject* one = PyLong_FromLong(1);
    for (int32_t b : taken) refs.set_object(static_cast<size_t>(b), one);
    Py_DECREF(one);
    return to_list(taken);
}

}  // namespace blocktrie
