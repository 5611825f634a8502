"""The data-mirror lookup: explicit folder, else $SPROUT_MIRROR, else ../shared/data beside the repository."""

from pathlib import Path

import pytest

import sprout.mirror as mirror_module
from sprout.errors import SproutError
from sprout.mirror import expand_path, mirror_dir


@pytest.fixture()
def default_dir(tmp_path, monkeypatch):
    """A stand-in for ../shared/data beside the repository (not created)."""
    path = tmp_path / "shared" / "data"
    monkeypatch.setattr(mirror_module, "DEFAULT_MIRROR", path)
    monkeypatch.delenv("SPROUT_MIRROR", raising=False)
    return path


def test_explicit_then_environment_then_default(default_dir, tmp_path, monkeypatch):
    assert mirror_dir() is None                      # no flag, no variable, no default folder: the hub
    default_dir.mkdir(parents=True)
    assert mirror_dir() == default_dir               # the folder beside the repository, once it exists
    monkeypatch.setenv("SPROUT_MIRROR", str(tmp_path / "env"))
    assert mirror_dir() == tmp_path / "env"          # the variable wins over the default
    assert mirror_dir(tmp_path / "flag") == tmp_path / "flag"  # an explicit folder wins over both
    monkeypatch.setenv("SPROUT_MIRROR", "")
    assert mirror_dir() is None                      # set but empty: no mirror, default off
    assert mirror_dir(str(tmp_path / "flag")) == tmp_path / "flag"


def test_default_is_found_from_the_module_not_the_cwd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    repo = Path(__file__).resolve().parents[1]
    assert mirror_module.REPO_ROOT == repo and (repo / "src" / "sprout" / "mirror.py").is_file()
    assert mirror_module.DEFAULT_MIRROR == repo.parent / "shared" / "data"


def test_expand_path(default_dir, tmp_path):
    assert expand_path("${SPROUT_MIRROR}/x.txt", "/m") == "/m/x.txt"
    assert expand_path("$SPROUT_MIRROR/x.txt", "/m") == "/m/x.txt"
    assert expand_path("plain/x.txt") == "plain/x.txt"
    with pytest.raises(SproutError, match=r"x.txt: uses \$\{SPROUT_MIRROR\} but no mirror is set"):
        expand_path("${SPROUT_MIRROR}/x.txt")
    default_dir.mkdir(parents=True)
    assert expand_path("${SPROUT_MIRROR}/x.txt") == f"{default_dir}/x.txt"
