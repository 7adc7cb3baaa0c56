"""tools/gpu_mem_sampler.sh against fake nvidia-smi / rocm-smi / amd-smi executables and a fake sysfs.

PATH holds only a directory of fakes and a directory of links to the few utilities the script
needs (mktemp, rm, sleep, python3), so a real nvidia-smi or rocm-smi on this machine cannot leak
in, and a new dependency of the script on another utility shows up here as a failure.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BASH = shutil.which("bash")
if BASH is None:
    pytest.skip("bash is not installed", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_mem_sampler.sh"
COLUMNS = ["timestamp", "pid", "process", "dedicated", "shared", "local", "non_local"]
MIB = 1024 * 1024
# The external programs the sampler may run (everything else must be a bash builtin).
UTILITIES = ("mktemp", "rm", "sleep")
DEAD_PID = 99_999_999  # above any pid_max (at most 2**22)


class Sandbox:
    def __init__(self, root: Path):
        self.root = root
        self.fake = root / "fake"
        self.util = root / "util"
        self.sys = root / "sys"  # an empty fake sysfs unless a test fills it
        for d in (self.fake, self.util, self.sys):
            d.mkdir()
        for name in UTILITIES:
            found = shutil.which(name)
            assert found, f"test needs {name} on PATH"
            (self.util / name).symlink_to(found)
        (self.util / "python3").symlink_to(sys.executable)
        self.env = {
            "PATH": f"{self.fake}:{self.util}",
            "HOME": str(root),
            "TMPDIR": str(root),
            "LC_ALL": "C",
            "MINAGI_SYSFS_ROOT": str(self.sys),
        }

    def tool(self, name: str, stdout: str = "", stderr: str = "", rc: int = 0) -> Path:
        """A fake executable that logs its arguments and prints canned output."""
        (self.root / f"{name}.out").write_text(stdout)
        (self.root / f"{name}.err").write_text(stderr)
        path = self.fake / name
        path.write_text(
            f"#!{BASH}\n"
            f'printf "%s\\n" "$*" >> "{self.root}/{name}.args"\n'
            f'printf "%s" "$(< "{self.root}/{name}.out")"\n'
            f'printf "%s" "$(< "{self.root}/{name}.err")" >&2\n'
            f"exit {rc}\n"
        )
        path.chmod(0o755)
        return path

    def args_of(self, name: str) -> list[str]:
        return (self.root / f"{name}.args").read_text().splitlines()

    def card(self, name: str, vram: int, gtt: int | None = None) -> None:
        dev = self.sys / "class" / "drm" / name / "device"
        dev.mkdir(parents=True)
        (dev / "mem_info_vram_used").write_text(f"{vram}\n")
        (dev / "mem_info_vram_total").write_text(f"{64 << 30}\n")
        if gtt is not None:
            (dev / "mem_info_gtt_used").write_text(f"{gtt}\n")

    def run(self, *args: str, timeout: float = 10) -> subprocess.CompletedProcess:
        return subprocess.run(
            [BASH, str(SCRIPT), *args], env=self.env, cwd=self.root,
            capture_output=True, text=True, timeout=timeout,
        )

    def sample(self, *args: str) -> subprocess.CompletedProcess:
        return self.run("--count", "1", "--interval", "0", *args)


@pytest.fixture
def box(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def rows_of(text: str) -> list[dict[str, str]]:
    """Parses the CSV with the csv module; checks the header and that timestamps are ISO-8601."""
    reader = csv.DictReader(io.StringIO(text))
    assert reader.fieldnames == COLUMNS, text
    rows = list(reader)
    for row in rows:
        stamp = dt.datetime.fromisoformat(row["timestamp"])
        assert stamp.tzinfo is not None, row["timestamp"]
        assert None not in row, f"too many fields: {row}"
    return rows


def memory(row: dict[str, str]) -> tuple:
    return row["pid"], row["process"], row["dedicated"], row["shared"], row["local"], row["non_local"]


# ------------------------------------------------------------------------------------ nvidia-smi

NVIDIA_SEVERAL = (
    "101, /usr/bin/python3, 2048\n"
    "102, /opt/venv/bin/python3.11, 100\n"
    "103, /usr/lib/xorg/Xorg, 12\n"
    "102, /opt/venv/bin/python3.11, 28\n"  # the same process on a second GPU
    "104, /usr/bin/pythonista, 7\n"
    "105, /usr/bin/python, [N/A]\n"
)


def test_nvidia_no_gpu_process_gives_header_only_and_says_so(box):
    box.tool("nvidia-smi", stdout="")
    res = box.sample()
    assert res.returncode == 0, res.stderr
    assert rows_of(res.stdout) == []
    assert "source: nvidia-smi" in res.stderr
    assert "no GPU process named 'python'" in res.stderr
    assert box.args_of("nvidia-smi") == [
        "--query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits"
    ]


def test_nvidia_name_filter_keeps_python_and_versions_summing_gpus_in_bytes(box):
    box.tool("nvidia-smi", stdout=NVIDIA_SEVERAL)
    rows = rows_of(box.sample().stdout)
    assert [memory(r) for r in rows] == [
        ("101", "python3", str(2048 * MIB), "", "", ""),
        ("102", "python3.11", str(128 * MIB), "", "", ""),
        ("105", "python", "", "", "", ""),  # [N/A] = not reported, not zero
    ]


def test_nvidia_all_and_other_names(box):
    box.tool("nvidia-smi", stdout=NVIDIA_SEVERAL)
    rows = rows_of(box.sample("--all").stdout)
    assert [r["pid"] for r in rows] == ["101", "102", "103", "104", "105"]
    rows = rows_of(box.sample("--name", "Xorg").stdout)
    assert [memory(r) for r in rows] == [("103", "Xorg", str(12 * MIB), "", "", "")]
    rows = rows_of(box.sample("--name", "python*").stdout)
    assert [r["pid"] for r in rows] == ["101", "102", "104", "105"]


def test_nvidia_tool_failure_is_one_clear_error_naming_the_tool(box):
    box.tool("nvidia-smi", stdout="",
             stderr="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
             rc=9)
    res = box.sample()
    assert res.returncode == 3
    assert res.stdout.count("\n") <= 1  # at most the header
    errors = [l for l in res.stderr.splitlines() if "failed" in l]
    assert len(errors) == 1
    assert "nvidia-smi failed (exit 9)" in errors[0]
    assert "couldn't communicate with the NVIDIA driver" in errors[0]


def test_pid_mode_keeps_only_that_pid(box):
    me = os.getpid()
    box.tool("nvidia-smi", stdout=f"{me}, /usr/bin/python3, 512\n4, /usr/bin/python3, 1\n")
    rows = rows_of(box.sample("--pid", str(me)).stdout)
    assert [memory(r) for r in rows] == [(str(me), "python3", str(512 * MIB), "", "", "")]


def test_pid_that_does_not_exist_is_an_error(box):
    box.tool("nvidia-smi", stdout="")
    res = box.sample("--pid", str(DEAD_PID))
    assert res.returncode == 2
    assert f"no process with pid {DEAD_PID}" in res.stderr


def test_pid_that_exits_while_sampled_ends_the_sampler_with_a_message(box):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        box.tool("nvidia-smi", stdout=f"{victim.pid}, python3, 1\n")
        proc = subprocess.Popen([BASH, str(SCRIPT), "--pid", str(victim.pid), "--interval", "0.1"],
                                env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == ",".join(COLUMNS)
        assert proc.stdout.readline().split(",")[1] == str(victim.pid)
        victim.kill()
        victim.wait()  # reaped, so /proc/<pid> is gone
        out, err = proc.communicate(timeout=5)
        assert proc.returncode == 0
        assert f"process {victim.pid} exited" in err
    finally:
        victim.kill()
        victim.wait()


def test_out_file_gets_the_header_once_and_rows_appended(box):
    box.tool("nvidia-smi", stdout="7, python3, 3\n")
    out = box.root / "mem.csv"
    assert box.sample("--out", str(out), "--all").returncode == 0
    res = box.run("--out", str(out), "--all", "--count", "2", "--interval", "0")
    assert res.returncode == 0
    text = out.read_text()
    assert text.count("timestamp") == 1
    rows = rows_of(text)
    assert [memory(r) for r in rows] == [("7", "python3", str(3 * MIB), "", "", "")] * 3
    assert len(rows_of(res.stdout)) == 2  # the console got this run's rows too
    assert "done; 2 sample(s), 2 row(s)" in res.stderr


def test_ctrl_c_stops_cleanly_with_a_message(box):
    box.tool("nvidia-smi", stdout="7, python3, 3\n")
    proc = subprocess.Popen([BASH, str(SCRIPT), "--interval", "30"], env=box.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.readline()  # the first sample is out
    time.sleep(0.3)  # let it finish its bookkeeping and start the 30 s sleep
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=5)
    assert time.monotonic() - start < 5
    assert proc.returncode == 0
    assert "stopped by signal; 1 sample(s), 1 row(s)" in err


# ------------------------------------------------------------------------------------ rocm-smi

ROCM_SEVERAL = """WARNING: AMD GPU device(s) is/are in a low-power state. Check power control/runtime_status

