"""Hypothesis strategies for any protobuf message, built from its descriptor: every field gets
random values of its wire type (extreme ints, NaN/inf, odd unicode, long strings, unknown enum
numbers, nested messages, repeated and map fields)."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor
_INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31)]))
_INT64 = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**63 - 1, 10**12]))
_UINT32 = st.integers(0, 2**32 - 1)
_UINT64 = st.integers(0, 2**64 - 1)
_FLOAT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 1e30])
)
_DOUBLE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e300, 5e-324])
)
_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", "..", "../../etc/passwd", "a/b", "node1", "demo", "\x00", "$(touch /tmp/pwned)", "x" * 5000]
    ),
)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return _INT32
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return _INT64
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return _UINT32
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return _UINT64
    if t == F.TYPE_FLOAT:
        return _FLOAT
    if t == F.TYPE_DOUBLE:
        return _DOUBLE
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return _TEXT
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM and field.enum_type is not None:  # open enums: unknown numbers are legal on the wire
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 1000))
    raise AssertionError(f"unhandled field type {t}")


def message_dicts(desc: Descriptor, depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key = _scalar(field.message_type.fields_by_name["key"])
            vfield = field.message_type.fields_by_name["value"]
            value = _scalar(vfield) if vfield.message_type is None else st.just(None)
            fields[field.name] = st.dictionaries(key, value, max_size=4).map(
                lambda d: {k: v for k, v in d.items() if v is not None}
            )
            continue
        if field.message_type is not None:
            if depth <= 0 or field.message_type.full_name.startswith("google.protobuf."):
                continue
            one: st.SearchStrategy[Any] = message_dicts(field.message_type, depth - 1)
        else:
            one = _scalar(field)
        is_repeated = getattr(field, "is_repeated", None)
        repeated = is_repeated if is_repeated is not None else getattr(field, "label", 0) == F.LABEL_REPEATED
        fields[field.name] = st.lists(one, max_size=4) if repeated else one
    return st.fixed_dictionaries({}, optional=fields)


def _fill(msg: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            target.update(value)
        elif field.message_type is not None:
            if isinstance(value, list):
                for v in value:
                    _fill(target.add(), v)
            else:
                _fill(target, value)
                target.SetInParent()
        elif isinstance(value, list):
            target.extend(value)
        else:
            setattr(msg, name, value)


def messages(cls: type[Any]) -> st.SearchStrategy[Any]:
    def build(values: dict[str, Any]) -> Any:
        msg = cls()
        _fill(msg, values)
        return msg

    return message_dicts(cls.DESCRIPTOR).map(build)
