"""The GPT index builds: document index, sample index and shuffle index, identical to
megatron-core's for the same inputs.

`build_sample_index` is Megatron's C++ `build_sample_idx` done with numpy and no compile step.
Megatron walks the documents sample by sample; here the positions are computed instead. Sample
`i` starts at token `i * sequence_length` of the epoch-concatenated document stream, so the
first sample inside document `k` is a ceiling division of the document's start position
(`add_extra_token_to_sequence`: a sample starting exactly on a boundary belongs to the next
document; without it, to the previous one, at offset = its length). The rows are filled in
chunks of `_CHUNK_DOCUMENTS` documents, so the temporaries stay in cache and only the result is
written to memory.

`build_document_index` and `build_shuffle_index` use `numpy.random.RandomState` exactly as
megatron-core does (same draws in the same order), so their permutations are the same arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_CHUNK_DOCUMENTS = 1 << 16
_CHUNK_ROWS = 1 << 18


def sample_index_dtype(sequence_lengths: np.ndarray, document_index: np.ndarray
                       ) -> np.dtype[Any]:
    """int32 when every document index and offset fits (megatron-core's rule), else int64."""
    largest = max(document_index.shape[0], int(sequence_lengths.max()) if sequence_lengths.size
                  else 0)
    return np.dtype(np.int32 if largest <= np.iinfo(np.int32).max else np.int64)


def num_samples_of(num_tokens: int, sequence_length: int, drop_last_partial_sequence: bool,
                   add_extra_token_to_sequence: bool) -> int:
    """How many samples `num_tokens` make; with a partial last sample, megatron's C++ rounds
    in single precision (`ceil(float(tokens) / seq_length)`), and so does this."""
    usable = num_tokens - int(add_extra_token_to_sequence)
    if drop_last_partial_sequence:
        return usable // sequence_length
    return int(np.ceil(np.float32(usable) / np.float32(sequence_length)))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       sequence_length: int, num_epochs: int, num_tokens_per_epoch: int,
                       drop_last_partial_sequence: bool = True,
                       add_extra_token_to_sequence: bool = True) -> np.ndarray:
    """Megatron's sample index: row `i` is `(position in document_index, token offset)` where
    sample `i` starts; one more row than samples.

    Same arguments, result, dtype (int32 or int64, see `sample_index_dtype`) and edge cases as
    `megatron.core.datasets.helpers.build_sample_idx`.

    Memory: the result plus O(64 Ki) temporaries.
    """
    if sequence_length < 2 or num_epochs < 1 or num_tokens_per_epoch < 2:
        raise ValueError(f"sample index: expected sequence_length >= 2, num_epochs >= 1 and "
                         f"num_tokens_per_epoch >= 2, found {sequence_length}, {num_epochs}, "
                         f"{num_tokens_per_epoch}; the dataset split has too few tokens")
    extra = int(add_extra_token_to_sequence)
    num_tokens = num_epochs * num_tokens_per_epoch
    num_samples = num_samples_of(num_tokens, sequence_length, drop_last_partial_sequence,
                                 add_extra_token_to_sequence)
    # Rows 0..last_full start inside the token stream; later rows (a partial last sample, or
    # single-precision rounding past the end) repeat megatron's end-of-stream row.
    last_full = min(num_samples, (num_tokens - extra) // sequence_length)
    dtype = sample_index_dtype(sequence_lengths, document_index)
    out = np.empty((num_samples + 1, 2), dtype)
    _fill_rows(out, sequence_lengths, document_index, sequence_length, extra, last_full)
    if num_samples > last_full:
        out[last_full + 1:, 0] = document_index.shape[0] - 1
        out[last_full + 1:, 1] = int(sequence_lengths[document_index[-1]]) - extra
    out[0] = 0
    return out


def _fill_rows(out: np.ndarray, sequence_lengths: np.ndarray, document_index: np.ndarray,
               sequence_length: int, extra: int, last_full: int) -> None:
    """Rows 0..last_full of the sample index, document chunk by document chunk."""
    num_documents = document_index.shape[0]
    column_document, column_offset = out[:, 0], out[:, 1]
    starts_buffer = np.empty(_CHUNK_DOCUMENTS + 1, np.int64)
    first_buffer = np.empty(_CHUNK_DOCUMENTS + 1, np.int64)
    lengths_buffer = np.empty(_CHUNK_DOCUMENTS, np.int32)
    end_row = last_full + 1
    carry = 0
    for d0 in range(0, num_documents, _CHUNK_DOCUMENTS):
        m = min(_CHUNK_DOCUMENTS, num_documents - d0)
        starts = starts_buffer[:m + 1]  # token position where documents d0..d0+m start
        starts[0] = carry
        np.take(sequence_lengths, document_index[d0:d0 + m], out=lengths_buffer[:m])
        np.cumsum(lengths_buffer[:m], out=starts[1:])
        starts[1:] += carry
        carry = int(starts[m])
        first = first_buffer[:m + 1]  # first row starting in each document
        if extra:  # ceil(start / L): a sample on a boundary starts the next document
            np.negative(starts, out=first)
            np.floor_divide(first, sequence_length, out=first)
            np.negative(first, out=first)
        else:  # floor(start / L) + 1: a sample on a boundary ends the previous document
            np.floor_divide(starts, sequence_length, out=first)
            first += 1
        if d0 == 0:
            first[0] = 0
        if d0 + m == num_documents:
            first[m] = end_row
        np.minimum(first, end_row, out=first)
        row0, row1 = int(first[0]), int(first[m])
        for r0 in range(row0, row1, _CHUNK_ROWS):
            r1 = min(row1, r0 + _CHUNK_ROWS)
            # the documents covering rows r0..r1 and, per row, which of them it starts in
            lo = int(np.searchsorted(first, r0, side="right")) - 1
            hi = int(np.searchsorted(first, r1, side="left"))
            marks = np.bincount(first[lo + 1:hi] - r0, minlength=r1 - r0 + 1)
            local = np.cumsum(marks[:r1 - r0])
            local += lo
            column_document[r0:r1] = local + d0
            position = np.arange(r0, r1, dtype=np.int64)
            position *= sequence_length
            position -= starts[local]
            column_offset[r0:r1] = position


def build_document_index(documents: np.ndarray, num_epochs: int,
                         random_state: np.random.RandomState, separate_final_epoch: bool
                         ) -> np.ndarray:
    """`num_epochs` copies of `documents`, shuffled (int32); with `separate_final_epoch`, the
    last epoch is shuffled on its own after the others. megatron-core's `_build_document_index`.
    """
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32, copy=False), num_epochs)
        random_state.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, random_state, False)
    last = build_document_index(documents, 1, random_state, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_samples: int, total_size: int,
                        random_state: np.random.RandomState) -> np.ndarray:
    """A permutation of `range(num_samples)` followed by one of `range(num_samples,
    total_size)` (uint32, int64 from 2**32 - 1 samples on). megatron-core's
    `_build_shuffle_index`."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return np.concatenate((first, last))
