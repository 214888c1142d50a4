"""Engine TokenLogprobs -> the two OpenAI logprobs shapes (completions and chat)."""
from __future__ import annotations

from typing import Any

from tokenmill.sequence import TokenLogprobs

MIN_LOGPROB = -9999.0     # JSON has no -inf; OpenAI clients get a large negative number instead


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB     # also maps NaN to MIN_LOGPROB


class TokenTexts:
    """Token id -> the text it decodes to on its own. Cached: decoding one id through the HF
    tokenizer costs microseconds each, and the same ids recur constantly."""

    def __init__(self, tokenizer: Any, max_size: int = 200_000) -> None:
        self.tokenizer = tokenizer
        self.max_size = max_size
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if len(self._cache) < self.max_size:
                self._cache[token_id] = text
        return text


def completion_logprobs(lps: list[TokenLogprobs], texts: TokenTexts, text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions shape: parallel lists; top_logprobs maps token text -> logprob and
    includes the sampled token (as OpenAI and vLLM do)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = text_offset
    for lp in lps:
        tok = texts(lp.token_id)
        tokens.append(tok)
        token_lps.append(_lp(lp.logprob))
        top = {texts(t): _lp(v) for t, v in lp.top.items()}
        top.setdefault(tok, _lp(lp.logprob))
        tops.append(top)
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(plp: list[TokenLogprobs | None], texts: TokenTexts) -> list[dict[str, Any] | None]:
    """vLLM's shape: null for the first prompt token, then {token id: {logprob, rank,
    decoded_token}} holding the actual prompt token first and then the top-n alternatives."""
    out: list[dict[str, Any] | None] = []
    for lp in plp:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": texts(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top.items(), start=1):
            entry.setdefault(str(t), {"logprob": _lp(v), "rank": rank, "decoded_token": texts(t)})
        out.append(entry)
    return out


def chat_logprobs(lps: list[TokenLogprobs], texts: TokenTexts) -> dict[str, Any]:
    def entry(token_id: int, value: float) -> dict[str, Any]:
        tok = texts(token_id)
        return {"token": tok, "logprob": _lp(value), "bytes": list(tok.encode("utf-8", "replace"))}

    content = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in lp.top.items()]
        content.append(e)
    return {"content": content}
