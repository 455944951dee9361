"""What a tf.data iterator's checkpoint holds that restoring it would get wrong: an error it read ahead, which
every restart would raise again (`held_error`), and a mix whose input ran out (`exhausted_mix`).

tf.data's ops read ahead of the consumer (`prefetch`, a fused `map` and `batch`, a parallel `batch`) and save
what they read ahead with the checkpoint, a failed read included: its status code and message. Restored,
the iterator raises that error again when it reaches it, however the data or the storage are since. So a
commit must never hold such a checkpoint: a transient read error (a storage hiccup) caught in a buffer
would fail every restart from it, and a mended file would still fail. `held_error` finds it.

The format read here is TensorFlow's (checked with 2.21): `SerializeIterator`'s variant tensor, serialized,
packs one `VariantTensorDataProto` per saved part in `tensor_content` (their sizes as varints, then the
parts); a part's `metadata` is its name and its keys joined by "@@"; its values are one tensor a key, or
(as 2.21 writes them) one `CompressedElement` whose components are the values in the keys' order. An op
that failed to make an element writes a message key beside its status code: "X.error_message" or
"X_error_message" beside "X.code" or "X_code" (`prefetch`, parallel `map` and `interleave`, most ops),
"X_status_msg" beside "X_status_code" (map-and-batch, parallel batch); one under an op that may never raise
it (`_MAY_NOT_RAISE`: `ignore_errors`, `take`, `zip`, ..., and a mix's input unless every mix drains its
inputs) is not counted. Only the parts' keys are read, and only a part with such a key is decoded.
"""
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging
from google.protobuf.message import DecodeError
from tensorflow.core.framework import dataset_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorflow.python.framework import errors_impl
from tensorflow.python.ops import gen_experimental_dataset_ops

# A message key's suffix, and its status code key's suffix in its place.
_MESSAGE_KEYS = {b"error_message": b"code", b"_status_msg": b"_status_code"}
# An error read ahead under one of these ops may never be raised: `ignore_errors` skips it, and `take`,
# `take_while`, `zip` (at its shortest input) and a mix's inputs (unless it drains them all) may end before
# they reach it. Not refused: a commit holding such an error restarts into it only if the pipeline would
# have raised it anyway.
_MAY_NOT_RAISE = (b"::IgnoreErrors::", b"::FiniteTake::", b"::Take::", b"::TakeWhile::", b"::Zip[")
_MIX_INPUT = b"::DirectedInterleave["


def held_error(saved: bytes, mixes_drain: bool = False) -> Optional[tf.errors.OpError]:
    """The error `saved` (a serialized iterator checkpoint) holds for an element read ahead, or None; one
    under a mix's input only where every mix reads its inputs to their ends (`mixes_drain`). Reads the
    parts' keys only (a shuffle buffer's megabytes are skipped, not copied). A checkpoint whose layout is
    not the one described above is taken as holding none (logged once)."""
    skipped = _MAY_NOT_RAISE if mixes_drain else (*_MAY_NOT_RAISE, _MIX_INPUT)
    for name, keys, part in _known_parts(saved) or []:
        for key in keys:
            suffix = next((s for s in _MESSAGE_KEYS if key.endswith(s)), None)
            if suffix is None or any(op in name + key for op in skipped):
                continue
            try:
                values = _part_values(keys, part)
                code = int(np.asarray(values[key[:-len(suffix)] + _MESSAGE_KEYS[suffix]]))
                text = np.asarray(values[key]).item().decode(errors="replace")
            except _LAYOUT_ERRORS as error:
                _unknown_layout(error)
                continue
            return errors_impl.exception_type_from_error_code(code)(None, None, text)
    return None


