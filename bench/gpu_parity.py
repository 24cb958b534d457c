"""The parity grid on a GPU: the hook path's golden numbers (``tests/data/hook_path_golden.json``, made on a CPU)
reproduced by the one engine on CUDA (fp32 SmolLM2, Triton kernels, decode steps replayed as CUDA graphs).

    python -m bench.gpu_parity PATH_TO_SMOLLM2 [names,...] [triton|torch]      (writes $OUT/gpu_parity[-torch].json)

``torch``: the torch reference kernel on the GPU, steps run eagerly (where a case differs, this tells the
kernel's statistics from the rest of the step).
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from parity_cases import GOLDEN, layouts, run_case  # noqa: E402

from kvtier.engine import EngineConfig  # noqa: E402
from kvtier.hook import install  # noqa: E402
from kvtier.kernels.registry import make_backend  # noqa: E402
from kvtier.models import load_model  # noqa: E402


def main():
    model, tok = load_model(sys.argv[1], dtype="float32", device="cuda", attn_implementation=install())
    model.eval()
    names = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] != "all" else None
    kernel = sys.argv[3] if len(sys.argv) > 3 else "triton"
    rows = []
    for row in GOLDEN:
        case = row["case"]
        if names and case["name"] not in names:
            continue
        t0 = time.time()
        got = run_case(model, tok, layouts(model), case, kernel=make_backend(kernel), device="cuda",
                       config=EngineConfig(compile=False, graphs=kernel == "triton"))  # graphs replayed; one compile per engine would dominate
        out = {"case": case["name"], "wall_s": round(time.time() - t0, 1)}
        if "nll" in got:
            out.update(ppl=got["perplexity"], golden=row["perplexity"],
                       max_nll_diff=float(np.abs(np.array(got["nll"]) - np.array(row["nll"])).max()))
        else:
            out.update(outputs=got["outputs"], golden=row["outputs"], equal=got["outputs"] == row["outputs"])
        rows.append(out)
        print(json.dumps(out), flush=True)
    name = "gpu_parity.json" if kernel == "triton" else f"gpu_parity-{kernel}.json"
    Path(os.environ.get("OUT", "."), name).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
