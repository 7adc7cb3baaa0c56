import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The tests import minagi from this clone, installed or not; so do the tools and scripts they run in
# subprocesses (the tools import the installed package: here, this clone's, through PYTHONPATH).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

from tiny import write_tiny_text  # noqa: E402


@pytest.fixture
def data_path(tmp_path) -> Path:
    """The tiny text, written into this test's tmp_path."""
    return write_tiny_text(tmp_path)
