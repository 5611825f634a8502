import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def mirror() -> Path:
    """The local data mirror (../shared/data or $SPROUT_MIRROR); skips when absent."""
    path = Path(os.environ.get("SPROUT_MIRROR", ROOT.parent / "shared" / "data"))
    if not (path / "MANIFEST.md").is_file():
        pytest.skip(f"no data mirror at {path}")
    return path


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Test models are tiny: one intra-op thread is faster than two fighting over small ops."""
    import torch

    torch.set_num_threads(1)
    yield
