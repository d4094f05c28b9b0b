"""The README's Python quick start runs as written (its blocks in order, one namespace)."""

import math
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    pytest.importorskip("transformers")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["small"].layer1[0].conv1.out_channels == 16 - math.ceil(16 * 0.7)
    assert namespace["pruner"].kept == [1, 64, 1, 64]  # half the kv heads and MLP neurons
    assert abs(float(namespace["mask"].detach().sum()) - 178.0) < 1e-3
