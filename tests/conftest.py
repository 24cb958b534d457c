import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32, CPU, sdpa attention) and its tokenizer."""
    from kvtier.models import load_model

    model, tokenizer = load_model(None, dtype="float32", device="cpu", attn_implementation="sdpa")
    model.eval()
    return model, tokenizer
