#!/usr/bin/env bash
# gpu_mem_sampler.sh - per-process GPU memory sampler for Linux (NVIDIA or AMD), the twin of
# tools/gpu_mem_sampler.ps1. Run with --help for usage. Needs bash >= 4.2 (associative arrays,
# printf '%(...)T'); python3 only for the JSON of rocm-smi / amd-smi.
set -u
set -o pipefail

readonly PROG=gpu_mem_sampler
# Field separator of the internal records: the ASCII unit separator. Not a tab: tabs are IFS
# whitespace, so read would merge the empty fields that mean 'not reported'.
readonly US=$'\x1f'
readonly HEADER='timestamp,pid,process,dedicated,shared,local,non_local'

usage() {
    local text
    IFS= read -r -d '' text <<'EOF'
Usage: tools/gpu_mem_sampler.sh [--pid PID | --name NAME | --all] [--interval SECONDS]
                                [--count N] [--out FILE] [--source SOURCE]

Samples GPU memory every --interval seconds (default 30) and writes CSV rows
(timestamp,pid,process,dedicated,shared,local,non_local; memory in bytes, timestamp
ISO-8601 with UTC offset) to stdout and, with --out, appends them to FILE (the header
is written once, when FILE is new or empty). Messages go to stderr.

Which processes:
  --name NAME      processes whose executable name is NAME, or NAME plus a version
                   (default: python, which also matches python3 and python3.11);
                   shell wildcards allowed
  --pid PID        that one process; sampling ends with a message when it exits
  --all            every process that holds GPU memory

Options:
  --interval S     seconds between samples (default 30; 0 = back to back)
  --count N        take N samples, then exit (default 0 = until Ctrl-C)
  --out FILE       also append the rows to FILE
  --source SRC     force a source: nvidia-smi, rocm-smi, amd-smi or sysfs
                   (default: the first present, in that order)
  -h, --help       this help

Sources and columns (an empty field = not reported by that source; 0 = measured zero):
  nvidia-smi  --query-compute-apps=pid,process_name,used_memory (MiB * 1048576):
              dedicated = used memory; shared, local, non_local empty
  rocm-smi    --showpids --json: dedicated = VRAM used; shared, local, non_local empty
  amd-smi     process --json: dedicated = vram_mem, shared = gtt_mem; local, non_local empty
  sysfs       $MINAGI_SYSFS_ROOT/class/drm/card*/device/mem_info_{vram,gtt}_used (root
              default /sys): DEVICE-WIDE, one row per card, pid empty, process 'device'
              ('device:cardN' when there are several cards), dedicated = VRAM used,
              shared = GTT used; --name / --pid do not filter these rows
A process that uses several GPUs gets one row: its memory summed over them.

Exit status: 0 done (--count reached, Ctrl-C, or the --pid process exited);
2 bad arguments, no such --pid, or no source present; 3 the source tool failed on the
first sample (a later failure is reported and that sample skipped).
EOF
    printf '%s' "$text"
}

say() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { say "$1"; exit "${2:-2}"; }

# ---------------------------------------------------------------- arguments
mode=name
name=python
want_pid=
interval=30
count=0
out=
source_opt=
mode_set=

