"""The one YAML reader of user files: numbers as users write them, and no duplicate keys.

PyYAML follows YAML 1.1, where `3e-4` and `1e9` are strings (a float needs a dot: `3.0e-4`),
so a config's `lr: 3e-4` was refused as "must be a number, got '3e-4'". `PoiseLoader` reads as
a float every plain (unquoted) scalar that Python's `float()` reads and YAML would otherwise
read as a string: `3e-4`, `1E9`, `6.25e9`, `+1e3`, `1_000.5`, `inf`, `nan`, `Infinity`.
Booleans stay booleans (`true`, `yes`, `on` are not numbers), integers stay integers, and a
quoted `"3e-4"` stays a string. The non-finite spellings are read as floats so that the
number checks refuse them by name ("must be finite, got nan"), never as a wrong-type string.

A mapping that repeats a key is refused (`DuplicateKeyError`, naming the key and both lines):
PyYAML keeps the last one silently.
"""

from __future__ import annotations

from typing import Any

import yaml

_STR = "tag:yaml.org,2002:str"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping repeats `key` (at 1-based `line`, first at `first_line`)."""

    def __init__(self, key: Any, line: int, first_line: int, node: yaml.Node):
        super().__init__(problem=f"duplicate key {key!r}", problem_mark=node.start_mark)
        self.key = key
        self.line = line
        self.first_line = first_line

    def __str__(self) -> str:
        return f"duplicate key {self.key!r} at line {self.line} (first at line {self.first_line})"


def _is_float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class PoiseLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` reading every `float()` spelling as a float, refusing duplicate keys."""

    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        tag = super().resolve(kind, value, implicit)
        if (
            tag == _STR
            and kind is yaml.ScalarNode
            and implicit[0]  # plain, unquoted
            and _is_float_text(value)
        ):
            return _FLOAT
        return tag

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue  # merged keys (`<<: *base`) may be overridden, as YAML allows
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(key, line, seen[key], key_node)
                    seen[key] = line
                except TypeError:
                    continue  # an unhashable key: the base constructor refuses it
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)` with `PoiseLoader`: raises `yaml.YAMLError` (`DuplicateKeyError`
    for a repeated key)."""
    return yaml.load(text, Loader=PoiseLoader)
