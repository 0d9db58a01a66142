"""JSON Schema of a protobuf message in its JSON mapping (field names as in the .proto,
which the gateway prints and, like camelCase, reads), for the OpenAPI file: the JSON
routes are the gRPC contracts one to one, and their documentation is made from the same
descriptors, so it cannot drift from them."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_SCALARS: dict[int, dict] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_INT32: {"type": "integer"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "minimum": 0},
    # 64-bit integers are strings in protobuf's JSON mapping (a number is read too).
    FieldDescriptor.TYPE_INT64: {"type": ["string", "integer"]},
    FieldDescriptor.TYPE_SINT64: {"type": ["string", "integer"]},
    FieldDescriptor.TYPE_SFIXED64: {"type": ["string", "integer"]},
    FieldDescriptor.TYPE_UINT64: {"type": ["string", "integer"]},
    FieldDescriptor.TYPE_FIXED64: {"type": ["string", "integer"]},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
}
# Well-known types with a JSON form of their own.
_WELL_KNOWN: dict[str, dict] = {
    "google.protobuf.Duration": {"type": "string", "examples": ["1.5s"]},
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
}


def reference(descriptor: Any, definitions: dict[str, dict]) -> dict:
    """A `$ref` to the message's schema (`descriptor`: a message Descriptor, pure-Python or
    upb), which is added (with every message it holds) to
    `definitions` (the OpenAPI file's components.schemas)."""
    name = descriptor.full_name
    if name in _WELL_KNOWN:
        return dict(_WELL_KNOWN[name])
    if name not in definitions:
        definitions[name] = {}  # claimed first: a message that holds itself ends here
        definitions[name] = _message(descriptor, definitions)
    return {"$ref": f"#/components/schemas/{name}"}


def _message(descriptor: Descriptor, definitions: dict[str, dict]) -> dict:
    properties = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = field.message_type.fields_by_name["value"]
            properties[field.name] = {
                "type": "object",
                "additionalProperties": _single(value, definitions),
            }
        elif field.is_repeated:
            properties[field.name] = {"type": "array", "items": _single(field, definitions)}
        else:
            properties[field.name] = _single(field, definitions)
    return {"type": "object", "title": descriptor.name, "properties": properties}


def _single(field: FieldDescriptor, definitions: dict[str, dict]) -> dict:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return reference(field.message_type, definitions)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return {"type": "string", "enum": [v.name for v in field.enum_type.values]}
    return dict(_SCALARS[field.type])