set_mode() {
    if [[ -n $mode_set && $mode_set != "$1" ]]; then
        die "choose one of --pid, --name, --all (got $mode_set and $1)"
    fi
    mode_set=$1
    mode=${1#--}
}

need_value() { [[ $# -ge 2 ]] || die "$1 needs a value (see --help)"; }

while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --pid) need_value "$@"; set_mode --pid; want_pid=$2; shift 2 ;;
        --pid=*) set_mode --pid; want_pid=${1#*=}; shift ;;
        --name) need_value "$@"; set_mode --name; name=$2; shift 2 ;;
        --name=*) set_mode --name; name=${1#*=}; shift ;;
        --all) set_mode --all; shift ;;
        --interval) need_value "$@"; interval=$2; shift 2 ;;
        --interval=*) interval=${1#*=}; shift ;;
        --count) need_value "$@"; count=$2; shift 2 ;;
        --count=*) count=${1#*=}; shift ;;
        --out) need_value "$@"; out=$2; shift 2 ;;
        --out=*) out=${1#*=}; shift ;;
        --source) need_value "$@"; source_opt=$2; shift 2 ;;
        --source=*) source_opt=${1#*=}; shift ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

[[ $want_pid =~ ^[0-9]+$ || $mode != pid ]] || die "--pid wants a process id, got '$want_pid'"
[[ $interval =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--interval wants seconds >= 0, got '$interval'"
[[ $count =~ ^[0-9]+$ ]] || die "--count wants an integer >= 0, got '$count'"
[[ -n $name ]] || die "--name wants a non-empty name"
case $source_opt in
    ''|nvidia-smi|rocm-smi|amd-smi|sysfs) ;;
    *) die "--source wants nvidia-smi, rocm-smi, amd-smi or sysfs, got '$source_opt'" ;;
esac

sysfs_root=${MINAGI_SYSFS_ROOT:-/sys}

# ---------------------------------------------------------------- helpers
iso_now() {
    local t
    printf -v t '%(%Y-%m-%dT%H:%M:%S%z)T' -1
    # %z gives +0200; ISO-8601 extended format wants +02:00.
    printf '%s' "${t:0:${#t}-2}:${t: -2}"
}

csv_field() {
    local s=$1
    if [[ $s == *[,\"$'\n\r']* ]]; then
        s=${s//\"/\"\"}
        s="\"$s\""
    fi
    printf '%s' "$s"
}

pid_alive() {
    [[ -d /proc/$1 ]] || kill -0 "$1" 2>/dev/null
}

name_matches() {
    # $1: executable base name. Unquoted $name on purpose: it may hold shell wildcards.
    # shellcheck disable=SC2053
    [[ $1 == $name || $1 == ${name}[0-9]* ]]
}

trim() {
    local s=$1
    s=${s#"${s%%[![:space:]]*}"}
    s=${s%"${s##*[![:space:]]}"}
    printf '%s' "$s"
}

sysfs_cards() {
    # Cards (not connectors such as card0-DP-1) that report VRAM use.
    local d
    for d in "$sysfs_root"/class/drm/card*; do
        [[ ${d##*/} =~ ^card[0-9]+$ && -r $d/device/mem_info_vram_used ]] && printf '%s\n' "$d"
    done
}

python_bin=
find_python() {
    [[ -n $python_bin ]] && return 0
    python_bin=$(command -v python3 || command -v python) \
        || die "$source needs python3 on PATH to read its JSON output"
}

# Reads the JSON of rocm-smi (--showpids --json) or amd-smi (process --json) on stdin and prints
# records "pid name dedicated shared local non_local" split by $US (bytes; empty = not reported).
read -r -d '' JSON_PARSER <<'PY'
import json, re, sys

kind = sys.argv[1]
SEP = "\x1f"  # the unit separator, as in the shell part
text = sys.stdin.read()
# The tools may print warnings (even "[WARNING] ...") before the JSON: take the first position
# that decodes. No bracket at all = no output = no processes.
data, decoder = None, json.JSONDecoder()
for i, ch in enumerate(text):
    if ch in "{[":
        try:
            data = decoder.raw_decode(text, i)[0]
            break
        except ValueError:
            continue
if data is None:
    if "{" in text or "[" in text:
        sys.exit("no JSON in it: " + " ".join(text.split())[:120])
    sys.exit(0)
UNITS = {"b": 1, "kb": 1024, "kib": 1024, "mb": 1024**2, "mib": 1024**2,
         "gb": 1024**3, "gib": 1024**3}

def nbytes(v, default_unit="b"):
    # int, "123", "123 MB" or {"value": 123, "unit": "MB"}; None where not reported.
    unit = default_unit
    if isinstance(v, dict):
        unit = str(v.get("unit", unit))
        v = v.get("value")
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return int(v * UNITS.get(unit.lower(), 1))
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(v))
    if not m:
        return None
    return int(float(m.group(1)) * UNITS.get((m.group(2) or unit).lower(), 1))

def cell(v):
    return "" if v is None else str(v)

rows = []
if kind == "rocm-smi":
    # {"system": {"PID1234": "python3, 1, 1073741824, 0, 0"}}: name, GPU(s), VRAM USED (bytes),
    # SDMA USED, CU OCCUPANCY. Split from the right: a name may hold ", ".
    for key, val in (data.get("system") or {}).items():
        m = re.fullmatch(r"PID(\d+)", key)
        if not m:
            continue
        parts = str(val).split(", ")
        if len(parts) < 5:
            continue
        rows.append((m.group(1), ", ".join(parts[:-4]), nbytes(parts[-3]), None))
else:
    # amd-smi: the layout changes between versions ("process_list" / "values", a dict instead of a
    # one-item list, "N/A" or "No running processes detected"), so look for any object with a pid.
    def walk(node):
        if isinstance(node, dict):
            if "pid" in node and ("memory_usage" in node or "mem_usage" in node or "mem" in node):
                yield node
                return
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)
    for info in walk(data):
        usage = info.get("memory_usage")
        if isinstance(usage, dict):
            vram, gtt = nbytes(usage.get("vram_mem")), nbytes(usage.get("gtt_mem"))
        else:
            vram, gtt = nbytes(info.get("mem_usage", info.get("mem"))), None
        rows.append((str(info["pid"]), str(info.get("name", "")), vram, gtt))
for pid, name, ded, shared in rows:
    name = name.replace(SEP, " ").replace("\n", " ")
    print(SEP.join((pid, name, cell(ded), cell(shared), "", "")))
PY

errfile=$(mktemp "${TMPDIR:-/tmp}/$PROG.XXXXXX") || die "cannot create a temporary file"
trap 'rm -f "$errfile"' EXIT

# Runs the source tool: its stdout into $tool_out; on failure a one-line reason into $tool_error.
run_tool() {
    local rc
    tool_out=$("$@" 2>"$errfile")
    rc=$?
    if [[ $rc -ne 0 ]]; then
        local first
        first=$(trim "$(head_line "$errfile")")
        [[ -n $first ]] || first=$(trim "${tool_out%%$'\n'*}")
        tool_error="$1 failed (exit $rc)${first:+: $first}"
        return 1
    fi
}

head_line() {
    local line=
    IFS= read -r line <"$1"
    printf '%s' "$line"
}

# Fills $data with records "pid name dedicated shared local non_local" (fields split by $US), one
# per process and GPU (or per card for sysfs). Runs in the main shell so that $tool_error survives.
collect() {
    data=
    case $source in
        nvidia-smi)
            run_tool nvidia-smi --query-compute-apps=pid,process_name,used_memory \
                --format=csv,noheader,nounits || return 1
            local line pid pname used
            while IFS= read -r line; do
                # "1234, /usr/bin/python3, 2048" - split at the first and last comma.
                pid=$(trim "${line%%,*}")
                [[ $pid =~ ^[0-9]+$ ]] || continue  # e.g. "No running processes found"
                used=$(trim "${line##*,}")
                pname=${line#*,}
                pname=$(trim "${pname%,*}")
                if [[ $used =~ ^[0-9]+$ ]]; then
                    used=$((used * 1048576))
                else
                    used=  # "[N/A]" (some drivers) = not reported
                fi
                data+="$pid$US$pname$US$used$US$US$US"$'\n'
            done <<<"$tool_out"
            ;;
        rocm-smi|amd-smi)
            local args=(--showpids --json)
            [[ $source == amd-smi ]] && args=(process --json)
            run_tool "$source" "${args[@]}" || return 1
            find_python
            if ! data=$("$python_bin" -c "$JSON_PARSER" "$source" <<<"$tool_out" 2>"$errfile"); then
                tool_error="$source ${args[*]}: output not understood: $(tail_line "$errfile")"
                return 1
            fi
            ;;
        sysfs)
            local card cards label vram gtt n=0
            cards=$(sysfs_cards)
            [[ -n $cards ]] || { tool_error="sysfs: no $sysfs_root/class/drm/card*/device/mem_info_vram_used any more"; return 1; }
            while IFS= read -r card; do n=$((n + 1)); done <<<"$cards"
            while IFS= read -r card; do
                vram=$(trim "$(head_line "$card/device/mem_info_vram_used")")
                gtt=
                [[ -r $card/device/mem_info_gtt_used ]] && gtt=$(trim "$(head_line "$card/device/mem_info_gtt_used")")
                label=device
                [[ $n -gt 1 ]] && label="device:${card##*/}"
                data+="$US$label$US$vram$US$gtt$US$US"$'\n'
            done <<<"$cards"
            ;;
    esac
}

tail_line() {
    local line last=
    while IFS= read -r line; do [[ -n $line ]] && last=$line; done <"$1"
    printf '%s' "$last"
}

# Sums $data per pid (a process on several GPUs gives one row) into the arrays below, in order of
# first appearance. Empty stays empty (not reported); numbers add up.
aggregate() {
    order=()
    pname_of=() ded_sum=() sh_sum=() loc_sum=() nl_sum=()
    local pid pname ded shared loc nonloc key
    while IFS=$US read -r pid pname ded shared loc nonloc; do
        [[ -n $pid || -n $pname ]] || continue
        key=${pid:-$pname}
        if [[ -z ${pname_of[$key]+x} ]]; then
            order+=("$key")
            pname_of[$key]=$pname
            ded_sum[$key]=$ded sh_sum[$key]=$shared loc_sum[$key]=$loc nl_sum[$key]=$nonloc
        else
            [[ -n $ded ]] && ded_sum[$key]=$(( ${ded_sum[$key]:-0} + ded ))
            [[ -n $shared ]] && sh_sum[$key]=$(( ${sh_sum[$key]:-0} + shared ))
            [[ -n $loc ]] && loc_sum[$key]=$(( ${loc_sum[$key]:-0} + loc ))
            [[ -n $nonloc ]] && nl_sum[$key]=$(( ${nl_sum[$key]:-0} + nonloc ))
        fi
    done <<<"$data"
}
declare -A pname_of=() ded_sum=() sh_sum=() loc_sum=() nl_sum=()
order=()

# ---------------------------------------------------------------- source
source=$source_opt
if [[ -z $source ]]; then
    for s in nvidia-smi rocm-smi amd-smi; do
        if command -v "$s" >/dev/null 2>&1; then
            source=$s
            break
        fi
    done
fi
if [[ -z $source && -n $(sysfs_cards) ]]; then
    source=sysfs
fi
[[ -n $source ]] || die "no GPU memory source: none of nvidia-smi, rocm-smi, amd-smi on PATH and no $sysfs_root/class/drm/card*/device/mem_info_vram_used"
case $source in
    sysfs)
        [[ -n $(sysfs_cards) ]] || die "--source sysfs: no $sysfs_root/class/drm/card*/device/mem_info_vram_used"
        say "source: sysfs ($sysfs_root/class/drm/card*/device/mem_info_*_used, device-wide)"
        [[ $mode == all ]] || say "sysfs is device-wide: --$mode does not filter its rows"
        ;;
    *)
        command -v "$source" >/dev/null 2>&1 || die "--source $source: $source is not on PATH"
        say "source: $source ($(command -v "$source"))"
        ;;
esac

if [[ $mode == pid ]] && ! pid_alive "$want_pid"; then
    die "no process with pid $want_pid"
fi

# ---------------------------------------------------------------- sampling
samples=0
rows_written=0
sleep_pid=
stop() {
    # Kill the pending sleep (it holds our stdout open); jobs -p also finds one whose pid the
    # signal beat into $sleep_pid.
    local job
    for job in $sleep_pid $(jobs -p); do kill "$job" 2>/dev/null; done
    say "$1; $samples sample(s), $rows_written row(s)${out:+ in $out}"
    exit "${2:-0}"
}
trap 'stop "stopped by signal"' INT TERM HUP

if [[ -n $out && ! -s $out ]]; then
    { printf '%s\n' "$HEADER" >>"$out"; } 2>/dev/null || die "cannot write to --out '$out'"
fi
printf '%s\n' "$HEADER"

was_empty=
while :; do
    if [[ $mode == pid ]] && ! pid_alive "$want_pid"; then
        stop "process $want_pid exited"
    fi
    ts=$(iso_now)
    tool_out=
    tool_error=
    if collect; then
        aggregate
        batch=
        nrows=0
        for key in "${order[@]}"; do
            pname=${pname_of[$key]}
            base=${pname##*/}
            pid=$key
            if [[ $source == sysfs ]]; then
                pid=
            else
                case $mode in
                    pid) [[ $pid == "$want_pid" ]] || continue ;;
                    name) name_matches "$base" || continue ;;
                esac
            fi
            batch+="$ts,$pid,$(csv_field "$base"),${ded_sum[$key]},${sh_sum[$key]},${loc_sum[$key]},${nl_sum[$key]}"$'\n'
            nrows=$((nrows + 1))
        done
        if [[ $nrows -gt 0 ]]; then
            printf '%s' "$batch"
            if [[ -n $out ]]; then
                { printf '%s' "$batch" >>"$out"; } 2>/dev/null || die "cannot write to --out '$out'"
            fi
            rows_written=$((rows_written + nrows))
            was_empty=
        elif [[ -z $was_empty ]]; then
            # Said once per stretch of empty samples, not every interval.
            case $mode in
                pid) say "$ts: process $want_pid holds no GPU memory ($source)" ;;
                name) say "$ts: no GPU process named '$name' ($source)" ;;
                all) say "$ts: no GPU process ($source)" ;;
            esac
            was_empty=1
        fi
    elif [[ $samples -eq 0 ]]; then
        die "$tool_error" 3
    else
        # Later failures are often transient (a driver hiccup): report, skip this sample.
        say "$ts: sample skipped: $tool_error"
    fi
    samples=$((samples + 1))
    if [[ $count -gt 0 && $samples -ge $count ]]; then
        stop "done"
    fi
    sleep "$interval" &
    sleep_pid=$!
    wait "$sleep_pid"
    sleep_pid=
done
