"""The model: the transformer, its heads, loading, sampling, import and export.

    config.py            ModelConfig, the architecture (checked as it is made), Llama 3 rope
                         scaling; no torch
    transformer.py       Transformer: the decoder-only LM (RMSNorm, rotary, GQA, SwiGLU), its
                         KV cache and the blocks' prefill/step forms
    heads.py             the scalar heads: RewardModel (score) and PolicyWithValue (value);
                         where a reward is read, padding ids
    load.py              a model from a checkpoint by its meta.json architecture, or a head
                         model on an LM's backbone
    generate.py          batched KV-cache sampling: rollouts, chat and evaluation
    decode.py            sampling's forward passes: prefill, then one token per row per step
    onednn.py            matmuls on oneDNN-packed weight copies (torch's private operators)
    chat_session.py      a multi-turn chat with a checkpoint
    hf_import.py         a published Llama/Qwen2/Mistral (folder, hub id, GGUF) -> a run folder
    hf_config.py         its config.json read as transformers reads it -> ModelConfig, or refused
    import_staging.py    the import's staging folder in the run folder; a killed import's leftovers
    export.py            a checkpoint -> a folder transformers loads, and its verification
    export_tokenizer.py  the tokenizer files of that export, one way per tokenizer kind
"""
