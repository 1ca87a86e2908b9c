# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Cython mirror of ``mie.model.inputs.prepare_inputs``, for the fast scheduler's batches.

The reference builds a step's flat arrays with a few NumPy calls per entry: on the 2-core
EPYC 24-27 us for one decode entry and 125-247 us for sixteen, where stories260K's whole
batch-1 step is about 200 us; here 7 us and 6-9 us. It reads each entry's fields, and its fast
``BlockTable``'s C array of block ids and its pool's refcounts, and fills each array in one
pass. The arrays are the reference's, value for value and dtype for dtype
(tests/test_fast_inputs.py). Like the reference it reads the entries by their attributes
(``start``, ``num_tokens``, ``spec_token_ids``, ``seq.token_ids``, ``seq.table``), whichever
scheduler made them: the model layer does not import the scheduler.

Anything the one pass does not take goes to the reference, which computes it or raises its
own error: tables that are not fast ``BlockTable``s or not of one pool and block size,
fields that are not plain ints, and every entry the reference would refuse (a range beyond
the sequence or its table, a released or shared block about to be written, a token outside
int64). So its errors are the reference's, word for word.
"""

cimport numpy as cnp
from libc.stdint cimport int64_t

import numpy as np

from mie._fast.memory cimport BlockPool, BlockTable

from mie.model.inputs import ForwardInputs, PrefillSegment
from mie.model.inputs import prepare_inputs as reference_prepare_inputs

cnp.import_array()

# Token ids the int64 arrays hold (the reference's np.asarray raises beyond them).
cdef object INT64_MIN = -(2**63), INT64_MAX = 2**63 - 1


def prepare_inputs(entries, *, all_positions=False) -> ForwardInputs:
    """``mie.model.inputs.prepare_inputs``: the same arguments, the same inputs, the same
    errors."""
    inputs = _prepared(entries, all_positions)
    if inputs is None:
        return reference_prepare_inputs(entries, all_positions=all_positions)
    return inputs


cdef inline bint _is_token(object token):
    return type(token) is int and INT64_MIN <= token <= INT64_MAX


cdef object _prepared(entries, all_positions):
    """The inputs of ``entries``, or None where the reference must decide (module docstring)."""
    if type(entries) is not list and type(entries) is not tuple or not entries:
        return None
    cdef Py_ssize_t count = len(entries), i, j, p, row, n, start, spec_len, table_len
    cdef list flags
    if type(all_positions) is bool:
        flags = [all_positions] * count
    elif type(all_positions) is list or type(all_positions) is tuple:
        flags = list(all_positions)
        if len(flags) != count:
            return None
    else:
        return None
    cdef BlockTable table
    cdef BlockPool pool = None
    cdef Py_ssize_t block_size = 0, block
    cdef Py_ssize_t rows = 0, logits = 0, decodes = 0, widest = 0
    cdef list fields = []  # per entry: (start, n, tokens, spec, table)

    # 1. everything checked, the arrays' sizes counted
    for i in range(count):
        try:
            entry = entries[i]
            seq = entry.seq
            table_object, start_object, n_object = seq.table, entry.start, entry.num_tokens
            tokens, spec = seq.token_ids, entry.spec_token_ids
        except AttributeError:  # not an entry: the reference names what is missing
            return None
        if type(table_object) is not BlockTable or type(flags[i]) is not bool:
            return None
        if type(start_object) is not int or type(n_object) is not int:
            return None
        if type(tokens) is not list or (type(spec) is not tuple and type(spec) is not list):
            return None
        table = table_object
        if i == 0:
            pool, block_size = table.pool, table.block_size
        elif table.pool is not pool or table.block_size != block_size:
            return None
        if not 0 <= start_object <= table.num_tokens or not 1 <= n_object <= table.num_tokens:
            return None  # (so that no sum below can overflow)
        start, n, spec_len = start_object, n_object, len(spec)
        if spec_len > n or start + n - spec_len > len(tokens) or start + n > table.num_tokens:
            return None
        for j in range(start // block_size, (start + n - 1) // block_size + 1):
            block = table._blocks[j]
            if block < 0 or block >= pool._num_blocks or pool._refcounts[block] != 1:
                return None  # released, or shared: the reference says which
        for p in range(start, start + n - spec_len):
            if not _is_token(tokens[p]):
                return None
        for token in spec:
            if not _is_token(token):
                return None
        fields.append((start, n, tokens, spec, table))
        rows += n
        logits += n if flags[i] else 1
        if n == 1:
            decodes += 1
            widest = max(widest, start // block_size + 1)

    # 2. the arrays, filled entry by entry
    cdef cnp.ndarray token_ids = np.empty(rows, dtype=np.int64)
    cdef cnp.ndarray positions = np.empty(rows, dtype=np.int64)
    cdef cnp.ndarray slot_mapping = np.empty(rows, dtype=np.int64)
    cdef cnp.ndarray logits_rows = np.empty(logits, dtype=np.int64)
    cdef cnp.ndarray decode_rows = np.empty(decodes, dtype=np.int64)
    cdef cnp.ndarray decode_lens = np.empty(decodes, dtype=np.int64)
    cdef cnp.ndarray decode_tables = np.full((decodes, widest), -1, dtype=np.int64)
    cdef int64_t *ids = <int64_t *>cnp.PyArray_DATA(token_ids)
    cdef int64_t *pos = <int64_t *>cnp.PyArray_DATA(positions)
    cdef int64_t *slots = <int64_t *>cnp.PyArray_DATA(slot_mapping)
    cdef int64_t *out_rows = <int64_t *>cnp.PyArray_DATA(logits_rows)
    cdef int64_t *dec_rows = <int64_t *>cnp.PyArray_DATA(decode_rows)
    cdef int64_t *dec_lens = <int64_t *>cnp.PyArray_DATA(decode_lens)
    cdef int64_t *dec_tables = <int64_t *>cnp.PyArray_DATA(decode_tables)
    cdef int64_t *segment_blocks
    cdef cnp.ndarray blocks
    cdef Py_ssize_t logit = 0, decode = 0, position
    cdef list segments = []
    row = 0
    for i in range(count):
        start, n, tokens, spec, table = fields[i]
        spec_len = len(spec)
        for p in range(n - spec_len):
            ids[row + p] = tokens[start + p]
        for p in range(spec_len):
            ids[row + n - spec_len + p] = spec[p]
        for p in range(n):
            position = start + p
            pos[row + p] = position
            slots[row + p] = table._blocks[position // block_size] * block_size + position % block_size
        if flags[i]:
            for p in range(n):
                out_rows[logit + p] = row + p
            logit += n
        else:
            out_rows[logit] = row + n - 1
            logit += 1
        if n == 1:
            dec_rows[decode] = row
            dec_lens[decode] = start + 1
            for j in range(start // block_size + 1):
                dec_tables[decode * widest + j] = table._blocks[j]
            decode += 1
        else:
            table_len = table._num_blocks
            blocks = np.empty(table_len, dtype=np.int64)
            segment_blocks = <int64_t *>cnp.PyArray_DATA(blocks)
            for j in range(table_len):
                segment_blocks[j] = table._blocks[j]
            segments.append(PrefillSegment(slice(row, row + n), blocks, start))
        row += n
    return ForwardInputs(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        decode_rows=decode_rows,
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        prefills=tuple(segments),
        logits_rows=logits_rows,
    )
