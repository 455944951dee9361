"""The TFRecord file format in Python: its checksum, its record headers, and a shard's record offsets.

`TFRecordSource` needs every record's byte offset to seek to a run of records, and TensorFlow has no op
that lists them; it reads the headers here instead. The same header and payload checks name a corrupt
record when a run does not read. Pure Python (no dependency beyond `tf.io.gfile`, for any filesystem).
"""
import struct
from typing import List, Tuple

import tensorflow as tf

from tf_elastic.elastic.worker.errors import ConfigurationError

CHUNK = 8 << 20  # bytes per read while indexing a shard


def _crc_table() -> List[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated and offset ("masked"). Pure Python (no dependency): the index
    pass checks 8 bytes a record, about 1 us; whole records only when diagnosing one that did not read."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_header(data: bytes, at: int) -> Tuple[int, bool]:
    """(payload length, whether the header's checksum holds) of the record that starts at byte `at` of `data`."""
    length, crc = struct.unpack_from("<QI", data, at)
    return length, masked_crc32c(data[at:at + 8]) == crc


def payload_ok(data: bytes, at: int, length: int) -> bool:
    """Whether the `length`-byte payload of the record at byte `at` of `data` matches its checksum."""
    return masked_crc32c(data[at + 12:at + 12 + length]) == struct.unpack_from("<I", data, at + 12 + length)[0]


def record_offsets(path: str) -> Tuple[List[int], int]:
    """(the offset of every record, file size) of a TFRecord file, from its headers (each one's checksum
    checked: a corrupt length would mis-index the rest), in one sequential read of large chunks: on an
    object store a few requests per shard, not one per record."""
    offsets, buffer, start, position = [], b"", 0, 0  # buffer holds the file's bytes from `start` on
    with tf.io.gfile.GFile(path, "rb") as f:  # any TF filesystem
        size = f.size()
        while position < size:
            if position + 12 > start + len(buffer):
                if position > start + len(buffer):  # a record longer than a chunk: skip the rest of it
                    f.seek(position)
                    buffer, start = b"", position
                buffer, start = buffer[position - start:] + f.read(CHUNK), position
                if position + 12 > start + len(buffer):
                    raise ConfigurationError(f"TFRecord file {path} is truncated at byte {position}.")
            length, header_ok = read_header(buffer, position - start)
            if not header_ok:
                raise ConfigurationError(f"TFRecord file {path}: the header of record {len(offsets)} at byte "
                                         f"{position} is corrupt (checksum mismatch).")
            if position + 16 + length > size:
                raise ConfigurationError(f"TFRecord file {path}: record {len(offsets)} runs past the end of the file.")
            offsets.append(position)
            position += 16 + length
    return offsets, size
