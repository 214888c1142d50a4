"""Incremental detokenizer on a real byte-level BPE tokenizer trained in-process."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tokenmill.engine.detokenizer import OutputText
from tokenmill.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, general Kenobi.",
    "你好，世界。我们今天学习分词。",
    "机器学习很有趣。",
]
TEXT = "Hello world! 你好，世界。很好的机器学习 fox 😀 jumps over the lazy dog. The END"


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


def stream(tok, ids, params, prompt=None):
    out = OutputText(tok, prompt if prompt is not None else tok.encode("Hello"), params)
    chunks, stop = [], None
    for t in ids:
        stop = out.append(t)
        if stop is not None:
            break
        chunks.append(out.take_delta(finished=False))
    chunks.append(out.take_delta(finished=True))
    return out, chunks, stop


def test_tokenizer_splits_characters(tok):
    # the test is only meaningful if some character spans several tokens
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("prompt", [[], None])
def test_roundtrip_no_replacement_chars(tok, prompt):
    ids = tok.encode(TEXT)
    out, chunks, stop = stream(tok, ids, SamplingParams(), prompt)
    assert stop is None
    assert "".join(chunks) == tok.decode(ids) == TEXT == out.text
    assert all("\ufffd" not in c for c in chunks)
    assert sum(1 for c in chunks if c) > 10   # genuinely incremental


def test_special_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Hello 你好") + [eos] + tok.encode(" world")
    _, chunks, _ = stream(tok, ids, SamplingParams())
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == "Hello 你好 world"
    _, chunks, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=False)
    assert "<eos>" in "".join(chunks)


def test_unfinished_character_flushed_at_end(tok):
    ids = tok.encode("abc 很")
    assert "\ufffd" in tok.decode(ids[:-1])
    _, chunks, _ = stream(tok, ids[:-1], SamplingParams())
    assert all("\ufffd" not in c for c in chunks[:-1])
    assert "".join(chunks) == tok.decode(ids[:-1])


@pytest.mark.parametrize("stop", ["世界", "lazy dog", "o", "jumps", "。很好"])
def test_stop_string_removed(tok, stop):
    ids = tok.encode(TEXT)
    out, chunks, got = stream(tok, ids, SamplingParams(stop=[stop, "never-there"]))
    expected = TEXT[:TEXT.index(stop)]
    assert got == stop
    assert out.text == expected
    assert "".join(chunks) == expected
    assert stop not in "".join(chunks)


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode(TEXT)
    stop = "学习 fox"
    # find a stop string whose match needs more than one token
    spans = [i for i in range(1, len(ids)) if stop in tok.decode(ids[:i + 1]) and stop not in tok.decode(ids[:i])]
    i = spans[0]
    assert stop not in tok.decode(ids[i:i + 1])
    out, chunks, got = stream(tok, ids, SamplingParams(stop=stop))
    assert got == stop and out.text == TEXT[:TEXT.index(stop)] == "".join(chunks)


def test_first_completed_then_earliest_stop_wins(tok):
    ids = tok.encode("abc xyz def")
    out, _, got = stream(tok, ids, SamplingParams(stop=["def", "xyz def", "z d"]))
    assert got == "z d" and out.text == "abc xy"   # "z d" completes first while streaming
    # both complete in the same token: the one that starts first wins, whatever the list order
    ids = tok.encode(" Hello")
    assert len(ids) == 1
    out, _, got = stream(tok, ids, SamplingParams(stop=["llo", "He"]))
    assert got == "He" and out.text == " "


def test_hold_back(tok):
    out = OutputText(tok, [], SamplingParams(stop=["fox jumps"]))
    for t in tok.encode("the quick fox"):
        assert out.append(t) is None
    # "fox" could start "fox jumps": held back; " fox" with its space too? no, the stop has no space
    assert out.take_delta(finished=False) == "the quick "
    for t in tok.encode(" ran"):
        out.append(t)
    assert out.take_delta(finished=False) == "fox ran"
    assert out.take_delta(finished=False) == ""
    for t in tok.encode(" fox"):
        out.append(t)
    assert out.take_delta(finished=False) == " "
    assert out.take_delta(finished=True) == "fox"
    assert out.text == "the quick fox ran fox"


def test_hold_back_partial_prefix_then_stop(tok):
    out = OutputText(tok, [], SamplingParams(stop=["END!"]))
    for t in tok.encode("The EN"):
        out.append(t)
    assert out.take_delta(finished=False) == "The "
    stop = None
    for t in tok.encode("D! more"):
        stop = stop or out.append(t)
    assert stop == "END!"
    assert out.take_delta(finished=True) == ""
    assert out.text == "The "


def test_window_trimming_long_output(tok):
    ids = tok.encode(TEXT * 40)
    out, chunks, _ = stream(tok, ids, SamplingParams())
    assert "".join(chunks) == TEXT * 40
    assert len(out._ids) < 300   # decode window stays bounded
