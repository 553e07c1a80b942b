"""Incremental detokenization with stop strings."""
from __future__ import annotations

from common.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Holds back text while the last tokens end in a partial UTF-8 character (decoded as
    U+FFFD) and while the text ends in a possible prefix of a stop string; on a stop string
    the text is cut right before it. As vLLM does, a stop string counts only once more than
    `min_tokens` tokens are out, and only if it ends in the text of the tokens after them.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.text = ""            # decoded output text so far (complete characters only)
        self.num_emitted = 0      # characters of `text` already handed out
        self.stopped = False
        self.stop_string: str | None = None   # the stop string that ended the text
        self._stop_from = 0       # a stop string must end after this many characters (min_tokens' text)
        self._prefix_offset = 0   # decoding restarts here, so word-initial spaces come out right
        self._read_offset = 0     # ids before this are already in `text`

    def step(self, output_ids: list[int], finished: bool) -> str:
        """The new text to hand out after `output_ids` grew; sets `stopped` on a stop string."""
        self._decode_new(output_ids, finished)
        if len(output_ids) <= self.min_tokens:
            self._stop_from = len(self.text)
        elif self.stop and not self.stopped:
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
        """Where the stop string that ends first starts (the first listed of those ending there); sets `stop_string`."""
        # Only text near the end can hold a stop string that was not there before.
        start = max(0, self.num_emitted - max(len(s) for s in self.stop))
        best: tuple[int, int, str] | None = None   # (end, start, stop string)
        for s in self.stop:
            i = self.text.find(s, max(start, self._stop_from - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), i, s)
        if best is None:
            return None
        self.stop_string = best[2]
        return best[1]

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
