"""Prompt-lookup proposals: continue the sequence the way it continued the last time its
current suffix appeared (code edits, quoting, structured output repeat themselves)."""
from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int, window: int = 4096) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n
    tokens, trying n = n_max down to n_min; [] when no suffix recurs. Only the last `window`
    tokens are searched, so the cost per step stays bounded on long contexts."""
    total = len(token_ids)
    if k <= 0 or total < n_min + 1:
        return []
    start = max(0, total - window)
    hay = token_ids[start:]
    for n in range(min(n_max, len(hay) - 1), n_min - 1, -1):
        suffix = hay[-n:]
        first = suffix[0]
        # latest match first: recent text predicts better; the suffix itself (at len - n) is excluded
        for i in range(len(hay) - n - 1, -1, -1):
            if hay[i] == first and hay[i:i + n] == suffix:
                return hay[i + n:i + n + k]
    return []
