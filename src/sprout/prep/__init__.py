"""Data preparation: raw sources -> the on-disk formats the trainers read (`sprout.formats`).

    pretrain.py         pretraining data: sources -> clean -> tokenize -> dedup -> split -> shards/HDF5
    sources.py          streaming document readers (.txt, JSON Lines/arrays, parquet, hub datasets)
    compressed.py       .gz and .zst inputs read as plain byte streams
    clean.py            text normalisations and filters applied to every pretraining document
    keys.py             dedup keys and the hash split: one definition every prep uses
    mixture.py          dedup, split, source weighting and shuffled runs over per-document arrays
    store.py            pretraining prep's temporary files, split writers and key sidecar
    tokenizer_train.py  SentencePiece BPE training on the pretraining sources
    chat_sources.py     SFT sources (Alpaca, Dolly, GSM8K, chat JSONL, arithmetic) -> conversations
    sft_data.py         SFT data: conversations -> (ids, loss_mask) -> packed HDF5 rows
    packing.py          best-fit packing of examples into rows, the over-long policy
    preference_data.py  preference pairs (HH-RLHF, UltraFeedback, JSONL, arithmetic) -> JSONL
    rl_prompts.py       RL prompts (GSM8K, arithmetic, JSONL) with gold answers -> JSONL
    arithmetic.py       the arithmetic problem generator shared by SFT, preference and RL data
    records.py          what the record preps share: drops, record ids, shuffled train/test writes
    cli.py              the command line every prep script shares
"""
