"""A radix tree over token-id sequences, an entry at each stored sequence: the prompt cache's match (the
longest stored prefix of a prompt) and where a prompt branches off what is stored."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Keyed(Protocol):
    """What the tree stores: anything with its token ids."""

    tokens: tuple[int, ...]


EntryT = TypeVar("EntryT", bound=Keyed)


@dataclass
class _Node(Generic[EntryT]):
    edge: tuple[int, ...] = ()
    children: dict[int, _Node[EntryT]] = field(default_factory=dict)
    entry: EntryT | None = None


class RadixTree(Generic[EntryT]):
    """Token-id sequences with an entry each; `deepest(tokens)`: the longest stored prefix of tokens."""

    def __init__(self) -> None:
        self.root: _Node[EntryT] = _Node()

    def insert(self, entry: EntryT) -> EntryT:
        """Store `entry` at its tokens (an entry already there stays and is returned)."""
        node, tokens = self.root, entry.tokens
        while tokens:
            child = node.children.get(tokens[0])
            if child is None:
                child = node.children[tokens[0]] = _Node(tokens)
                node, tokens = child, ()
                break
            common = common_length(child.edge, tokens)
            if common < len(child.edge):  # split the edge where the two part
                middle = _Node(child.edge[:common], {child.edge[common]: child})
                child.edge = child.edge[common:]
                node.children[tokens[0]] = middle
                child = middle
            node, tokens = child, tokens[common:]
        if node.entry is None:
            node.entry = entry
        return node.entry

    def deepest(
        self, tokens: tuple[int, ...] | list[int], limit: int, accept: Callable[[EntryT], bool] = bool
    ) -> EntryT | None:
        """The entry of the longest prefix of `tokens` of at most `limit` tokens that `accept`s."""
        node, depth, best = self.root, 0, None
        while depth < limit:
            child = node.children.get(tokens[depth])
            if child is None or depth + len(child.edge) > limit:
                break
            if tuple(tokens[depth : depth + len(child.edge)]) != child.edge:
                break
            node, depth = child, depth + len(child.edge)
            if node.entry is not None and accept(node.entry):
                best = node.entry
        return best

    def shared_length(self, tokens: tuple[int, ...] | list[int]) -> int:
        """How many of `tokens` lead some stored entry's tokens: where `tokens` branch off the tree."""
        node, depth = self.root, 0
        while depth < len(tokens) and (child := node.children.get(tokens[depth])) is not None:
            common = common_length(child.edge, tuple(tokens[depth : depth + len(child.edge)]))
            depth += common
            if common < len(child.edge):
                break
            node = child
        return depth

    def remove(self, tokens: tuple[int, ...]) -> None:
        """Take the entry at `tokens` out (nothing when there is none), and the nodes left empty."""
        path, node, rest = [self.root], self.root, tokens
        while rest:
            node = node.children.get(rest[0])
            if node is None or tuple(rest[: len(node.edge)]) != node.edge:
                return
            path.append(node)
            rest = rest[len(node.edge) :]
        node.entry = None
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
            if child.entry is not None or child.children:
                break
            del parent.children[child.edge[0]]

    def entries(self) -> Iterator[EntryT]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                yield node.entry
            stack.extend(node.children.values())


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two tuples or two lists (a tuple's slice never equals a
    list's): by slice comparisons (C loops), halving the range where they part, not a Python loop over
    a conversation's thousands of ids."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; they part before high (or are equal to it)
    if a[:high] == b[:high]:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low
