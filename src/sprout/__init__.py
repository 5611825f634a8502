"""sprout: a small language model from raw text to an aligned reasoning model.

The core library (formats, tokenizers, chat template, model, losses) lives in this
package; `sprout.engine` holds the one training loop every stage shares, `sprout.stages`
the stages built on it, `sprout.pipeline` the preset runner and its report card, and the
top-level `data_loader` package turns the on-disk formats into torch batches.
"""

__version__ = "0.1.0"
