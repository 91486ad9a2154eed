// `BlockTrie.commit` past its gate in one native call, for the usual commit
// (cache/attach.py `Attach.commit`, the reference this mirrors step by step): a
// trie without a host tier or an injected key hash, with events off or on the `xxh3`
// scheme, a live sequence with no extra identity whose token ids are uint32.
// Anything else returns False before anything changed, and the Python core runs it.
//
// With events on, each new block's hash is `XXH3_64bits_withSeed(key, parent hash)`
// ([R61]: `cache.block_hash`'s plain `xxh3` chain), computed by the very function
// the `xxhash` package's `xxh3_64_intdigest` calls (its address, found by
// `cache.native` with ctypes), and the stored run recorded as `EventLog.stored`
// records it (`record_stored`; a namespace with a bound LoRA id is left to it).
#pragma once

#include "columns.hpp"
#include "node_table.hpp"
#include "spec_tables.hpp"

namespace blocktrie {

using Xxh3WithSeed = uint64_t (*)(const void*, size_t, uint64_t);

class FastAttach {
public:
    FastAttach(nb::object table, nb::object refs, nb::object free_list, nb::object owner,
               nb::object sequence_type, nb::object typecode, size_t block_size, int cached_code,
               nb::object events, uintptr_t xxh3)
        : events_(std::move(events)), xxh3_(reinterpret_cast<Xxh3WithSeed>(xxh3)), table_(std::move(table)), child_(table_.attr(BT_NAME("child"))), tokens_(table_.attr(BT_NAME("tokens"))),
          block_(table_.attr(BT_NAME("block"))), state_(table_.attr(BT_NAME("state"))), tick_(table_.attr(BT_NAME("tick"))), kids_(table_.attr(BT_NAME("kids"))),
          wide_(table_.attr(BT_NAME("wide"))), refs_(std::move(refs)), free_(std::move(free_list)),
          owner_(std::move(owner)), sequence_type_(std::move(sequence_type)),
          typecode_(std::move(typecode)), width_(nb::cast<size_t>(table_.attr(BT_NAME("width")))),
          block_size_(block_size), cached_code_(cached_code) {
        if (!events_.is_none()) {
            if (xxh3_ == nullptr) throw std::invalid_argument("FastAttach: events on need the xxh3 function");
            // Objects the trie keeps for its life (the column grows in place), read once
            block_hash_ = table_.attr(BT_NAME("block_hash"));
            lora_ids_ = events_.attr(BT_NAME("lora_ids"));
            gpu_view_ = events_.attr(BT_NAME("_gpu_view"));
        }
    }

