"""Every ```python block in docs/*.md and README.md runs (blocks of one file share a namespace)."""

import re
import warnings
from pathlib import Path

import pytest

from dtype_policies import CPUFloat16Warning

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_code_blocks_run(path):
    blocks = BLOCK.findall(path.read_text())
    if not blocks:
        pytest.skip(f"{path.name} has no python blocks")
    namespace = {"__name__": f"doc_{path.stem}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        warnings.simplefilter("ignore", UserWarning)
        for index, block in enumerate(blocks):
            try:
                exec(compile(block, f"{path.name}[block {index}]", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{path.name} block {index} failed: {e!r}\n{block}") from e
