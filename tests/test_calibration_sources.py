"""`tokenmill quantize --calib`: which token sequences each calibration source yields."""
import pytest
import transformers

from tests.tiny_models import save_tiny_model_dir
from tokenmill.bench import sharegpt
from tokenmill.bench.sharegpt import Conversation
from tokenmill.quantize import calibration_sequences

CONVS = [Conversation(str(i), [("human", f"question {i} " * 4), ("gpt", f"answer {i} " * 6)]) for i in range(5)]


@pytest.fixture
def tok(tmp_path, monkeypatch):
    monkeypatch.setattr(sharegpt, "load_sharegpt", lambda limit=None: CONVS[:limit])
    return transformers.AutoTokenizer.from_pretrained(save_tiny_model_dir(tmp_path / "m"))


def test_plain_source_is_the_quality_benchmarks_format(tok):
    seqs = calibration_sequences("sharegpt-plain:3", tok, max_len=12)
    want = [list(tok("\n\n".join(t for _, t in c.turns))["input_ids"])[:12] for c in CONVS[:3]]
    assert seqs == want


def test_unknown_source_and_too_many_conversations(tok):
    with pytest.raises(ValueError, match="unknown calibration source"):
        calibration_sequences("wiki:3", tok)
    with pytest.raises(ValueError, match="only 5 usable"):
        calibration_sequences("sharegpt-plain:6", tok)
