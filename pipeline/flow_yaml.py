"""Reading a flow.yaml's text into data, refusing what PyYAML would accept silently or slowly.

- A key given twice in one mapping is an error naming the key and both lines (PyYAML keeps the
  last one without a word, so a second ``steps:`` would silently win). Keys merged in with
  ``<<: *anchor`` may still be overridden: that is what merging is for.
- Anchors and aliases are counted as they expand: a document whose nodes, aliases expanded,
  exceed titan_pipe.rules.limits.YAML_NODES is refused before anything is built from it (a 500-byte
  "billion laughs" file would otherwise make validation walk an exponential tree).
"""

from __future__ import annotations

import yaml

from titan_pipe.rules import limits

_MERGE = "tag:yaml.org,2002:merge"


class FlowYamlError(ValueError):
    """The text is not a usable flow.yaml; the message is one line with the fix."""


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = lines.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: PyYAML's own error says so
                break
            if first != key_node.start_mark.line + 1:
                raise FlowYamlError(
                    f"key {limits.shown(key)} appears twice (lines {first} and "
                    f"{key_node.start_mark.line + 1}); keep one"
                )
        return super().construct_mapping(node, deep)


def expanded_size(node: yaml.Node, limit: float) -> int:
    """Nodes of ``node`` with every alias expanded, counted until ``limit`` is passed.

    An alias is the very node object its anchor named, so sizes are memoised per node: the
    count costs one visit per distinct node however large the expansion is.
    """
    memo: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) in memo:
            return memo[id(n)]
        memo[id(n)] = 1  # a node that reaches itself (a recursive alias) counts once here
        total = 1
        if isinstance(n, yaml.SequenceNode):
            total += sum(size(c) for c in n.value)
        elif isinstance(n, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in n.value)
        memo[id(n)] = total = min(total, int(limit) + 1)
        return total

    return size(node)


def load_flow_text(text: str):
    """The data of a flow.yaml (None for an empty file); FlowYamlError for a duplicate key or an
    alias expansion past the limit, yaml.YAMLError / RecursionError for text that is not YAML."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = expanded_size(node, limits.YAML_NODES.hi)
        if n > limits.YAML_NODES.hi:
            raise FlowYamlError(
                f"expands to more than {limits.YAML_NODES.hi:,.0f} values through anchors and "
                "aliases (&name / *name); a flow.yaml has a few hundred: write the values out"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()
