"""Shared fixtures: tiny checkpoints built once per test session, example images."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "images"


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def llava_dir(tiny_models_root) -> Path:
    """Test-size LLaVA checkpoint (native layout, seed 0)."""
    from epd.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("llava", tiny_models_root / "llava")


@pytest.fixture(scope="session")
def fastvlm_dir(tiny_models_root) -> Path:
    """Test-size FastVLM checkpoint (native layout, seed 0)."""
    from epd.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("fastvlm", tiny_models_root / "fastvlm")


@pytest.fixture(scope="session")
def model_dirs(llava_dir, fastvlm_dir) -> dict[str, Path]:
    return {"llava": llava_dir, "fastvlm": fastvlm_dir}


@pytest.fixture(scope="session")
def example_image_paths() -> dict[str, Path]:
    """name (file stem) -> path of each image in examples/images."""
    paths = {p.stem: p for p in sorted(EXAMPLES.iterdir()) if p.is_file()}
    assert {"sunset", "bar_chart", "city_street", "cat", "spiral"} <= set(paths)
    return paths
