"""sprout's on-disk formats: one module per contract, its reader and writer, and the checks of
prepared data. No torch; nothing above the formats layer is imported.

    shards.py             `.bin` token shards: header, dtype, naming
    h5tokens.py           HDF5 pretraining tokens (`<dataset>_<split>.h5`)
    manifest.py           `manifest.json` of a token folder: what it holds, how it was made
    packed_sft.py         packed SFT rows (`sft.h5` / `sft_val.h5`), `prep_run_id`
    jsonl.py              checked JSONL files: what every JSON-lines contract shares
    preference_pairs.py   preference pairs JSONL
    preference_tokens.py  preference pairs as token sequences (the loader's and the checker's rendering)
    prompts.py            RL prompts JSONL (with a gold answer)
    data_paths.py         what a trainer's `--data` takes: a prep's folder or any file of it
    checkpoint_meta.py    a checkpoint's meta.json and folder names, read without torch
    verify_inputs.py      what every trainer checks of its data at start; the token folder's file rules
    audit_tokens.py       verify_shards.py's full audit of a token folder, on those rules
    maskcheck_sft.py      loss-mask checker of packed SFT rows, and their views
    maskcheck_pairs.py    loss-mask checker of preference pairs, and their views
    maskcheck_prompts.py  checker of rendered RL prompts, and their views
    maskcheck_views.py    the terminal and HTML views the three checkers share
"""