    // Returns True when the commit is done; False (nothing changed) when the Python
    // core must run it: a sequence that is not live here, a malformed or out-of-range
    // count (the Python core raises), or a request outside the fast path.
    bool commit(nb::handle seq, nb::handle num_tokens, nb::handle trie, nb::handle live,
                nb::handle evictor, nb::handle attach, nb::handle block_pins) {
        const SpecTables& s = spec();
        // [R3]: live in this trie (the Python core names what is wrong otherwise)
        if (Py_TYPE(seq.ptr()) != reinterpret_cast<PyTypeObject*>(sequence_type_.ptr())) return false;
        if (!PyLong_CheckExact(num_tokens.ptr())) return false;
        nb::object serial = seq.attr(BT_NAME("serial"));
        PyObject* registered = PyDict_GetItemWithError(live.ptr(), serial.ptr());
        if (registered != seq.ptr()) {
            if (registered == nullptr && PyErr_Occurred()) throw nb::python_error();
            return false;
        }
        if (!seq.attr(BT_NAME("extra")).is_none()) return false;
        nb::object token_list = seq.attr(BT_NAME("token_list"));
        if (!token_list.attr(BT_NAME("typecode")).equal(typecode_)) return false;
        int overflow = 0;
        const long long n = PyLong_AsLongLongAndOverflow(num_tokens.ptr(), &overflow);
        if (overflow) return false;
        nb::object blocks_obj = seq.attr(BT_NAME("blocks"));
        nb::object path_obj = seq.attr(BT_NAME("path"));
        nb::object keys_obj = seq.attr(BT_NAME("keys"));
        if (!PyList_CheckExact(blocks_obj.ptr()) || !PyList_CheckExact(path_obj.ptr()) ||
            !PyList_CheckExact(keys_obj.ptr())) {
            return false;
        }
        const size_t size = block_size_;
        const long long known = static_cast<long long>(PySequence_Size(token_list.ptr()));
        const long long allocated = static_cast<long long>(PyList_GET_SIZE(blocks_obj.ptr())) * static_cast<long long>(size);
        const long long covered = std::min(known, allocated);
        const long long committed = nb::cast<long long>(seq.attr(BT_NAME("num_committed_tokens")));
        if (!(committed <= n && n <= covered)) return false;  // the Python core refuses it
        const size_t full = static_cast<size_t>(n) / size;
        const size_t start = static_cast<size_t>(PyList_GET_SIZE(path_obj.ptr()));
        // Keys of blocks completed by tokens appended after match (`request_keys`)
        const size_t have = static_cast<size_t>(PyList_GET_SIZE(keys_obj.ptr()));
        // The keys this commit attaches must be plain bytes of the table's width (a
        // trie with an injected key hash, or a wide key, is the Python core's); those
        // made below from the token ids are.
        for (size_t j = start; j < std::min(have, full); ++j) {
            PyObject* key = PyList_GET_ITEM(keys_obj.ptr(), static_cast<Py_ssize_t>(j));
            if (!PyBytes_CheckExact(key) || static_cast<size_t>(PyBytes_GET_SIZE(key)) != width_) return false;
        }
        if (have < full) {
            Column<uint32_t> ids(token_list, "token_list");
            const char* raw = reinterpret_cast<const char*>(ids.data());
            for (size_t j = have; j < full; ++j) {
                nb::object key = nb::steal(PyBytes_FromStringAndSize(raw + j * width_, static_cast<Py_ssize_t>(width_)));
                if (!key.is_valid() || PyList_Append(keys_obj.ptr(), key.ptr()) != 0) throw nb::python_error();
            }
        }
        // [R7]: the clock ticks on every commit
        nb::object tick = trie.attr(BT_NAME("_clock")) + nb::int_(1);
        trie.attr(BT_NAME("_clock")) = tick;
        if (start >= full) {
            seq.attr(BT_NAME("num_committed_tokens")) = num_tokens;
            return true;
        }
        int32_t parent;
        if (start > 0) {
            parent = nb::cast<int32_t>(nb::handle(PyList_GET_ITEM(path_obj.ptr(), static_cast<Py_ssize_t>(start - 1))));
        } else {
            parent = nb::cast<int32_t>(attach.attr(BT_NAME("namespace_root"))(seq.attr(BT_NAME("namespace"))));  // [R11]
        }
        std::vector<int32_t> blocks = from_list(blocks_obj, "blocks");
        for (size_t i = start; i < full; ++i) {
            PyObject* key = PyList_GET_ITEM(keys_obj.ptr(), static_cast<Py_ssize_t>(i));
            int32_t child = found_child(parent, key);
            if (child < 0) {  // [R19]: this block and every later one are new
                attach_new(parent, keys_obj, i, full, blocks_obj, tick, path_obj, evictor, attach,
                           seq, block_pins);
                break;
            }
            int32_t cached;
            {
                Column<int32_t> block(block_, "block");
                cached = block[static_cast<size_t>(child)];
            }
            if (cached == s.no_block) throw std::logic_error("commit: an offloaded node without a host tier");
            // [R18]: deduplicated; the request switches to the cached block
            const int32_t own = blocks[i];
            IntList refs(refs_, "refs");
            const int64_t ccount = refs.get(static_cast<size_t>(cached));
            const int64_t ocount = refs.get(static_cast<size_t>(own));
            if (ccount <= 0 || ocount <= 0) throw std::logic_error("commit: a held block is free");
            refs.set(static_cast<size_t>(cached), ccount + 1);
            PyList_SetItem(blocks_obj.ptr(), static_cast<Py_ssize_t>(i), PyLong_FromLong(cached));
            blocks[i] = cached;
            refs.set(static_cast<size_t>(own), ocount - 1);
            if (ocount == 1) extend_array(free_, {own});
            evictor.attr(BT_NAME("settle"))(child);
            IntList ticks(tick_, "tick");
            ticks.set_object(static_cast<size_t>(child), tick.ptr());  // [R8]
            nb::object child_obj = nb::int_(child);
            if (PyList_Append(path_obj.ptr(), child_obj.ptr()) != 0) throw nb::python_error();
            parent = child;
        }
        seq.attr(BT_NAME("num_committed_tokens")) = num_tokens;
        return true;
    }

private:
    // `NodeTable.child_of(parent, key)` for a plain key: the child or -1.
    int32_t found_child(int32_t parent, PyObject* key) {
        const SpecTables& s = spec();
        int32_t child;
        {
            Column<int32_t> only(child_, "child");
            child = only[static_cast<size_t>(parent)];
        }
        if (child >= 0) {
            if (PyDict_GET_SIZE(wide_.ptr()) > 0) {
                nb::object id = nb::int_(child);
                int in_wide = PyDict_Contains(wide_.ptr(), id.ptr());
                if (in_wide < 0) throw nb::python_error();
                if (in_wide) return -1;  // a wide key never equals a plain one
            }
            Column<uint8_t> tokens(tokens_, "tokens");
            return holds(tokens, child, key, width_) ? child : -1;
        }
        if (child != s.many) return -1;
        nb::object id = nb::int_(parent);
        PyObject* kids = PyDict_GetItemWithError(kids_.ptr(), id.ptr());
        if (kids == nullptr) {
            if (PyErr_Occurred()) throw nb::python_error();
            throw std::logic_error("commit: a node with many children has no kids dict");
        }
        PyObject* found = PyDict_GetItemWithError(kids, key);
        if (found == nullptr) {
            if (PyErr_Occurred()) throw nb::python_error();
            return -1;
        }
        return static_cast<int32_t>(PyLong_AsLong(found));
    }

