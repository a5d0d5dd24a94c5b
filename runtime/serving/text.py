"""Text in and out of the tokenizer for every front end (treeflash-run, the Triton adapter, the OpenAI
server): prompts and chat messages to ids, and generated ids back to text as they arrive, with stop
words.

Two stop-word conventions share one decoder: Triton's (TensorRT-LLM's) keeps the stop word in the
text (``IncrementalText``); OpenAI's ends the text right before it and never hands out a piece that
might turn out to be the start of one (``StopText``).
"""

from __future__ import annotations

from treeflash_export.errors import ConfigError


def encode_prompt(tok, text: str) -> list[int]:
    """A plain prompt as treeflash-run encodes it (the tokenizer's special tokens added)."""
    return tok(text, add_special_tokens=True)["input_ids"]


def encode_chat(tok, messages: list[dict]) -> list[int]:
    """Messages ({"role", "content"}) through the tokenizer's chat template, ready for the assistant's turn."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError("this tokenizer has no chat template")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    # transformers 5 may still hand back a BatchEncoding here
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def longest_token_chars(tok) -> int:
    """The most characters of text one token of this tokenizer stands for (its longest vocabulary entry:
    a byte-level entry holds one symbol per byte, a SentencePiece one a symbol per character). A text
    longer than capacity x this cannot fit a cache of that capacity, so it is refused without tokenizing."""
    return max((len(t) for t in tok.get_vocab()), default=1) or 1


class _OpenTails:
    """For each stop string, the length of the longest end of the text so far that is a beginning of it
    (Knuth-Morris-Pratt states), fed only the new characters: linear in the text, whatever the strings."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.fail = [self._failure(w) for w in stop]
        self.state = [0] * len(stop)

    @staticmethod
    def _failure(w: str) -> list[int]:
        """fail[k]: the longest proper border of w[:k] (k = 1..len(w)); fail[0] unused."""
        fail, k = [0] * (len(w) + 1), 0
        for i in range(1, len(w)):
            while k and w[i] != w[k]:
                k = fail[k]
            if w[i] == w[k]:
                k += 1
            fail[i + 1] = k
        return fail

    def feed(self, text: str) -> int:
        """New characters -> the longest open tail: an end of the text that is a proper beginning of a
        stop string (a whole one found here counts by its longest proper border)."""
        longest = 0
        for j, (w, fail) in enumerate(zip(self.stop, self.fail)):
            k = self.state[j]
            for ch in text:
                if k == len(w):
                    k = fail[k]
                while k and ch != w[k]:
                    k = fail[k]
                if ch == w[k]:
                    k += 1
            self.state[j] = k
            longest = max(longest, fail[k] if k == len(w) else k)
        return longest


class IncrementalText:
    """Decodes a growing token list to text pieces, holding back incomplete UTF-8 sequences, and
    finds stop words (the text is cut right after the first one)."""

    def __init__(self, tokenizer, stop_words: tuple[str, ...] = ()):
        self.tokenizer, self.stop_words = tokenizer, stop_words
        self.tokens: list[int] = []
        self.text = ""  # handed out so far
        self.stopped = False

    def add(self, new: list[int]) -> str:
        """New tokens -> the text they complete (maybe empty). After a stop word, ``tokens`` keeps only
        the tokens up to the one that completes it (those after it in the same round are dropped)."""
        start = len(self.tokens)
        self.tokens.extend(new)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = None
        for w in self.stop_words:
            at = full.find(w, max(0, len(self.text) - len(w)))
            if at >= 0 and (cut is None or at + len(w) < cut):
                cut = at + len(w)  # the earliest end among the stop words
        if cut is not None:
            full, self.stopped = full[:cut], True
            # The shortest run of tokens whose text holds the text up to the cut. The word was not in
            # the text of the earlier tokens (it would have been found then), so a new one completes it.
            keep = next((k for k in range(start + 1, len(self.tokens))
                         if self.tokenizer.decode(self.tokens[:k], skip_special_tokens=True).startswith(full)),
                        len(self.tokens))
            del self.tokens[keep:]
        if full.endswith("\ufffd") and not self.stopped:
            return ""
        piece, self.text = full[len(self.text):], full
        return piece

    def flush(self) -> str:
        """The rest of the text, incomplete characters included (generation has ended)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        piece, self.text = full[len(self.text):], full
        return piece


class StopText:
    """OpenAI's stop strings over IncrementalText: the text ends right before the first stop string
    (generation ends with the token that completes it), and while generating, a tail that could
    still grow into a stop string is held back, so no part of one is ever streamed."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.inner = IncrementalText(tokenizer, tuple(stop))
        self.stop = tuple(stop)
        self.sent = 0  # characters of the inner text handed out
        self.tails = _OpenTails(self.stop)
        self.fed = 0  # characters of the inner text fed to the tails
        self.open = 0  # the open tail after them

    @property
    def tokens(self) -> list[int]:
        """The tokens generated up to the end (up to the one that completes a stop string)."""
        return self.inner.tokens

    @property
    def stopped(self) -> bool:
        return self.inner.stopped

    def add(self, new: list[int]) -> str:
        self.inner.add(new)
        text = self.inner.text
        if self.inner.stopped:  # text ends with the stop string found: the longest one ending there goes
            end = len(text) - max(len(w) for w in self.stop if text.endswith(w))
        else:
            end = len(text) - self._open_tail(text)
        return self._hand_out(end)

    def flush(self) -> str:
        """At the end of generation: what was held back (no stop string can complete any more)."""
        if self.inner.stopped:
            return ""
        self.inner.flush()
        return self._hand_out(len(self.inner.text))

    def _open_tail(self, text: str) -> int:
        """The length of the longest end of ``text`` (the inner text, which only grows) that is a proper
        beginning of a stop string; only the characters new since the last call are scanned."""
        if len(text) > self.fed:
            self.open, self.fed = self.tails.feed(text[self.fed:]), len(text)
        return self.open

    def _hand_out(self, end: int) -> str:
        # A held-back tail is always longer than the one before it, so end never moves backwards.
        end = max(end, self.sent)
        piece, self.sent = self.inner.text[self.sent:end], end
        return piece
