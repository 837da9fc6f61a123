"""The support matrix that docs/support.md and the README show is the one the code accepts
(``scripts/support_matrix.py`` probes each cell through the entry point's translation and ``cute_kda.call.resolve``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("support_matrix", ROOT / "scripts" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["docs/support.md", "README.md"])
def test_docs_show_the_matrix_the_code_accepts(page):
    table = _script().markdown()
    assert table in (ROOT / page).read_text(), "regenerate: python3 scripts/support_matrix.py"


def test_a_refused_cell_names_what_it_refuses():
    """The probe counts only the errors that name the argument: an unexpected exception fails loudly."""
    import torch

    script = _script()
    assert script._accepts("chunk_kda", "softplus", {"dtype": torch.float16})  # fp16 inference: the kernels take it
    assert script._accepts("kda_forward", "safe", {"dtype": torch.float16, "training": True})  # and fp16 training
    with pytest.raises(NotImplementedError, match="grouped value heads"):
        script._call("kda_forward", "safe", value_heads=4, training=True)
    assert script._accepts("chunk_gated_delta_rule", "none", {"packed": True})
    assert script._accepts("kda_forward", "safe", {"beta_dtype": torch.float32})  # converted where it enters
