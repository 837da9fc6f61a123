"""The README's commands run and its links resolve.

Every ``python`` block of README.md carries a marker on the line before it, an HTML comment that does not render:
``<!-- readme-test: cpu -->`` (run here, on the CPU), ``<!-- readme-test: gpu -->`` (run on a Hopper GPU, in README
order and one namespace, as a reader pastes them) or ``<!-- readme-test: gpu fla -->`` (also needs
flash-linear-attention). Every block is compiled and the ``cute_kda`` names it uses must exist. Shell blocks: each
``make`` target exists in the Makefile and each script or file a command names exists. Links of README.md and of
every page under docs/ point to files of the repository, and so does every repository path they name; only docs/performance.md and docs/accuracy.md link into
``benchmarks/results/``. No commit hashes or dates in the README.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

import cute_kda

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[a-z ]+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_RESULT_PAGES = {"docs/performance.md", "docs/accuracy.md"}  # the pages that cite measured records


def _blocks(lang: str) -> list[tuple[str | None, str]]:
    return [(m["marker"], m["body"]) for m in _BLOCK.finditer(README.read_text()) if m["lang"] == lang]


def _python_blocks(marker: str | None = None) -> list[str]:
    return [body for found, body in _blocks("python") if marker is None or found == marker]


def test_every_python_block_is_marked():
    markers = [marker for marker, _ in _blocks("python")]
    assert markers and all(m in ("cpu", "gpu", "gpu fla") for m in markers), markers


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_python_block_compiles_and_names_what_exists(index):
    tree = ast.parse(_python_blocks()[index])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cute_kda":
            assert hasattr(cute_kda, node.attr), f"cute_kda.{node.attr}"


def test_cpu_blocks_run():
    blocks = _python_blocks("cpu")
    assert blocks
    for body in blocks:
        exec(compile(body, str(README), "exec"), {"__name__": "readme"})


def test_gpu_blocks_pass_every_check_but_the_device():
    """On CPU tensors each GPU block's call gets through the dtype, shape and flag checks, which come before the
    device check: the block is a valid call (what it computes the GPU test below runs)."""
    namespace = {"__name__": "readme"}
    blocks = _python_blocks("gpu")
    assert blocks
    for body in blocks:
        with pytest.raises(ValueError, match="CUDA"):
            exec(compile(body.replace('"cuda"', '"cpu"'), str(README), "exec"), namespace)


def _run_gpu_blocks(markers: tuple[str, ...]) -> None:
    namespace = {"__name__": "readme"}
    for marker, body in _blocks("python"):
        if marker in markers:
            exec(compile(body, str(README), "exec"), namespace)


@pytest.mark.gpu
def test_gpu_blocks_run():
    _run_gpu_blocks(("gpu",))


@pytest.mark.gpu
@pytest.mark.fla
def test_gpu_blocks_run_with_fla():
    pytest.importorskip("fla.ops.kda")
    _run_gpu_blocks(("gpu", "gpu fla"))


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def test_shell_commands_name_what_exists():
    commands = [line.split("#")[0].strip() for _, body in _blocks("bash") for line in body.splitlines()]
    commands += re.findall(r"`((?:python3?|make|pip) [^`]+)`", README.read_text())  # inline commands
    assert commands
    targets = _make_targets()
    for command in filter(None, commands):
        words = [w for w in shlex.split(command) if "=" not in w or w.startswith("-")]
        if words[0] == "make":
            assert set(words[1:]) <= targets, command
        elif words[0] in ("python", "python3"):
            assert (ROOT / words[1]).is_file(), command
        else:
            assert words[0] == "pip", command


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_to_files_that_exist(page):
    missing = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert missing == []


_REPO_PATH = re.compile(r"\b(?:tests|benchmarks|scripts|examples|cute_kda|teaching)/[\w/.-]*[\w/]")


@pytest.mark.parametrize("page", [p for p in _pages() if p.name != "perf-log.md"],  # the log cites past trees
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(page):
    missing = sorted({path for path in _REPO_PATH.findall(page.read_text()) if not (ROOT / path).exists()})
    assert missing == []


def test_only_the_measurement_pages_link_into_the_results():
    pages = [p for p in _pages() if str(p.relative_to(ROOT)) not in _RESULT_PAGES | {"docs/perf-log.md"}]
    offenders = [str(p.relative_to(ROOT)) for p in pages if "results/" in " ".join(_LINK.findall(p.read_text()))]
    assert offenders == []


def test_readme_has_no_hashes_dates_or_team_tooling():
    text = README.read_text()
    assert not re.findall(r"`[0-9a-f]{7,40}`", text)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert "benchmarks/results" not in text
    assert "../shared" not in text and "contributing/" not in text
    assert len(text.splitlines()) <= 300  # short: issue 35 aimed at 250 before the Serving section (decode, verify, prefill on a pool)