{"system": {"PID2001": "python3, 1, 1073741824, 0, 0", "PID2002": "my, odd name, 2, 5, 0, 0", "PID2003": "python3.12, 1, UNKNOWN, 0, 0"}}
"""


def test_rocm_smi_name_filter_and_exact_bytes(box):
    box.tool("rocm-smi", stdout=ROCM_SEVERAL)
    res = box.sample()
    assert res.returncode == 0, res.stderr
    assert "source: rocm-smi" in res.stderr
    assert box.args_of("rocm-smi") == ["--showpids --json"]
    assert [memory(r) for r in rows_of(res.stdout)] == [
        ("2001", "python3", "1073741824", "", "", ""),
        ("2003", "python3.12", "", "", "", ""),
    ]
    rows = rows_of(box.sample("--all").stdout)
    assert ("2002", "my, odd name", "5", "", "", "") in [memory(r) for r in rows]


@pytest.mark.parametrize("stdout", ["", "{}\n", '{"system": {}}\n'])
def test_rocm_smi_without_processes(box, stdout):
    box.tool("rocm-smi", stdout=stdout)
    res = box.sample("--all")
    assert res.returncode == 0, res.stderr
    assert rows_of(res.stdout) == []


def test_rocm_smi_failure_names_the_tool(box):
    box.tool("rocm-smi", stderr="ERROR:root:Driver not initialized (amdgpu not found in modules)\n", rc=1)
    res = box.sample()
    assert res.returncode == 3
    assert "rocm-smi failed (exit 1): ERROR:root:Driver not initialized" in res.stderr


def test_nvidia_smi_comes_before_rocm_smi_unless_forced(box):
    box.tool("nvidia-smi", stdout="1, python3, 1\n")
    box.tool("rocm-smi", stdout='{"system": {"PID2": "python3, 1, 7, 0, 0"}}')
    assert [r["pid"] for r in rows_of(box.sample().stdout)] == ["1"]
    res = box.sample("--source", "rocm-smi")
    assert "source: rocm-smi" in res.stderr
    assert [memory(r) for r in rows_of(res.stdout)] == [("2", "python3", "7", "", "", "")]


# ------------------------------------------------------------------------------------ amd-smi

AMD_NEW = """[
  {"gpu": 0, "process_list": [
    {"process_info": {"name": "python3", "pid": 3001,
      "memory_usage": {"gtt_mem": {"value": 2097152, "unit": "B"}, "cpu_mem": {"value": 1, "unit": "B"},
                       "vram_mem": {"value": 536870912, "unit": "B"}},
      "mem_usage": {"value": 538968064, "unit": "B"}, "usage": {"gfx": {"value": 0, "unit": "ns"}}}},
    {"process_info": {"name": "Xorg", "pid": 3002,
      "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": 4096}, "mem_usage": 4096}},
    {"process_info": {"name": "kfdtest", "pid": 3004, "memory_usage": {"gtt_mem": "5 KB"}}}
  ]},
  {"gpu": 1, "process_list": [
    {"process_info": {"name": "python3", "pid": 3001,
      "memory_usage": {"gtt_mem": {"value": 1, "unit": "MB"}, "cpu_mem": 0, "vram_mem": {"value": 3, "unit": "MB"}}}}
  ]}
]
"""
# Older amd-smi: one process is a dict, not a list; no processes is a string.
AMD_OLD = """[WARNING] amd-smi: partial support on this platform
[{"gpu": 0, "values": {"process_info": {"name": "python", "pid": 3003, "mem": 1000,
  "memory_usage": {"gtt_mem": 10, "cpu_mem": 20, "vram_mem": 30}}}},
 {"gpu": 1, "values": {"process_info": "Not Found"}}]
