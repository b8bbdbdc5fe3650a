"""Token ids of rendered chat prompts reused across requests that share a prefix (a system
prompt, the earlier turns of a conversation): exact, because the cut is always right after a
special token the chat template writes, and `tokenizers` tokenizes the text between special
tokens as separate pieces.

    cache = PrefixCache.for_tokenizer(tokenizer, template_source)   # None: cannot be exact
    ids = cache.encode(text)        # as tokenizer.encode(text, add_special_tokens=False).ids

Self-checks: at load, a sample conversation is tokenized whole and from every cut, and the
cache is only used when they agree; then every VERIFY_EVERY-th reuse is compared against a
whole encode, and a difference turns the cache off for good (logged, counted).
"""

from __future__ import annotations

import bisect
import logging
import re
from collections import OrderedDict
from typing import Any

log = logging.getLogger("hgxserve.proxy")

# Token ids kept (each ~36 bytes as Python ints: ~36 MiB at the bound); a conversation's
# prefix is remembered at its first and last CUTS_KEPT cuts
MAX_CACHED_TOKENS = 1 << 20
MAX_ENTRIES = 1 << 16
CUTS_KEPT = 4
VERIFY_EVERY = 64


def fast_ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=special).ids without the character offsets
    `encode` computes and the proxy does not use: `encode_batch_fast` of one text, the same ids
    for ~35 % less CPU (benchmarks/bench_proxy.py, docs/proxy.md "CPU per request")."""
    ids: list[int] = tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids
    return ids


def _cut_tokens(tokenizer: Any, template: str) -> list[str]:
    """Special tokens the template writes that cut exactly: not stripping what follows them."""
    found = []
    for tok in tokenizer.get_added_tokens_decoder().values():
        if tok.special and not tok.rstrip and not tok.single_word and tok.content in template:
            found.append(tok.content)
    return sorted(found, key=len, reverse=True)


class PrefixCache:
    """Token ids of rendered-prompt prefixes that end right after a special token."""

    def __init__(self, tokenizer: Any, cut_tokens: list[str]) -> None:
        self.tokenizer = tokenizer
        self.cut_re = re.compile("|".join(re.escape(t) for t in cut_tokens))
        # key: chain hash of the segments up to a cut -> (the ids list, tokens up to the cut)
        self.entries: OrderedDict[int, tuple[list[int], int]] = OrderedDict()
        self.refs: dict[int, int] = {}  # id(ids list) -> entries that hold it
        self.tokens = 0
        self.enabled = True
        self.hits = 0
        self.misses = 0
        self.mismatches = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, template: str | None, sample: str) -> PrefixCache | None:
        """A cache for this tokenizer and chat template, when exact on `sample` (a rendered
        conversation); else None."""
        cuts = _cut_tokens(tokenizer, template or "")
        if not cuts:
            return None
        cache = cls(tokenizer, cuts)
        whole = cache._encode(sample)[0]
        for m in cache.cut_re.finditer(sample):
            split = cache._encode(sample[: m.end()])[0] + cache._encode(sample[m.end() :])[0]
            if split != whole:
                log.info("chat prompt prefixes are tokenized whole: this tokenizer does not "
                         "split at %r", m.group())  # fmt: skip
                return None
        return cache

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def _keys(self, text: str) -> list[tuple[int, int]]:
        """(cut position, chain hash of the text up to it) for every cut."""
        out = []
        key, last = 0, 0
        for m in self.cut_re.finditer(text):
            key = hash((key, text[last : m.end()]))
            last = m.end()
            out.append((last, key))
        return out

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return fast_ids(self.tokenizer, text, False)
        keys = self._keys(text)
        for i in range(len(keys) - 1, -1, -1):
            found = self.entries.get(keys[i][1])
            if found is not None:
                return self._hit(text, keys, i, found)
        self.misses += 1
        ids, offsets = self._encode(text)
        self._remember(keys, ids, offsets, (0, 0))
        return ids

    def _hit(
        self, text: str, keys: list[tuple[int, int]], i: int, found: tuple[list[int], int]
    ) -> list[int]:
        self.hits += 1
        cut = keys[i][0]
        self.entries.move_to_end(keys[i][1])
        rest, offsets = self._encode(text[cut:])
        ids = found[0][: found[1]] + rest
        if self.hits % VERIFY_EVERY == 0:
            whole = fast_ids(self.tokenizer, text, False)
            if ids != whole:
                self.mismatches += 1
                self.enabled = False
                log.error("chat prompt prefix reuse differed from a whole tokenization: "
                          "turned off")  # fmt: skip
                return whole
        self._remember(keys[i + 1 :], ids, offsets, (cut, found[1]))
        return ids

    def _remember(
        self,
        keys: list[tuple[int, int]],
        ids: list[int],
        offsets: list[tuple[int, int]],
        base: tuple[int, int],
    ) -> None:
        """Keep `ids` under the first and last CUTS_KEPT of `keys`; `offsets` are those of the
        tokens from `base` = (chars, tokens) on, counted from its chars."""
        base_chars, base_tokens = base
        chosen = keys if len(keys) <= 2 * CUTS_KEPT else keys[:CUTS_KEPT] + keys[-CUTS_KEPT:]
        ends = [end for _, end in offsets]
        added = False
        for cut, key in chosen:
            if key in self.entries:
                continue
            n = base_tokens + bisect.bisect_right(ends, cut - base_chars)
            self.entries[key] = (ids, n)
            self.refs[id(ids)] = self.refs.get(id(ids), 0) + 1
            added = True
        if added:
            self.tokens += len(ids)
        self._evict()

    def _evict(self) -> None:
        while self.entries and (self.tokens > MAX_CACHED_TOKENS or len(self.entries) > MAX_ENTRIES):
            _, (ids, _) = self.entries.popitem(last=False)
            left = self.refs[id(ids)] - 1
            if left:
                self.refs[id(ids)] = left
            else:
                del self.refs[id(ids)]
                self.tokens -= len(ids)
