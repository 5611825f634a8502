"""Torch-facing readers over sprout's on-disk formats.

Token streams and windows over `.bin` shards and HDF5 (`data_loader.token_batches`), packed
SFT rows (`data_loader.sft_batches`), preference pairs (`data_loader.preference_batches`), RL prompts
(`data_loader.prompt_batches`). Loaders never import trainers; trainers take the iterables these
produce and never open files themselves.
"""