"""


def test_amd_smi_vram_is_dedicated_gtt_is_shared_summed_over_gpus(box):
    box.tool("amd-smi", stdout=AMD_NEW)
    res = box.sample()
    assert res.returncode == 0, res.stderr
    assert "source: amd-smi" in res.stderr
    assert box.args_of("amd-smi") == ["process --json"]
    assert [memory(r) for r in rows_of(res.stdout)] == [
        ("3001", "python3", str(536870912 + 3 * MIB), str(2097152 + MIB), "", ""),
    ]
    rows = rows_of(box.sample("--all").stdout)
    assert [memory(r) for r in rows][1:] == [
        ("3002", "Xorg", "4096", "0", "", ""),
        ("3004", "kfdtest", "", "5120", "", ""),  # an unreported field stays empty, in place
    ]


def test_amd_smi_older_layout(box):
    box.tool("amd-smi", stdout=AMD_OLD)
    rows = rows_of(box.sample().stdout)
    assert [memory(r) for r in rows] == [("3003", "python", "30", "10", "", "")]


@pytest.mark.parametrize("stdout", ["", "[]", '[{"gpu": 0, "process_list": [{"process_info": "No running processes detected"}]}]'])
def test_amd_smi_without_processes(box, stdout):
    box.tool("amd-smi", stdout=stdout)
    res = box.sample("--all")
    assert res.returncode == 0, res.stderr
    assert rows_of(res.stdout) == []


def test_amd_smi_failure_names_the_tool(box):
    box.tool("amd-smi", stderr="AMDSMI_STATUS_INIT_ERROR\n", rc=255)
    res = box.sample()
    assert res.returncode == 3
    assert "amd-smi failed (exit 255): AMDSMI_STATUS_INIT_ERROR" in res.stderr


def test_unreadable_json_is_an_error_naming_the_tool(box):
    box.tool("amd-smi", stdout="{not json")
    res = box.sample()
    assert res.returncode == 3
    assert "amd-smi process --json: output not understood" in res.stderr


# ------------------------------------------------------------------------------------ sysfs

def test_sysfs_gives_a_device_wide_row(box):
    box.card("card0", vram=123456789, gtt=987654321)
    (box.sys / "class" / "drm" / "card0-DP-1").mkdir()  # a connector, not a card
    (box.sys / "class" / "drm" / "renderD128").mkdir()
    res = box.sample()
    assert res.returncode == 0, res.stderr
    assert "source: sysfs" in res.stderr
    assert "device-wide" in res.stderr
    assert [memory(r) for r in rows_of(res.stdout)] == [("", "device", "123456789", "987654321", "", "")]


def test_sysfs_several_cards_one_row_each(box):
    box.card("card0", vram=1, gtt=2)
    box.card("card1", vram=3)
    rows = rows_of(box.sample("--all").stdout)
    assert [memory(r) for r in rows] == [
        ("", "device:card0", "1", "2", "", ""),
        ("", "device:card1", "3", "", "", ""),
    ]


def test_tools_come_before_sysfs(box):
    box.card("card0", vram=1, gtt=2)
    box.tool("amd-smi", stdout="[]")
    assert "source: amd-smi" in box.sample().stderr


# ------------------------------------------------------------------------------------ errors

def test_no_source_is_a_one_line_error_exit_2(box):
    res = box.sample()
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "no GPU memory source" in lines[0]
    assert "nvidia-smi, rocm-smi, amd-smi" in lines[0]


def test_forced_source_that_is_absent_is_an_error(box):
    res = box.sample("--source", "nvidia-smi")
    assert res.returncode == 2
    assert "nvidia-smi is not on PATH" in res.stderr


@pytest.mark.parametrize("args, message", [
    (("--count", "x"), "--count wants an integer"),
    (("--interval", "-1"), "--interval wants seconds"),
    (("--pid", "abc"), "--pid wants a process id"),
    (("--pid", "1", "--all"), "choose one of --pid, --name, --all"),
    (("--source", "nvml"), "--source wants"),
    (("--frobnicate",), "unknown argument '--frobnicate'"),
    (("--out",), "--out needs a value"),
])
def test_bad_arguments_exit_2_with_the_reason(box, args, message):
    box.tool("nvidia-smi", stdout="")
    res = box.run(*args)
    assert res.returncode == 2
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_help_documents_the_columns(box):
    res = box.run("--help")
    assert res.returncode == 0
    assert ",".join(COLUMNS) in res.stdout
    for word in ("--pid", "--name", "--all", "--interval", "--count", "--out", "MINAGI_SYSFS_ROOT"):
        assert word in res.stdout