    // `Attach._attach_chain` (and, events on, `EventLog.chain_hashes` and the stored
    // run): blocks start..stop-1 as a chain of new nodes under `parent`, linked in, on
    // the request's path.
    void attach_new(int32_t parent, nb::handle keys, size_t start, size_t stop, nb::handle blocks_obj,
                    nb::handle tick, nb::handle path_obj, nb::handle evictor, nb::handle attach,
                    nb::handle seq, nb::handle block_pins) {
        const SpecTables& s = spec();
        // [R61] the chain's hashes first (events on), parent first
        std::vector<uint64_t> hashes;
        uint64_t parent_hash = 0;
        if (!events_.is_none()) {
            Column<uint64_t> block_hash(block_hash_, "block_hash");
            parent_hash = block_hash[static_cast<size_t>(parent)];
            uint64_t h = parent_hash;
            for (size_t i = start; i < stop; ++i) {
                PyObject* key = PyList_GET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(i));
                h = xxh3_(PyBytes_AS_STRING(key), static_cast<size_t>(PyBytes_GET_SIZE(key)), h);
                hashes.push_back(h);
            }
        }
        nb::object chain = nb::steal(PyList_GetSlice(blocks_obj.ptr(), static_cast<Py_ssize_t>(start),
                                                     static_cast<Py_ssize_t>(stop)));
        if (!chain.is_valid()) throw nb::python_error();
        const int64_t serial = nb::cast<int64_t>(attach.attr(BT_NAME("_node_serial")));
        nb::object rows = attach_chain(table_, parent, keys, start, chain, serial + 1, tick,
                                       cached_code_, owner_, refs_);
        if (rows.is_none()) throw std::logic_error("commit: a plain key was refused");
        const int32_t first = nb::cast<int32_t>(rows[0]);
        // `NodeTable.attach_child(parent, keys[start], first)`
        int32_t only;
        {
            Column<int32_t> child(child_, "child");
            only = child[static_cast<size_t>(parent)];
            if (only == s.no_child) child[static_cast<size_t>(parent)] = first;
        }
        if (only == s.many) {
            nb::object id = nb::int_(parent);
            PyObject* kids = PyDict_GetItemWithError(kids_.ptr(), id.ptr());
            if (kids == nullptr) {
                if (PyErr_Occurred()) throw nb::python_error();
                throw std::logic_error("commit: a node with many children has no kids dict");
            }
            PyObject* key = PyList_GET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(start));
            if (PyDict_SetItem(kids, key, rows[0].ptr()) != 0) throw nb::python_error();
        } else if (only >= 0) {
            table_.attr(BT_NAME("attach_child"))(parent, nb::handle(PyList_GET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(start))), first);
        }
        const int64_t count = static_cast<int64_t>(stop - start);
        attach.attr(BT_NAME("_node_serial")) = nb::int_(serial + count);
        evictor.attr(BT_NAME("num_cached")) = evictor.attr(BT_NAME("num_cached")) + nb::int_(count);
        nb::object extended = nb::steal(PySequence_InPlaceConcat(path_obj.ptr(), rows.ptr()));
        if (!extended.is_valid()) throw nb::python_error();
        if (events_.is_none()) return;
        // The nodes' hashes, then what `Attach.commit` records: the pins' index ([R66])
        // and the stored run (`EventLog.stored`), whose hashes are one `bytes` of native
        // uint64s (`cache.event_log.packed_hashes`): no `int` per block unless the pins
        // index them
        nb::object packed = nb::steal(PyBytes_FromStringAndSize(
            reinterpret_cast<const char*>(hashes.data()), static_cast<Py_ssize_t>(hashes.size() * sizeof(uint64_t))));
        if (!packed.is_valid()) throw nb::python_error();
        bool under_root;
        {
            Column<uint64_t> block_hash(block_hash_, "block_hash");
            Column<uint8_t> state(state_, "state");
            for (size_t j = 0; j < hashes.size(); ++j) {
                const long row = PyLong_AsLong(PyList_GET_ITEM(rows.ptr(), static_cast<Py_ssize_t>(j)));
                block_hash[static_cast<size_t>(row)] = hashes[j];
            }
            under_root = state[static_cast<size_t>(parent)] == s.root;
        }
        nb::object space = seq.attr(BT_NAME("namespace"));
        if (nb::cast<bool>(block_pins.attr(BT_NAME("indexing")))) {
            nb::object hash_list = nb::steal(PyList_New(static_cast<Py_ssize_t>(hashes.size())));
            if (!hash_list.is_valid()) throw nb::python_error();
            for (size_t j = 0; j < hashes.size(); ++j) {
                PyObject* h = PyLong_FromUnsignedLongLong(hashes[j]);
                if (h == nullptr) throw nb::python_error();
                PyList_SET_ITEM(hash_list.ptr(), static_cast<Py_ssize_t>(j), h);
            }
            block_pins.attr(BT_NAME("added"))(space, hash_list, rows);
        }
        nb::object parent_hash_obj = under_root ? nb::none() : nb::object(nb::int_(parent_hash));
        record_stored(parent_hash_obj, packed, keys, blocks_obj, start, stop, space);
    }

    // [R61] `EventLog.stored` for a chain of plain keys (every key here is: the chain
    // was attached), recording what it records: the stored run `(parent hash, hashes
    // packed, the keys' bytes joined, the blocks, the block size, the namespace)` appended to
    // the log, and its blocks added to the log's replay bitmap (`BlockBitmap.update`).
    // A namespace with a bound LoRA id (an event built now) is the Python `stored`'s,
    // a block past the bitmap's bytes the Python `update`'s.
    void record_stored(nb::handle parent_hash, nb::handle packed, nb::handle keys, nb::handle blocks_obj,
                       size_t start, size_t stop, nb::handle space) {
        if (!PyObject_IsTrue(events_.attr(BT_NAME("enabled")).ptr())) return;  // muted
        int bound = 1;  // not a dict: the Python `stored` decides
        if (PyDict_CheckExact(lora_ids_.ptr())) {
            bound = PyDict_GET_SIZE(lora_ids_.ptr()) == 0 ? 0 : PyDict_Contains(lora_ids_.ptr(), space.ptr());
            if (bound < 0) throw nb::python_error();
        }
        if (bound) {
            events_.attr(BT_NAME("stored"))(parent_hash, packed, keys, blocks_obj, start, stop, block_size_, space);
            return;
        }
        const size_t count = stop - start;
        nb::object tokens = nb::steal(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(count * width_)));
        if (!tokens.is_valid()) throw nb::python_error();
        char* out = PyBytes_AS_STRING(tokens.ptr());
        for (size_t j = 0; j < count; ++j) {
            PyObject* key = PyList_GET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(start + j));
            std::memcpy(out + j * width_, PyBytes_AS_STRING(key), width_);
        }
        nb::object stored = nb::steal(PyList_GetSlice(blocks_obj.ptr(), static_cast<Py_ssize_t>(start),
                                                      static_cast<Py_ssize_t>(stop)));
        if (!stored.is_valid()) throw nb::python_error();
        nb::object run = nb::make_tuple(parent_hash, packed, tokens, stored, nb::int_(block_size_), space);
        nb::object log = events_.attr(BT_NAME("_events"));
        if (!PyList_CheckExact(log.ptr())) throw std::logic_error("commit: the event log's records are not a list");
        nb::object bits = gpu_view_.attr(BT_NAME("_bits"));
        bool inside = PyByteArray_CheckExact(bits.ptr());
        const size_t size = inside ? static_cast<size_t>(PyByteArray_GET_SIZE(bits.ptr())) : 0;
        for (size_t j = 0; inside && j < count; ++j) {
            const long b = PyLong_AsLong(PyList_GET_ITEM(stored.ptr(), static_cast<Py_ssize_t>(j)));
            inside = b >= 0 && static_cast<size_t>(b) < size;
        }
        if (PyList_Append(log.ptr(), run.ptr()) != 0) throw nb::python_error();
        if (!inside) {
            gpu_view_.attr(BT_NAME("update"))(stored);
            return;
        }
        char* set = PyByteArray_AS_STRING(bits.ptr());
        for (size_t j = 0; j < count; ++j) {
            set[PyLong_AsLong(PyList_GET_ITEM(stored.ptr(), static_cast<Py_ssize_t>(j)))] = 1;
        }
    }

    nb::object events_;  // the trie's `EventLog` with events on, else None
    nb::object block_hash_, lora_ids_, gpu_view_;  // with events on: its table's hash column, its bound
                                                   // LoRA ids, its replay bitmap
    Xxh3WithSeed xxh3_;
    nb::object table_, child_, tokens_, block_, state_, tick_, kids_, wide_, refs_, free_, owner_;
    nb::object sequence_type_, typecode_;
    size_t width_, block_size_;
    int cached_code_;
};

}  // namespace blocktrie
