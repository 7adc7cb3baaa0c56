"""tools/without_triton.py runs a script as on a machine without Triton."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_script_sees_no_triton_and_gets_its_arguments(tmp_path):
    script = tmp_path / "probe.py"
    (tmp_path / "sibling.py").write_text("WHERE = 'beside the script'\n")
    script.write_text("import importlib.util, sys\n"
                      "import sibling  # importable as `python probe.py` makes it\n"
                      "import torch.utils._triton as t\n"
                      "from minagi import devices, swiglu\n"
                      "print(sys.argv[1:], importlib.util.find_spec('triton'), t.has_triton_package(), "
                      "devices.has_triton(), swiglu.TRITON_AVAILABLE)\n")
    fake = tmp_path / "site" / "triton"  # a Triton the script would find, were it not hidden
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    seen = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('triton'))"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert seen.stdout.startswith("ModuleSpec(name='triton'"), seen.stderr  # the fake is there to hide
    done = subprocess.run([sys.executable, str(REPO / "tools" / "without_triton.py"), str(script), "--a", "b"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['--a', 'b'] None False False False"
