// `BlockTrie.release` and `BlockTrie.allocate` past their gate in one native call each,
// for the usual request (cache/trie.py, the reference these mirror step by step): a
// trie without a host tier or checkpoints anchored, a live sequence with no pins or
// host-resident hit, and (allocate) room already free. Anything else returns False
// before anything changed, and the Python core runs the operation.
#pragma once

#include "columns.hpp"
#include "eviction.hpp"
#include "kv_pool.hpp"
#include "lru.hpp"
#include "spec_tables.hpp"

namespace blocktrie {

class FastTrie {
public:
    FastTrie(nb::object table, nb::object refs, nb::object free_list, nb::object sequence_type,
             nb::object settled, nb::object faults, nb::object fault_point, size_t block_size)
        : child_(table.attr(BT_NAME("child"))), block_(table.attr(BT_NAME("block"))), state_(table.attr(BT_NAME("state"))),
          tick_(table.attr(BT_NAME("tick"))), serial_(table.attr(BT_NAME("serial"))), checkpoint_(table.attr(BT_NAME("checkpoint"))),
          refs_(std::move(refs)), free_(std::move(free_list)), sequence_type_(std::move(sequence_type)),
          settled_(std::move(settled)), faults_(std::move(faults)), fault_point_(std::move(fault_point)),
          block_size_(block_size) {}

    // [R20] `release`: the path's ticks ([R8]), the request's references dropped, its
    // deepest node settled (the others keep a child), the sequence retired.
    bool release(nb::handle seq, nb::handle trie, nb::handle live, NodeLRU& index, nb::handle evictor) {
        if (!is_live(seq, live)) return false;
        if (!seq.attr(BT_NAME("match_receipt")).is_none() || PyObject_IsTrue(seq.attr(BT_NAME("host_path")).ptr())) return false;
        nb::object tick = trie.attr(BT_NAME("_clock")) + nb::int_(1);
        trie.attr(BT_NAME("_clock")) = tick;
        nb::object path_obj = seq.attr(BT_NAME("path"));
        std::vector<int32_t> path = from_list(path_obj, "path");
        {
            IntList ticks(tick_, "tick");
            for (int32_t node : path) {
                if (node < 0 || static_cast<size_t>(node) >= ticks.size()) throw std::out_of_range("release: no such node");
            }
            for (int32_t node : path) ticks.set_object(static_cast<size_t>(node), tick.ptr());
        }
        nb::object loads = seq.attr(BT_NAME("loads"));
        if (PyList_Check(loads.ptr()) && PyList_GET_SIZE(loads.ptr()) > 0) seq.attr(BT_NAME("loads")) = nb::list();
        const int64_t bad = decref_all(refs_, free_, seq.attr(BT_NAME("blocks")));
        if (bad >= 0) throw std::logic_error("release: a held block was free");
        if (!path.empty()) settle(path.back(), index, evictor);
        seq.attr(BT_NAME("live")) = false;
        nb::object serial = seq.attr(BT_NAME("serial"));
        if (PyDict_DelItem(live.ptr(), serial.ptr()) != 0) throw nb::python_error();
        return true;
    }

    // [R15] `allocate`: blocks for `tokens[:num_tokens]` taken from the free list when
    // there are enough free (else the Python core makes room first).
    bool allocate(nb::handle seq, nb::handle num_tokens, nb::handle live) {
        if (!PyLong_CheckExact(num_tokens.ptr()) || !is_live(seq, live)) return false;
        int overflow = 0;
        const long long n = PyLong_AsLongLongAndOverflow(num_tokens.ptr(), &overflow);
        nb::object token_list = seq.attr(BT_NAME("token_list"));
        const long long known = static_cast<long long>(PySequence_Size(token_list.ptr()));
        if (overflow || n < 0 || n > known) return false;  // the Python core refuses it
        nb::object blocks = seq.attr(BT_NAME("blocks"));
        const long long size = static_cast<long long>(block_size_);
        const long long need = (n + size - 1) / size - static_cast<long long>(PyList_GET_SIZE(blocks.ptr()));
        if (PyObject_IsTrue(seq.attr(BT_NAME("host_path")).ptr()) || PyObject_IsTrue(seq.attr(BT_NAME("load_failed")).ptr())) {
            return false;
        }
        if (need <= 0) return true;
        if (need > static_cast<long long>(PySequence_Size(free_.ptr()))) return false;  // make room first
        if (!faults_.attr(BT_NAME("_countdown")).is_none()) return false;  // a fault is armed: the Python core
        faults_.attr(BT_NAME("_recent")).attr(BT_NAME("append"))(fault_point_);     // `Faults.check`, not armed
        faults_.attr(BT_NAME("count")) = faults_.attr(BT_NAME("count")) + nb::int_(1);
        nb::list taken = take(refs_, free_, static_cast<size_t>(need));
        nb::object extended = nb::steal(PySequence_InPlaceConcat(blocks.ptr(), taken.ptr()));
        if (!extended.is_valid()) throw nb::python_error();
        return true;
    }

private:
    bool is_live(nb::handle seq, nb::handle live) {
        if (Py_TYPE(seq.ptr()) != reinterpret_cast<PyTypeObject*>(sequence_type_.ptr())) return false;
        nb::object serial = seq.attr(BT_NAME("serial"));
        PyObject* registered = PyDict_GetItemWithError(live.ptr(), serial.ptr());
        if (registered == nullptr && PyErr_Occurred()) throw nb::python_error();
        return registered == seq.ptr();
    }

    // `Evictor.settle` for a device node with no checkpoint (no host tier): its new
    // state from the memo of the spec's routes, or from the Python core on a miss.
    void settle(int32_t node, NodeLRU& index, nb::handle evictor) {
        const SpecTables& s = spec();
        const size_t row = static_cast<size_t>(node);
        int state_now, dest = -1;
        int32_t block;
        bool leaf;
        {
            Column<uint8_t> state(state_, "state");
            Column<int32_t> child(child_, "child");
            Column<int32_t> blocks(block_, "block");
            state_now = state[row];
            leaf = child[row] == s.no_child;
            block = blocks[row];
        }
        if (state_now == s.root) return;
        if (block != s.no_block && PyDict_GET_SIZE(checkpoint_.ptr()) == 0) {
            IntList refs(refs_, "refs");
            dest = settled_lookup(settled_, state_now, leaf, refs.get(static_cast<size_t>(block)));
        }
        if (dest < 0) {
            evictor.attr(BT_NAME("settle"))(node);  // derives (and memoizes) or refuses
            return;
        }
        if (dest == state_now) return;
        Column<uint8_t> state(state_, "state");
        IntList ticks(tick_, "tick");
        Column<int64_t> serials(serial_, "serial");
        enter(index, state, node, state_now, dest, ticks.get(row), serials[row]);
    }

    nb::object child_, block_, state_, tick_, serial_, checkpoint_, refs_, free_;
    nb::object sequence_type_, settled_, faults_, fault_point_;
    size_t block_size_;
};

}  // namespace blocktrie
