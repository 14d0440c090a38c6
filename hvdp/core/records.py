"""Records of TFRecord files by position: an index that makes a dataset too large for memory indexable.

A TFRecord file is a sequence of records, each framed as
    uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data.
Walking the frames reads 12 bytes per record (a seek past each record's data), so indexing a terabyte of
records costs about 3 s per million records (measured here), not a read of the data. With every record's
offset known, the epoch order of hvdp.core.sharding applies to records exactly as to samples in memory, and a
rank reads only its own records (one pread each).

The length's CRC is checked while indexing, so a file that is not a TFRecord file, or is compressed or
truncated, is refused with its path and the byte where it goes wrong. The data's CRC is not checked when a
record is read by position (that would cost a pass over every byte in Python); a record corrupted inside its
data reaches the user's parse function as it is.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from hvdp.core.errors import DataError

_HEADER = 12  # length (8) + its masked CRC (4)
_FOOTER = 4  # the data's masked CRC


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C (Castagnoli) of `data`: rotate right by 15 bits, add 0xa282ead8."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One record framed as a TFRecord file holds it (what tf.io.TFRecordWriter writes)."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


def record_frames(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The byte offset of every record's frame in the TFRecord file `path`, and its data's length, in file order.

    Raises:
        DataError: the file cannot be read, is compressed (gzip or zlib), or its frames do not tile it (not
            a TFRecord file, or truncated): the message names the path and the offset.
    """
    offsets, lengths = [], []
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            pos = 0
            while pos < size:
                header = f.read(_HEADER)
                if len(header) < _HEADER:
                    raise DataError(f"{path}: truncated at byte {pos}: a record header needs {_HEADER} bytes, "
                                    f"the file has {size - pos} left; rewrite the file")
                length, crc = struct.unpack("<QI", header)
                if crc != masked_crc32c(header[:8]):
                    hint = ("it is compressed (gzip/zlib): write the records uncompressed to read them by position"
                            if pos == 0 and header[:2] in (b"\x1f\x8b", b"\x78\x01", b"\x78\x9c", b"\x78\xda")
                            else "not a TFRecord file, or corrupt")
                    raise DataError(f"{path}: the record header at byte {pos} fails its CRC: {hint}")
                end = pos + _HEADER + length + _FOOTER
                if end > size:
                    raise DataError(f"{path}: truncated: the record at byte {pos} needs {length} bytes of data, "
                                    f"the file ends {end - size} bytes early; rewrite the file")
                offsets.append(pos)
                lengths.append(length)
                pos = end
                f.seek(pos)
    except OSError as e:
        raise DataError(f"cannot index the TFRecord file {path}: {e}") from e
    return np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class RecordIndex:
    """Every record of a list of TFRecord files, in file order: record i is at offsets[i] of paths[files[i]],
    its data lengths[i] bytes long.

    Build it with index_records(); hvdp.tensorflow.shard() takes it like an array of samples, one sample per
    record (its serialized bytes).
    """

    paths: tuple[str, ...]
    files: np.ndarray  # int32 index into paths, one per record
    offsets: np.ndarray  # int64 byte offset of the record's frame
    lengths: np.ndarray  # int64 length of the record's data

    def __len__(self) -> int:
        return len(self.offsets)

    def counts(self) -> list[int]:
        """Records per file, in the order of `paths`."""
        return np.bincount(self.files, minlength=len(self.paths)).tolist()


def index_records(paths) -> RecordIndex:
    """Index the records of the TFRecord files `paths` (a path, or a list of them, taken in that order).

    Raises:
        DataError: no paths, or a file that cannot be indexed (see record_frames()).
    """
    paths = (os.fspath(paths),) if isinstance(paths, (str, os.PathLike)) else tuple(os.fspath(p) for p in paths)
    if not paths:
        raise DataError("index_records() got no files: pass the paths of the TFRecord files")
    per_file = [record_frames(p) for p in paths]
    files = np.concatenate([np.full(len(o), i, np.int32) for i, (o, _) in enumerate(per_file)])
    return RecordIndex(paths=paths, files=files, offsets=np.concatenate([o for o, _ in per_file]),
                       lengths=np.concatenate([n for _, n in per_file]))


class RecordReader:
    """Reads records of an index by number: one pread of the data (its length is in the index), no CRC of it.

    Holds one open file per path it has read from; not shared between threads (each thread makes its own).
    """

    def __init__(self, index: RecordIndex):
        self.index = index
        self._fds: dict[int, int] = {}

    def _fd(self, file: int) -> int:
        fd = self._fds.get(file)
        if fd is None:
            try:
                fd = self._fds[file] = os.open(self.index.paths[file], os.O_RDONLY)
            except OSError as e:
                raise DataError(f"cannot open the TFRecord file {self.index.paths[file]}: {e}") from e
        return fd

    def read(self, records) -> list[bytes]:
        """The data of each record number in `records`, in that order."""
        out = []
        for i in records:
            file, pos, length = int(self.index.files[i]), int(self.index.offsets[i]), int(self.index.lengths[i])
            fd = self._fd(file)
            try:
                data = os.pread(fd, length, pos + _HEADER)
            except OSError as e:
                raise DataError(f"cannot read the record at byte {pos} of {self.index.paths[file]}: {e}") from e
            if len(data) != length:
                raise DataError(f"{self.index.paths[file]} changed since it was indexed: the record at byte {pos} "
                                f"has {len(data)} of its {length} bytes; index the files again")
            out.append(data)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        self.close()
