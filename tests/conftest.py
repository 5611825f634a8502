"""Shared fixtures, and how the suite splits over pytest-xdist workers (`make test`: `-n 2
--dist loadgroup`).

Each worker builds its own session- and module-scoped fixtures, so `pytest_itemcollected` puts
the tests that share an expensive one in one xdist group: those of the real SmolLM2 model (the
`smollm2` fixture), and per module those using a module- or session-scoped fixture of that
module's own; every other test goes to whichever worker is free. Tests of the real model carry
the `real_model` mark, so a checkout without the mirror's model can leave them out
(`-m "not real_model"`). On a worker, the scripts a test starts get one torch thread
(OMP_NUM_THREADS=1, unless set). The suite writes bytecode (git-ignored `__pycache__`) even
where PYTHONDONTWRITEBYTECODE is set, and drops the variable for the processes it starts, so its
hundreds of processes do not each compile sprout again. Its writes skip the fsync (SPROUT_FSYNC=0,
`sprout.atomic`; unless set): every file it writes is thrown away, and they stay atomic for
readers and killed processes; tests/test_atomic.py checks that outside the suite they are fsynced.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL = "smollm2"  # the session fixture of the mirror's real model (tests using it: mark real_model)
SHARED_FIXTURES = (REAL_MODEL,)  # expensive session fixtures: the tests using one form a group of its name
os.environ.setdefault("SPROUT_FSYNC", "0")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def xdist_group_of(item) -> str | None:
    """The xdist group of a test (module doc), or None to let any worker take it."""
    names = set(item.fixturenames)
    for fixture in SHARED_FIXTURES:
        if fixture in names:
            return fixture
    defs = item._fixtureinfo.name2fixturedefs
    if any(d[-1].scope in ("module", "session") and d[-1].func.__module__ != __name__
           for name in names for d in [defs.get(name)] if d):
        return item.module.__name__
    return None


def pytest_itemcollected(item):
    """Marks the test's group as it is collected: xdist's worker reads the marks into the test
    ids in its `pytest_collection_modifyitems`, which runs before a conftest's."""
    group = xdist_group_of(item)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))
    if REAL_MODEL in item.fixturenames:
        item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def mirror() -> Path:
    """The local data mirror (`sprout.mirror.mirror_dir`: $SPROUT_MIRROR, else ../shared/data); skips when absent."""
    from sprout.mirror import mirror_dir

    path = mirror_dir()
    if path is None or not (path / "MANIFEST.md").is_file():
        pytest.skip(f"no data mirror at {path}")
    return path


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Test models are tiny: one intra-op thread is faster than two fighting over small ops."""
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def r50k(mirror):
    """tiktoken r50k_base, loaded offline from the mirror's ranks."""
    from sprout.tokenizer import load_tokenizer

    return load_tokenizer("tiktoken:r50k_base", mirror=str(mirror))


@pytest.fixture(scope="session")
def sp(tmp_path_factory):
    """A tiny SentencePiece model with the chat control tokens, trained by sprout itself."""
    from sft_fixtures import tiny_sentencepiece

    return tiny_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.fixture(params=["r50k", "sp"])
def tok(request):
    return request.getfixturevalue(request.param)


SMOLLM2_GGUF = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2(mirror, tmp_path_factory):
    """(transformers' GGUF-loaded model, the run folder): the mirror's SmolLM2 GGUF imported
    (`sprout.model.hf_import`) and dequantised once per session, for the import, stage and export tests;
    the import's own transformers model is the reference."""
    pytest.importorskip("transformers", reason="transformers (extra sprout[import]) reads GGUF files")
    pytest.importorskip("gguf", reason="the gguf package (extra sprout[import]) reads GGUF files")
    from sprout.model.hf_import import read_source, write_run

    root = tmp_path_factory.mktemp("smollm2")
    imported = read_source(str(mirror / SMOLLM2_GGUF), root / "work")
    write_run(imported, root / "run")
    return imported.source.hf_model, root / "run"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A Hugging Face folder of a tiny random Llama shaped like SmolLM2 (tied embeddings, GQA, a
    2,048-token context) with a ChatML byte-level BPE tokenizer (tests/hf_fixtures.py): what
    scripts/import_model.py and the smollm2 preset take as --model, in place of the real GGUF."""
    pytest.importorskip("transformers", reason="transformers (extra sprout[import]) saves the model folder")
    from hf_fixtures import hf_folder

    return hf_folder(tmp_path_factory.mktemp("tiny_llama") / "hf", "llama tied", max_position_embeddings=2048)
