"""`bench quality` math at toy scale: engine perplexity vs transformers on the same chunks."""
import math

import pytest
import torch
import transformers

from tests.tiny_models import save_tiny_model_dir
from tokenmill import LLM
from tokenmill.bench.quality import Variant, eval_chunks, greedy_agreement, parse_variants, perplexity
from tokenmill.bench.sharegpt import CALIBRATION_END, HELD_OUT_START, Conversation


def test_held_out_slice_is_disjoint_from_calibration():
    assert CALIBRATION_END <= HELD_OUT_START


def test_parse_variants():
    assert parse_variants(None, "m") == [Variant("float", "m")]
    assert parse_variants("a=m, b=q/dir@int8", "x") == [Variant("a", "m"), Variant("b", "q/dir", "int8")]
    for bad in ("m", "a=m,a=n", "=m"):
        with pytest.raises(ValueError):
            parse_variants(bad, "m")


def test_greedy_agreement():
    ref = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]]
    other = [[1, 2, 3, 4], [1, 2, 9, 4], [0, 6, 7, 8]]
    share, prefix = greedy_agreement(ref, other, 4)
    assert share == pytest.approx(1 / 3)
    assert prefix == pytest.approx((4 + 2 + 0) / 3)


def test_perplexity_matches_transformers(tmp_path):
    path = save_tiny_model_dir(tmp_path / "m")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    convs = [Conversation(str(i), [("human", "hello world " * (i + 2)), ("gpt", "the quick brown fox " * (i + 1))])
             for i in range(6)]
    chunks = eval_chunks(tok, convs, eval_tokens=80, chunk_tokens=16, seed=0)
    assert sum(len(c) - 1 for c in chunks) >= 80 and all(2 <= len(c) <= 16 for c in chunks)
    assert chunks == eval_chunks(tok, convs, eval_tokens=80, chunk_tokens=16, seed=0)
    llm = LLM(model=path, dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=256 * 4 * 512)
    ppl, nll, n = perplexity(llm, chunks)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref_nll, ref_n = 0.0, 0
    with torch.no_grad():
        for c in chunks:
            lp = torch.log_softmax(hf(torch.tensor([c])).logits[0].double(), dim=-1)
            ref_nll -= lp[torch.arange(len(c) - 1), torch.tensor(c[1:])].sum().item()
            ref_n += len(c) - 1
    assert n == ref_n
    assert nll == pytest.approx(ref_nll, rel=1e-5)
    assert ppl == pytest.approx(math.exp(ref_nll / ref_n), rel=1e-5)
