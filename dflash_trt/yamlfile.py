"""The YAML users hand us (build profiles, sweep configs), read as plain data: a key given twice is an error.

PyYAML's safe loader keeps the last of two equal keys, so a profile with two `engine:` sections would build with
one of them and never mention the other.
"""

from __future__ import annotations

from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def safe_load_unique(text: str) -> Any:
    """`yaml.safe_load`, refusing a mapping that repeats a key (a yaml.YAMLError, like every other YAML fault)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
