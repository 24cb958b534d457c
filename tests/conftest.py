import os

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    # Triton kernels run through the interpreter on a CPU; it must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32, CPU, sdpa attention) and its tokenizer."""
    from kvtier.models import load_model

    model, tokenizer = load_model(None, dtype="float32", device="cpu", attn_implementation="sdpa")
    model.eval()
    return model, tokenizer
