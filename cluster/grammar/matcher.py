"""One request's position in its grammar.

A `GrammarMatcher` is made by `GrammarCompiler.matcher` and lives on its `Request`: the request
appends every output token through it (`accept`), so its state always equals the output so far,
whichever way the tokens came (sampled here, sent by a prefill worker, replayed on a resumed run).
Masks are bit sets, one int32 word per 32 tokens: bit j of word w allows token 32 * w + j.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # made by the compiler, which loads llguidance: this module runs without it
    import llguidance


class GrammarMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, num_words: int) -> None:
        self._matcher = matcher
        self.num_words = num_words  # int32 words in its mask: the vocabulary it was compiled for, / 32

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it (then `failed` for good)."""
        return self._matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar allows nothing more (only the end of sequence)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def failed(self) -> bool:
        """A token the grammar does not allow was accepted: the output no longer follows it."""
        return self._matcher.is_error()

    def fill_bitmask(self, address: int) -> None:
        """Write the mask of the tokens allowed next, `num_words` int32 words, at `address`. Without
        the GIL: another thread may run the model meanwhile."""
        self._matcher.unsafe_compute_mask_ptr(address, self.num_words * 4)
