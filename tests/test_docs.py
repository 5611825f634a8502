"""The docs say what the code does: the generated config reference is current, every command
README.md shows names a script, make target and flags that exist, every relative link in
README.md and docs/ reaches a file, and the package map of src/sprout/__init__.py names every
module.

The README's commands are checked through their scripts' --help, all in one interpreter
(a --help never imports torch, so this takes a second or two).
"""

from __future__ import annotations

import json
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REGENERATE = "make docs (or: python scripts/config_reference.py)"
# docs/_incoming/ holds drafts waiting to be merged into the guides: not pages yet
PAGES = [README] + sorted(p for p in (ROOT / "docs").rglob("*.md") if "_incoming" not in p.relative_to(ROOT).parts)
HELP_ALL = """
import contextlib, io, json, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv, text = [script, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:  # a script that fails to import: reported, the others still checked
        code = repr(exc)
    out[script] = {"exit": code, "help": text.getvalue(), "torch": "torch" in sys.modules}
print(json.dumps(out))
"""


def test_the_config_reference_is_what_the_generator_writes():
    render = runpy.run_path(str(ROOT / "scripts" / "config_reference.py"), run_name="config_reference")["render"]
    page = ROOT / "docs" / "reference" / "config.md"
    assert page.exists(), f"{page} is missing: run {REGENERATE}"
    assert page.read_text(encoding="utf-8") == render(), \
        f"docs/reference/config.md differs from the config dataclasses: run {REGENERATE}"


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced ```bash (sh, shell, console) code blocks of a Markdown text."""
    return re.findall(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", text, flags=re.M | re.S)


def readme_commands() -> list[list[str]]:
    """Every command of README.md's shell code blocks as words (continuations joined, comments and a
    leading `$ ` dropped, `&&` splitting two commands)."""
    commands = []
    for block in shell_blocks(README.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.removeprefix("$ "), comments=True)
            while words:  # `a && b`: two commands
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return commands


def script_calls(commands: list[list[str]]) -> tuple[list[str], dict[str, set[str]]]:
    """(make targets, {script: the --flags a command passes it}) of `commands`: `python
    scripts/X.py ...` (any python) and `accelerate launch [its options] scripts/X.py ...`."""
    targets, flags = [], {}
    for words in commands:
        if words[0] == "make":
            targets += [w for w in words[1:] if "=" not in w and not w.startswith("-")]
            continue
        is_python = Path(words[0]).name.startswith("python")
        if not (is_python or words[:2] == ["accelerate", "launch"]):
            continue
        script = next((w for w in words[1:] if w.endswith(".py")), None)
        if script is None or (is_python and words[1] in ("-m", "-c")):
            continue
        after = words[words.index(script) + 1:]
        flags.setdefault(script, set()).update(w.split("=", 1)[0] for w in after if w.startswith("--"))
    return targets, flags


def option_key(flag: str) -> str:
    """An option as the command line reads it: - and _ alike after the leading --."""
    return flag[2:].replace("-", "_").rstrip(".")


def test_every_readme_command_names_a_target_script_and_flags_that_exist():
    targets, flags = script_calls(readme_commands())
    assert flags, "no `python scripts/X.py` command found in README.md's shell code blocks"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    missing_targets = [t for t in targets if not re.search(rf"^{re.escape(t)}:", makefile, flags=re.M)]
    assert not missing_targets, f"README.md runs make targets the Makefile lacks: {missing_targets}"
    missing = [s for s in flags if not (ROOT / s).is_file()]
    assert not missing, f"README.md runs scripts that do not exist: {missing}"
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *sorted(flags)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    helps = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = []
    for script, used in sorted(flags.items()):
        result = helps[script]
        if result["exit"] != 0 or result["torch"]:
            problems.append(f"{script} --help: exit {result['exit']}, torch imported: {result['torch']}")
            continue
        shown = {option_key(flag) for flag in re.findall(r"--[\w.-]+", result["help"])}
        problems += [f"{script}: {flag} is not in its --help" for flag in sorted(used) if option_key(flag) not in shown]
    assert not problems, "\n".join(problems)


def test_readme_config_and_preset_paths_exist():
    words = [w for command in readme_commands() for w in command]
    missing = [w for w in words if w.startswith("configs/") and not (ROOT / w).exists()]
    assert not missing, f"README.md names config paths that do not exist: {missing}"


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)  # code is not links
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # http:, mailto:, an anchor
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_the_package_map_names_every_module_of_sprout():
    """src/sprout/__init__.py's map lists each top-level module (`name.py`) and package (`name/`)
    of sprout, and nothing that is not there."""
    package = ROOT / "src" / "sprout"
    listed = set(re.findall(r"^ {4}(\w+(?:\.py|/))\s", (package / "__init__.py").read_text(), re.MULTILINE))
    present = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    present |= {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert listed == present, f"missing: {sorted(present - listed)}, gone: {sorted(listed - present)}"
