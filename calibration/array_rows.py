"""The first rows of the arrays in an .npy or .npz file, read without the rest.

numpy reads a file's arrays whole: `np.load(...)[k][:64]` took a 10 GB training set into memory for 64 samples, and a
small zip of zeros that declares a huge array (deflate packs 1000:1) took the machine's memory before the slice. An
.npy file is memory-mapped (numpy's own `mmap_mode`); numpy has no partial read of an .npz member (mmap_mode ignores
archives), so each member's header is read with numpy's public format functions and then only the bytes of the rows
used. Rows that would not fit in memory are refused in one line before they are read.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from optpipe.core.errors import DataError

#: The most of the memory available that one data file's rows may take.
MEMORY_SHARE = 0.5


def npy_rows(path: Path, samples: int) -> np.ndarray:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if not array.ndim:  # one value, no rows: the caller's check of the shapes says so (slicing it had been an IndexError)
        return np.array(array)
    _fits(path.name, array.shape, array.dtype, samples)
    return np.array(array[:samples])  # a copy of those rows only, off the mapped file


def npz_rows(path: Path, samples: int) -> dict[str, np.ndarray]:
    arrays = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.infolist():
            if member.filename.endswith(".npy"):
                arrays[member.filename[:-4]] = _member_rows(archive, member, samples, f"{path.name}:{member.filename}")
    return arrays


def _member_rows(archive: zipfile.ZipFile, member: zipfile.ZipInfo, samples: int, where: str) -> np.ndarray:
    with archive.open(member) as stream:
        version = npy_format.read_magic(stream)
        if version not in ((1, 0), (2, 0)):  # 3.0 (non-Latin-1 field names): numpy's reader, whole
            return _whole(archive, member, samples)
        read = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        shape, fortran_order, dtype = read(stream)
        if dtype.hasobject:
            raise ValueError(f"'{member.filename}' holds Python objects (pickled), which are not read")
        if fortran_order or not shape:  # column-major rows are not contiguous; a 0-d array has none
            _fits(where, shape, dtype, shape[0] if shape else 1)
            return _whole(archive, member, samples)
        rows = min(samples, shape[0])
        _fits(where, shape, dtype, rows)
        count = rows * int(np.prod(shape[1:], dtype=np.int64))
        data = stream.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
        raise ValueError(f"'{member.filename}' ends before the {rows} rows its header declares")
    return np.frombuffer(data, dtype=dtype, count=count).reshape((rows, *shape[1:])).copy()


def _whole(archive: zipfile.ZipFile, member: zipfile.ZipInfo, samples: int) -> np.ndarray:
    """numpy's own reader, for what has no contiguous rows (the caller checked the size from the header it read)."""
    with archive.open(member) as stream:
        array = npy_format.read_array(stream, allow_pickle=False)
    return array[:samples] if array.ndim else array


def _fits(where: str, shape: tuple, dtype: np.dtype, rows: int) -> None:
    from optpipe.safety.memory_estimate import available_bytes

    needed = rows * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
    room = int(available_bytes() * MEMORY_SHARE)
    if needed > room:
        raise DataError(f"data: '{where}' would take {_size(needed)} for {rows} samples of shape {list(shape[1:])} "
                        f"({dtype}), more than half the memory available ({_size(room * 2)}); lower `samples`, or give "
                        "smaller arrays")


def _size(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"
