"""Torch-facing readers over sprout's on-disk formats (`sprout.formats`). Loaders never import
trainers; trainers take the iterables these produce and never open files themselves.

    token_batches.py       pretraining: token streams, per-rank spans, random windows over `.bin`/HDF5
    sft_batches.py         packed SFT rows, shifted for next-token prediction
    preference_batches.py  preference pairs, chosen and rejected sides of a micro-batch
    prompt_batches.py      RL prompts, rendered once, split over ranks; `check_held_out`
    order.py               the seeded, resumable training order of whole items (rows, pairs, prompts)
"""
