"""Torch-facing readers over sprout's on-disk formats.

Token streams and windows over `.bin` shards and HDF5 (`data_loader.tokens`), packed
SFT rows (`data_loader.sft`), preference pairs (`data_loader.preferences`), RL prompts
(`data_loader.prompts`). Loaders never import trainers; trainers take the iterables these
produce and never open files themselves.
"""
