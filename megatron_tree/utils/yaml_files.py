"""YAML as the package reads a user's files: ``yaml.safe_load``, except that a mapping may not repeat a key.

PyYAML keeps the last of two equal keys without a word (``model:`` written twice: the first
section is gone), so a config, a ds_config or a cost-model preset that says something twice would
run with half of it. :func:`load` refuses it, at any depth, naming the key and both lines.
Merge keys (``<<: *anchor``) still work: a key written next to them overrides the merged one, as
YAML means it to.
"""

from __future__ import annotations

import yaml

__all__ = ["DuplicateKeyError", "StrictSafeLoader", "load"]


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key written twice in one mapping (a ``yaml.YAMLError``, so callers catching those see it too).

    key: the key's dotted path from the document's top (``model.hidden_size``; ``[i]`` for a list item);
    line, first_line: 1-based lines of the repeat and of the first occurrence.
    """

    def __init__(self, key: str, first_mark, mark):
        super().__init__(None, None, f"duplicate key {key!r}", mark)
        self.key = key
        self.first_line = first_mark.line + 1
        self.line = mark.line + 1

    def __str__(self) -> str:
        return (f"duplicate key {self.key!r} at line {self.line} (first at line {self.first_line}); "
                "YAML would keep only the last, so each key may appear once per mapping")


_MERGE = "tag:yaml.org,2002:merge"


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in any mapping (:class:`DuplicateKeyError`)."""

    def construct_document(self, node):
        self._check_keys(node, "", set())
        return super().construct_document(node)

    def _check_keys(self, node, path: str, seen_nodes: set) -> None:
        if id(node) in seen_nodes:  # an alias met again (a recursive anchor too): checked already
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:  # `<<`: merged keys may be overridden by the mapping's own
                    self._check_keys(value_node, path, seen_nodes)
                    continue
                key = self.construct_object(key_node, deep=True)
                name = f"{path}.{key}" if path else str(key)
                try:
                    mark = first.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    mark = None
                else:
                    first.setdefault(key, key_node.start_mark)
                if mark is not None:
                    raise DuplicateKeyError(name, mark, key_node.start_mark)
                self._check_keys(value_node, name, seen_nodes)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_keys(item, f"{path}[{i}]", seen_nodes)


def load(stream):
    """``yaml.safe_load(stream)`` that raises :class:`DuplicateKeyError` on a key repeated in any mapping."""
    return yaml.load(stream, Loader=StrictSafeLoader)  # noqa: S506 -- a SafeLoader subclass
