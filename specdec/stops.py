"""Stop strings matched as generated text streams in, at a cost per character that does not grow
with their number: an Aho-Corasick automaton over their characters (one state per distinct
prefix). Its state after each character is the longest suffix of the text so far that begins
some stop string, which is both what a completed match is found from and how much text must be
held back (a stop string may still complete there)."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.children: list[dict[str, int]] = [{}]  # state -> character -> state (the trie)
        self.depth = [0]  # characters of the prefix each state stands for
        self.ending = [0]  # the longest stop string that is a suffix of the state's prefix (0: none)
        for stop in self.stops:
            state = 0
            for character in stop:
                child = self.children[state].get(character)
                if child is None:
                    child = self.children[state][character] = len(self.children)
                    self.children.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ending.append(0)
                state = child
            self.ending[state] = len(stop)
        # Fallback links, breadth first: the longest proper suffix of a state's prefix that is a state.
        self.fallback = [0] * len(self.children)
        queue = list(self.children[0].values())
        for state in queue:
            for character, child in self.children[state].items():
                back = self.fallback[state]
                while back and character not in self.children[back]:
                    back = self.fallback[back]
                self.fallback[child] = self.children[back].get(character, 0)  # (never child: a deeper state)
                self.ending[child] = max(self.ending[child], self.ending[self.fallback[child]])
                queue.append(child)
        self.state = 0
        self.position = 0  # characters fed so far

    @property
    def held(self) -> int:
        """The longest suffix of the text so far that is a proper prefix of a stop string (while
        none has completed: a stop string may still complete over it)."""
        return self.depth[self.state]

    def feed(self, text: str) -> int | None:
        """Feed the next characters; the earliest start (an index into everything fed) of a stop
        string that ends inside them, or None."""
        earliest = None
        for character in text:
            state = self.state
            while state and character not in self.children[state]:
                state = self.fallback[state]
            self.state = self.children[state].get(character, 0)
            self.position += 1
            if self.ending[self.state]:
                start = self.position - self.ending[self.state]
                earliest = start if earliest is None else min(earliest, start)
        return earliest
