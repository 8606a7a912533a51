"""The YAML loader for recipes: PyYAML's safe loader, stricter in two ways.

- A key written twice in one mapping (a second `stages:`, two stages of the same
  name) is an error naming both lines; PyYAML silently keeps the last one, so half
  a recipe would vanish without a word. Merge keys (`<<: *base`) still override.
- Nesting deeper than MAX_DEPTH is an error: PyYAML composes nodes recursively, and
  a few thousand `[` end in RecursionError (an "internal error") instead of a line.

Both raise yaml.MarkedYAMLError subclasses, so the caller's one handler for malformed
YAML reports them with their line and column.
"""
from __future__ import annotations

from typing import Any

import yaml

# A recipe nests about six levels (stages.int8.params.nodes.exclude[0]); 64 leaves room for any real one.
MAX_DEPTH = 64
_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.MarkedYAMLError):
    pass


class TooDeepError(yaml.MarkedYAMLError):
    pass


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader (plain values only) that refuses duplicate keys and unbounded nesting."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise TooDeepError(None, None, f"the YAML nests deeper than {MAX_DEPTH} levels; a recipe needs a few, flatten it", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first_line.get(key)
                except TypeError:
                    continue  # an unhashable key: the base class reports it
                if seen is not None:
                    raise DuplicateKeyError(
                        None, None, f"key '{key}' appears twice in one mapping (first at line {seen}); remove or rename one", key_node.start_mark
                    )
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """Plain values from YAML text; raises yaml.YAMLError (with a mark) when it is malformed."""
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 (RecipeLoader is a SafeLoader)
