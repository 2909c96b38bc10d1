"""`BatchLayout`: where each field of a batch lies in a flat slab of bytes.

A batch of a `GPTDataset` or `BlendedDataset` has fixed fields (tokens, labels, masks, ...) of
fixed shapes, so it can be written into preallocated memory by whoever assembles it (a worker
process, an executor thread) and read back as tensors without a copy. Every field starts on a
64-byte boundary and a slab is a whole number of pages.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FIELD_ALIGNMENT = 64


@dataclass(frozen=True, slots=True)
class Field:
    """One array of a batch: `dtype` and `shape` (batch first), at `offset` in the slab."""

    key: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class BatchLayout:
    """The fields of one batch of `micro_batch_size` samples of `dataset` in a slab of
    `slab_bytes`; a mask that every sample shares stays one tensor, expanded, not stored."""

    def __init__(self, dataset: Any, micro_batch_size: int) -> None:
        self.micro_batch_size = micro_batch_size
        self.fields: list[Field] = []
        offset = 0
        for key, dtype, shape in dataset.batch_fields():
            field = Field(key, np.dtype(dtype), (micro_batch_size, *shape), offset)
            self.fields.append(field)
            offset += -(-field.nbytes // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
        self.slab_bytes = max(mmap.PAGESIZE, -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE)
        mask = dataset.shared_attention_mask
        self.shared_mask = (None if mask is None
                            else mask.unsqueeze(0).expand(micro_batch_size, *mask.shape))
        # the keys in the order of the sample dict: the shared mask sits after the labels
        self.keys = [f.key for f in self.fields]
        if self.shared_mask is not None:
            self.keys.insert(self.keys.index("labels") + 1, "attention_mask")

    @staticmethod
    def supports(dataset: Any) -> bool:
        """Whether `dataset` writes whole batches (`GPTDataset`, `BlendedDataset`)."""
        return all(hasattr(dataset, name) for name in (
            "batch_fields", "locate_batch", "token_ranges", "write_samples"))

    def arrays(self, buffer: Any, offset: int = 0) -> dict[str, np.ndarray]:
        """Writable numpy views of the fields of the slab at `offset` in `buffer`."""
        return {f.key: np.frombuffer(buffer, f.dtype, int(np.prod(f.shape)), offset + f.offset)
                .reshape(f.shape) for f in self.fields}

    def field_tensors(self, slab: np.ndarray) -> dict[str, torch.Tensor]:
        """The fields of the batch in `slab` (a uint8 array) as tensors sharing its memory;
        each keeps `slab`'s buffer alive. Made through numpy views: a torch op (`view`,
        `reshape`) gives up the GIL, which a busy trainer thread then holds for up to a switch
        interval."""
        return {key: torch.from_numpy(array) for key, array in self.arrays(slab).items()}

    def batch(self, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch of `field_tensors`, keyed as the sample dict (the shared mask added)."""
        if self.shared_mask is not None:
            fields["attention_mask"] = self.shared_mask
        return {key: fields[key] for key in self.keys}
