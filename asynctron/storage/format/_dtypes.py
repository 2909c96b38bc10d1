"""The dtypes a checkpoint may hold, by the name the manifest stores.

A closed table: a manifest naming anything else is corrupt, and saving anything else is a
TypeError, so loading never turns an arbitrary string into an attribute lookup.
"""

from __future__ import annotations

import numpy as np
import torch

_TORCH_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "complex64", "complex128",
)  # fmt: skip

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in _TORCH_NAMES}
#: torch dtype -> its manifest name (the inverse of `TORCH_DTYPES`).
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}

#: numpy dtypes stored as ndarray items: name -> the torch dtype with the same bytes.
NUMPY_DTYPES: dict[str, torch.dtype] = {
    np.dtype(name).name: TORCH_DTYPES[name]
    for name in ("float64", "float32", "float16", "int8", "int16", "int32", "int64",
                 "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128")
}  # fmt: skip


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The manifest name of `dtype`; TypeError naming `key` for dtypes we cannot store."""
    try:
        return TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"tensor at key {key!r}: dtype {dtype} cannot be saved; expected one of "
            f"{sorted(TORCH_DTYPES)}"
        ) from None


def numpy_dtype_name(dtype: np.dtype, key: str) -> str:
    """The manifest name of a numpy dtype (native byte order only); TypeError naming `key`."""
    if dtype.byteorder == ">" or dtype.name not in NUMPY_DTYPES:
        raise TypeError(
            f"ndarray at key {key!r}: dtype {dtype.str!r} cannot be saved; expected a "
            f"native-endian one of {sorted(NUMPY_DTYPES)}"
        )
    return dtype.name
