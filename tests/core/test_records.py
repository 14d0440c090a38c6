"""The TFRecord index in-process: frames written by hand here, by TensorFlow's writer in tests/tensorflow."""

import struct

import numpy as np
import pytest

from hvdp.core.errors import DataError
from hvdp.core.records import RecordReader, frame, index_records, masked_crc32c, record_frames


def write(path, records):
    path.write_bytes(b"".join(frame(r) for r in records))
    return str(path)


def test_crc32c_matches_the_published_check_values():
    # CRC-32C("123456789") = 0xE3069283 (RFC 3720); masked as TFRecord does.
    crc = 0xE3069283
    assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert masked_crc32c(b"") == (((0 >> 15) | (0 << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_index_and_read_records_of_several_files_in_any_order(tmp_path):
    a = [bytes([i]) * (i * 37 % 300) for i in range(50)]  # lengths 0..299, one empty record
    b = [f"b{i}".encode() for i in range(7)]
    index = index_records([write(tmp_path / "a", a), write(tmp_path / "b", b)])
    assert len(index) == 57 and index.counts() == [50, 7]
    reader = RecordReader(index)
    order = np.random.default_rng(0).permutation(57)
    assert reader.read(order) == [(a + b)[i] for i in order]
    reader.close()


def test_a_single_path_and_an_empty_file(tmp_path):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    offsets, lengths = record_frames(str(empty))
    assert len(offsets) == len(lengths) == 0
    index = index_records(write(tmp_path / "one", [b"x", b"yy"]))
    assert index.paths == (str(tmp_path / "one"),) and index.offsets.tolist() == [0, 17]
    assert index.lengths.tolist() == [1, 2]


@pytest.mark.parametrize("damage,message", [
    (lambda data: data[:-1], "truncated: the record at byte 21"),
    (lambda data: data + b"\x00" * 5, "truncated at byte 43"),
    (lambda data: data[:8] + b"\x00\x00\x00\x00" + data[12:], "the record header at byte 0 fails its CRC"),
    (lambda data: b"\x1f\x8b\x08\x00" + data, "compressed (gzip/zlib)"),
    (lambda data: b"just some text that is not a TFRecord file", "not a TFRecord file"),
])
def test_a_file_that_is_not_whole_tfrecords_is_refused_with_its_path_and_byte(tmp_path, damage, message):
    good = frame(b"first") + frame(b"second")
    bad = tmp_path / "bad.tfrecord"
    bad.write_bytes(damage(good))
    with pytest.raises(DataError, match="bad.tfrecord") as e:
        index_records([write(tmp_path / "ok", [b"a"]), str(bad)])
    assert message in str(e.value)


def test_missing_files_and_no_files(tmp_path):
    with pytest.raises(DataError, match="cannot index the TFRecord file .*nope"):
        index_records([str(tmp_path / "nope")])
    with pytest.raises(DataError, match="got no files"):
        index_records([])


def test_a_file_changed_after_indexing_is_named(tmp_path):
    path = tmp_path / "f"
    write(path, [b"x" * 100, b"y" * 100])
    index = index_records(str(path))
    path.write_bytes(frame(b"x" * 100) + struct.pack("<Q", 100))  # the second record cut short
    with pytest.raises(DataError, match="changed since it was indexed"):
        RecordReader(index).read([1])
