import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tiny import write_tiny_text  # noqa: E402


@pytest.fixture
def data_path(tmp_path) -> Path:
    """The tiny text, written into this test's tmp_path."""
    return write_tiny_text(tmp_path)
