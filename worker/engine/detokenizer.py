"""Incremental detokenization with stop strings."""
from __future__ import annotations

from common.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Holds back text while the last tokens end in a partial UTF-8 character (decoded as
    U+FFFD) and while the text ends in a possible prefix of a stop string; on a stop string
    the text is cut right before it.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""            # decoded output text so far (complete characters only)
        self.num_emitted = 0      # characters of `text` already handed out
        self.stopped = False
        self._prefix_offset = 0   # decoding restarts here, so word-initial spaces come out right
        self._read_offset = 0     # ids before this are already in `text`

    def step(self, output_ids: list[int], finished: bool) -> str:
        """The new text to hand out after `output_ids` grew; sets `stopped` on a stop string."""
        self._decode_new(output_ids, finished)
        if self.stop:
            hit = self._find_stop()
            if hit is not None:
                self.text, self.stopped = self.text[:hit], True
                finished = True
        end = len(self.text) if finished else len(self.text) - self._held_back()
        delta = self.text[self.num_emitted:end]
        self.num_emitted = max(self.num_emitted, end)
        return delta

    def _decode_new(self, ids: list[int], finished: bool) -> None:
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset:])
        if (full.endswith(REPLACEMENT_CHAR) and not finished) or len(full) <= len(prefix):
            return  # an incomplete character (or nothing visible yet): wait for more tokens
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def _find_stop(self) -> int | None:
        # Only text near the end can hold a stop string that was not there before.
        longest = max(len(s) for s in self.stop)
        start = max(0, self.num_emitted - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
