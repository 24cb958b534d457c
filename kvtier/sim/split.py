"""The validation split: which measured rows the calibration never sees, fixed before any fit.

Rows are named by configuration (:mod:`kvtier.sim.measured`), the same name on every GPU kind, so one list holds
out the same configurations on the H200 and on the H100 (a name a kind did not run holds nothing out there).
Every group keeps rows out; the rest are its anchors. What each held-out row tests:

- decode: a Llama-shape resident row at B=16 and 50% on the device, the 128k all-HBM row (a context 4x any
  anchor's), and two real-SmolLM2 resident rows (B=1 at 50%, B=16 at 20%).
- recall: Llama-shape B=16 at 20%, the 128k row at 10% (either kind's recall cache), real SmolLM2 B=1 with the
  recall cache taking the rest of the budget, and the capacity row (80 sequences) at that share.
- prefill: the cold 8k prompt in chunks of 512 (16 chunks; the anchors prefill in one or two chunks, or hit).
- serving: 16 decoders beside 2,048-token chunks (the row that decides seed 002's ITL), and one session alone.

Cross-hardware validation holds out every row of the kind it predicts. This file was committed before the first
fit of the roofline model (git log); it is not to be edited after seeing errors.
"""

HELD_OUT = {
    "decode": ("e2e llama8b-shape 16x8192 resident 0.5", "e2e llama8b-shape 1x131072 all 1",
               "e2e smollm2 1x8192 resident 0.5", "e2e smollm2 16x8192 resident 0.2"),
    "recall": ("e2e llama8b-shape 16x8192 topk 0.2 r816", "e2e llama8b-shape 1x131072 topk 0.1 r409",
               "e2e llama8b-shape 1x131072 topk 0.1 r698", "e2e smollm2 1x8192 topk 0.2 r71",
               "e2e smollm2 80x8192 topk 0.2 r5823"),
    "prefill": ("serve ttft 8192 cold, chunks of 512",),
    "serving": ("serve itl B=16 decode + 2048-token chunks", "serve goodput 1 session alone ITL"),
}


def held_out(row_id: str) -> bool:
    return any(row_id in ids for ids in HELD_OUT.values())