def exhausted_mix(saved: bytes) -> bool:
    """Whether a mix of datasets in `saved` (`sample_from_datasets`, `choose_from_datasets`: the op
    DirectedInterleave, which writes "data_input_impl_empty[i]" as 0 or 1 for each input) had an input run
    out. TensorFlow 2.21 restores such a mix wrongly (it counts the inputs that ran out as active, see
    `dataset_feed`), one with all its inputs exactly. True where the layout is not the one known."""
    parts = _known_parts(saved)
    if parts is None:
        return True
    for name, keys, part in parts:
        if name.rsplit(b"::", 1)[-1] != b"DirectedInterleave":
            continue
        try:
            values = _part_values(keys, part)
            if any(int(np.asarray(value)) for key, value in values.items() if b"data_input_impl_empty[" in key):
                return True
        except _LAYOUT_ERRORS as error:
            _unknown_layout(error)
            return True
    return False


_LAYOUT_ERRORS = (DecodeError, KeyError, IndexError, ValueError, TypeError, AttributeError, tf.errors.OpError)


def _known_parts(saved: bytes) -> Optional[List[Tuple[bytes, List[bytes], memoryview]]]:
    """`_parts`, or None where the layout is not the one known (logged once)."""
    try:
        return list(_parts(memoryview(saved)))
    except (DecodeError, KeyError, IndexError, ValueError) as error:
        _unknown_layout(error)
        return None


def _part_values(keys: List[bytes], part: memoryview) -> dict:
    """A part's values by key."""
    return dict(zip(keys, _values(tensor_pb2.VariantTensorDataProto.FromString(bytes(part)).tensors)))


def _unknown_layout(error: Exception) -> None:
    logging.log_first_n(logging.WARNING, "the tf.data checkpoint's layout is not the one known (%s): it is not "
                        "checked for a held error", 1, error)


def _parts(saved: memoryview) -> Iterator[Tuple[bytes, List[bytes], memoryview]]:
    """Each saved part's name (its iterator's path, "Iterator::Root::..."), keys and serialized
    `VariantTensorDataProto`."""
    fields = dict(_fields(saved))  # TensorProto: 2 its shape, 4 its tensor_content
    content, at = fields[4], 0
    sizes = []
    for _ in range(tensor_shape_pb2.TensorShapeProto.FromString(bytes(fields[2])).dim[0].size):
        size, at = _varint(content, at)
        sizes.append(size)
    for size in sizes:
        part = content[at:at + size]
        at += size
        metadata = bytes(dict(_fields(part)).get(2, b""))  # VariantTensorDataProto: 2 its metadata
        name, *keys = metadata.split(b"@@")
        yield name, [key for key in keys if key], part


def _fields(message: memoryview) -> Iterator[Tuple[int, memoryview]]:
    """The length-delimited fields of a serialized protobuf message (number, bytes); others are skipped."""
    at = 0
    while at < len(message):
        tag, at = _varint(message, at)
        kind = tag & 7
        if kind == 2:
            size, at = _varint(message, at)
            yield tag >> 3, message[at:at + size]
            at += size
        elif kind in (0, 1, 5):
            at = _varint(message, at)[1] if kind == 0 else at + (8 if kind == 1 else 4)
        else:
            raise ValueError(f"protobuf wire type {kind}")


def _values(tensors: Sequence[tensor_pb2.TensorProto]) -> List:
    """A part's values, one a key: its tensors, or the components of the one compressed element it holds."""
    if len(tensors) != 1 or tensors[0].dtype != types_pb2.DT_VARIANT:
        return [tf.make_ndarray(t) for t in tensors]
    element = dataset_pb2.CompressedElement.FromString(tensors[0].variant_val[0].metadata)
    components = gen_experimental_dataset_ops.uncompress_element(
        tf.io.parse_tensor(tensors[0].SerializeToString(), tf.variant),
        output_types=[c.dtype for c in element.component_metadata],
        output_shapes=[tf.TensorShape(c.tensor_shape) for c in element.component_metadata])
    return [c.numpy() for c in components]


def _varint(data: bytes, at: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
        if byte < 0x80:
            return value, at
